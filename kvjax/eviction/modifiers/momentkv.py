"""MomentKV: the evicted tokens' moments inform eviction (MI: ``choose``, the sequential rule of
``kvjax.eviction.moments.moment_informed_eviction``) and correct the attention (NC: ``correction``
and ``correct``; the kernels' ``corrected_attention``)."""

from __future__ import annotations

import dataclasses

from kvjax.eviction.modifiers.base import Modifier
from kvjax.eviction.moments import moment_informed_eviction, scores_at_once
from kvjax.kernels import corrected_attention


@dataclasses.dataclass(frozen=True)
class MomentKV(Modifier):
    """MomentKV.

    Fields:
        mi: moment-informed eviction.
        nc: normalization-corrected attention.
        zeroth: both from the value mean only (no outer-product term).
    """

    mi: bool = False
    nc: bool = False
    zeroth: bool = False

    @property
    def reads_kv(self) -> bool:
        return self.mi

    @property
    def corrects_attention(self) -> bool:
        return self.nc

    @property
    def sequential_choice(self) -> bool:
        return self.mi

    def moments_dims(self, head_dim: int) -> tuple[int, int]:
        return head_dim, 0 if self.zeroth else head_dim

    def check(self, name: str, keywords: dict) -> None:
        if self.mi and keywords["aggregate"] == "layer":
            raise ValueError(
                f"aggregate='layer' cannot be combined with {name!r}: its moment-informed "
                "eviction scores every KV head by its own statistics, so the heads' kept tokens "
                "diverge"
            )

    def correction(self, moments) -> tuple:
        return (moments, self.zeroth) if self.nc else (None, False)

    def correct(self, out, lse, q, moments):
        return corrected_attention(out, lse, q, moments, self.zeroth) if self.nc else out

    def residuals(self, moments, max_drop, policy):
        if self.mi and scores_at_once(max_drop, policy.mi_batch):
            return moments, self.zeroth
        return None

    def choose(
        self,
        prio,
        unprotected,
        n_evict,
        k,
        v,
        pos,
        moments,
        max_drop,
        policy,
        stack=None,
        norms=None,
    ):
        if not self.mi:
            return None
        return moment_informed_eviction(
            prio,
            unprotected,
            n_evict,
            k,
            v,
            pos,
            moments,
            self.zeroth,
            max_drop,
            policy.mi_batch,
            stack=stack,
            norms=norms,
            impl=policy.impl,
        )


ENTRIES = {
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
