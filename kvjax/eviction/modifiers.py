"""Modifiers: what a ``base+modifier`` name changes in its base scorer.

A modifier changes what the attention accumulates per slot (OBCache's saliencies, a ``score_kind`` of
``kvjax.kernels``), how the priority is formed from the base score (CAOTE's meta-score, ``meta``), or how
eviction and attention use the evicted tokens (MomentKV: ``mi``, ``nc``, ``zeroth``). Which bases take which
modifier is each base's ``modifiers``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Modifier:
    """description: one line for the tables;
    score_kind: what the attention accumulates per slot (``kvjax.kernels.SCORE_KINDS``);
    meta: CAOTE's meta-score over the base priority ("caote" / "fastcaote");
    mi: MomentKV's moment-informed eviction;
    nc: its normalization-corrected attention;
    zeroth: both from the value mean only."""

    description: str
    score_kind: str = "attn"
    meta: str | None = None
    mi: bool = False
    nc: bool = False
    zeroth: bool = False


MODIFIERS: dict[str, Modifier] = {
    "obcache-value": Modifier("OBCache value-pruning saliency Σ A² ‖v‖² replaces the attention column",
                              score_kind="obcache-value"),
    "obcache-key": Modifier("OBCache key-pruning saliency Σ (A z)² ‖v − o‖² replaces the attention column",
                            score_kind="obcache-key"),
    "obcache-joint": Modifier("OBCache joint saliency (value + key + 2 Σ A² z (‖v‖² − v·o)) replaces the "
                              "attention column", score_kind="obcache-joint"),
    "caote": Modifier("CAOTE: h/(1−h) ‖Σ h_i v_i − v_j‖ over the base score h normalised to sum 1",
                      meta="caote"),
    "fastcaote": Modifier("FastCAOTE: h/(1−h) ‖mean(v) − v_j‖", meta="fastcaote"),
    "momentkv": Modifier("MomentKV: moment-informed eviction (score × ‖residual‖, one token at a time) and "
                         "normalization-corrected attention", mi=True, nc=True),
    "momentkv-mi": Modifier("MomentKV moment-informed eviction only", mi=True),
    "momentkv-nc": Modifier("MomentKV normalization-corrected attention only (eviction by the base score)",
                            nc=True),
    "momentkv-zeroth": Modifier("MomentKV zeroth order: residual v − v̄ and correction by v̄ (no "
                                "outer-product term)", mi=True, nc=True, zeroth=True),
}
NO_MODIFIER = Modifier("")
