"""Modifiers: what a ``base+modifier`` name changes in its base scorer, each a wrapper of the base.

A modifier changes what the attention accumulates per slot (OBCache's saliencies: ``score_kind``,
one of ``kvjax.kernels.SCORE_KINDS``), how the priority is formed from the base scorer's (CAOTE:
``priority`` wraps the base's), or how eviction and attention use the evicted tokens (MomentKV:
``mi``, ``nc``, ``zeroth``). Which bases take which modifier is each base's ``modifiers``.
``Modifier()`` itself changes nothing: the plain base.
"""

from __future__ import annotations

import dataclasses

import jax

from kvjax.eviction.priority import aggregate, caote, pool


@dataclasses.dataclass(frozen=True)
class Modifier:
    """A modifier that changes nothing; the others subclass it.

    Fields:
        description: one line for the tables.
        score_kind: what the attention accumulates per slot (``kvjax.kernels.SCORE_KINDS``).
        mi: MomentKV's moment-informed eviction.
        nc: MomentKV's normalization-corrected attention.
        zeroth: both from the value mean only.
    """

    description: str = ""
    score_kind: str = "attn"
    mi: bool = False
    nc: bool = False
    zeroth: bool = False

    @property
    def reads_v(self) -> bool:
        """Its priority reads the cached values of every slot."""
        return False

    def priority(
        self,
        base,
        policy,
        state: jax.Array,
        pos: jax.Array,
        unprotected: jax.Array,
        k: jax.Array | None,
        v: jax.Array | None,
        order: jax.Array,
        stats,
        seen: jax.Array,
    ) -> jax.Array:
        """[B, Hk, S] the priority of one layer's slots: the ``base`` scorer's (``Base.priority``,
        whose arguments these are)."""
        return base.priority(policy, state, pos, unprotected, k, v, order, stats, seen)


@dataclasses.dataclass(frozen=True)
class OBCache(Modifier):
    """OBCache: an output-aware saliency replaces the attention column (``score_kind``)."""


@dataclasses.dataclass(frozen=True)
class CAOTE(Modifier):
    """CAOTE's meta-score over the base score, per query head before the heads aggregate.

    Fields:
        fast: FastCAOTE (the plain mean of the values instead of the score-weighted one).
    """

    fast: bool = False

    @property
    def reads_v(self) -> bool:
        return True

    def priority(self, base, policy, state, pos, unprotected, k, v, order, stats, seen):
        """The base's per-head score pooled, CAOTE's meta-score of it, then the heads aggregated
        (its normalisation is per attention distribution)."""
        per_head = state
        if policy.pool != "none":
            per_head = pool(per_head, unprotected, policy.pool, policy.kernel, order)
        return aggregate(policy.aggregate, caote(per_head, v, pos >= 0, fast=self.fast))


@dataclasses.dataclass(frozen=True)
class MomentKV(Modifier):
    """MomentKV: the evicted tokens' moments inform eviction (``mi``) and correct attention
    (``nc``)."""


MODIFIERS: dict[str, Modifier] = {
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
    "caote": CAOTE("CAOTE: h/(1−h) ‖Σ h_i v_i − v_j‖ over the base score h normalised to sum 1"),
    "fastcaote": CAOTE("FastCAOTE: h/(1−h) ‖mean(v) − v_j‖", fast=True),
    "momentkv": MomentKV(
        "MomentKV: moment-informed eviction (score × ‖residual‖, one token at a time) "
        "and normalization-corrected attention",
        mi=True,
        nc=True,
    ),
    "momentkv-mi": MomentKV("MomentKV moment-informed eviction only", mi=True),
    "momentkv-nc": MomentKV(
        "MomentKV normalization-corrected attention only (eviction by the base score)", nc=True
    ),
    "momentkv-zeroth": MomentKV(
        "MomentKV zeroth order: residual v − v̄ and correction by v̄ (no outer-product term)",
        mi=True,
        nc=True,
        zeroth=True,
    ),
}
NO_MODIFIER = Modifier()
