"""CAOTE: a meta-score over the base score, the output change the eviction of a token causes."""

from __future__ import annotations

import dataclasses

from kvjax.eviction.modifiers.base import Modifier
from kvjax.eviction.priority import aggregate, caote, pool


@dataclasses.dataclass(frozen=True)
class CAOTE(Modifier):
    """CAOTE's meta-score over the base score, per query head before the heads aggregate.

    Fields:
        fast: FastCAOTE (the plain mean of the values instead of the score-weighted one).
    """

    fast: bool = False

    @property
    def reads_kv(self) -> bool:
        return True

    @property
    def reads_head_states(self) -> bool:
        return True

    def priority(self, base, policy, state, pos, unprotected, k, v, order, stats, seen):
        """The base's per-head score pooled, CAOTE's meta-score of it, then the heads aggregated
        (its normalisation is per attention distribution)."""
        per_head = state
        if policy.pool != "none":
            per_head = pool(per_head, unprotected, policy.pool, policy.kernel, order)
        return aggregate(policy.aggregate, caote(per_head, v, pos >= 0, fast=self.fast))


ENTRIES = {
    "caote": CAOTE("CAOTE: h/(1−h) ‖Σ h_i v_i − v_j‖ over the base score h normalised to sum 1"),
    "fastcaote": CAOTE("FastCAOTE: h/(1−h) ‖mean(v) − v_j‖", fast=True),
}
