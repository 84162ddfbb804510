"""KVzip's context-independent mode: whole KV heads kept by saved head scores, no scoring pass."""

from __future__ import annotations

import dataclasses

from kvjax.eviction.base import Base


@dataclasses.dataclass(frozen=True)
class KVzipHead(Base):
    name = "kvzip-head"
    description = (
        "KVzip's context-independent mode: whole KV heads kept, the best by saved head scores "
        "(`head_scores`), the rest cut to the sinks and window; no scoring pass"
    )
    replace = True
    window_rule = "obs"
    scoring_pass = "heads"
    default_allocation = "heads"
    modifiers = ()
