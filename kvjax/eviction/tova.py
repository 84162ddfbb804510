"""TOVA: the attention of the newest query alone."""

from __future__ import annotations

import dataclasses

from kvjax.eviction.base import Base


@dataclasses.dataclass(frozen=True)
class TOVA(Base):
    name = "tova"
    description = "attention of the newest query"
    queries = "last"
    replace = True
    reset_after_evict = True
