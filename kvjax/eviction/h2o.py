"""H2O: attention accumulated over every query seen, prompt queries included."""

from __future__ import annotations

import dataclasses

from kvjax.eviction.base import Base


@dataclasses.dataclass(frozen=True)
class H2O(Base):
    name = "h2o"
    description = "attention accumulated over every query seen, prompt queries included"
    queries = "all"
    window_rule = "quarter"
