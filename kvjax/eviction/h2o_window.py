"""H2O's prefill variant of OBCache App. C.2.1: scored by the last ``obs_window`` prompt queries."""

from __future__ import annotations

import dataclasses

from kvjax.eviction.base import Base


@dataclasses.dataclass(frozen=True)
class H2OWindow(Base):
    name = "h2o-window"
    description = (
        "H2O's prefill variant (OBCache App. C.2.1): attention accumulated over the last "
        "obs_window prompt queries (kept as the window; the papers use 16), then every decoding "
        "query"
    )
    queries = "window"
    window_rule = "obs"
