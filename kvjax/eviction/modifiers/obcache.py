"""OBCache: an output-aware saliency replaces the attention column that the base accumulates. Its
saliencies are computed inside the attention kernels' score pass (``score_kind``:
``kvjax.kernels.SCORE_KINDS``), beside the attention they read."""

from __future__ import annotations

import dataclasses

from kvjax.eviction.modifiers.base import Modifier


@dataclasses.dataclass(frozen=True)
class OBCache(Modifier):
    """OBCache's saliency in place of the attention column (``score_kind``)."""


ENTRIES = {
    "obcache-value": OBCache(
        "OBCache value-pruning saliency Σ A² ‖v‖² replaces the attention column",
        score_kind="obcache-value",
    ),
    "obcache-key": OBCache(
        "OBCache key-pruning saliency Σ (A z)² ‖v − o‖² replaces the attention column",
        score_kind="obcache-key",
    ),
    "obcache-joint": OBCache(
        "OBCache joint saliency (value + key + 2 Σ A² z (‖v‖² − v·o)) replaces the "
        "attention column",
        score_kind="obcache-joint",
    ),
}
