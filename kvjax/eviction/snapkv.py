"""SnapKV: the attention of the last ``obs_window`` queries, max-pooled along positions."""

from __future__ import annotations

import dataclasses

from kvjax.eviction.base import Base


@dataclasses.dataclass(frozen=True)
class SnapKV(Base):
    name = "snapkv"
    description = "attention of the last obs_window queries, pooled along positions"
    queries = "window"
    reset_after_evict = True
    window_rule = "obs"
    default_pool = "max"
