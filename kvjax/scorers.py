"""Eviction scorers: one grammar of names (``base`` or ``base+modifier``) and the static ``Policy``.

Bases say which queries of a step score (``queries``), how their per-slot statistic updates the state
(accumulate or replace) and whether the state is reset at eviction points; see ``docs/eviction.md``.
Modifiers change what is scored or how:
- ``obcache-value|key|joint``: OBCache's output-aware saliency replaces the attention column (OBCache §3.3);
- ``caote`` / ``fastcaote``: CAOTE's meta-score over the base score (CAOTE §3);
- ``momentkv`` (MI + NC), ``momentkv-mi``, ``momentkv-nc``, ``momentkv-zeroth`` (MI + NC with the value mean
  only): MomentKV's moment-informed eviction and normalization-corrected inference (MomentKV §4).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax.kernels import IMPLS
from kvjax.slots import row_head_index

AGGREGATES = ("sum", "mean", "max", "layer")  # "layer": mean over all query heads of the layer
POOLS = ("none", "max", "avg")


@dataclasses.dataclass(frozen=True)
class ScorerSpec:
    queries: str  # "none" | "all" | "last" | "window"
    update: str  # "accumulate" | "replace"
    reset_after_evict: bool
    default_window: str  # "zero" | "quarter" (budget // 4) | "obs" (the observation window)
    default_pool: str = "none"
    description: str = ""


SCORERS: dict[str, ScorerSpec] = {
    "streamingllm": ScorerSpec("none", "accumulate", False, "zero",
                               description="the n_sink first and the most recent tokens"),
    "h2o": ScorerSpec("all", "accumulate", False, "quarter",
                      description="attention accumulated over every query seen"),
    "tova": ScorerSpec("last", "replace", True, "zero", description="attention of the newest query"),
    "snapkv": ScorerSpec("window", "accumulate", True, "obs", default_pool="max",
                         description="attention of the last obs_window queries, pooled along positions"),
}

MODIFIERS: dict[str, str] = {
    "obcache-value": "OBCache value-pruning saliency Σ A² ‖v‖² replaces the attention column",
    "obcache-key": "OBCache key-pruning saliency Σ (A z)² ‖v − o‖² replaces the attention column",
    "obcache-joint": "OBCache joint saliency (value + key + 2 Σ A² z (‖v‖² − v·o)) replaces the attention column",
    "caote": "CAOTE: h/(1−h) ‖Σ h_i v_i − v_j‖ over the base score h normalised to sum 1",
    "fastcaote": "FastCAOTE: h/(1−h) ‖mean(v) − v_j‖",
    "momentkv": "MomentKV: moment-informed eviction (score × ‖residual‖, one token at a time) and "
                "normalization-corrected attention",
    "momentkv-mi": "MomentKV moment-informed eviction only",
    "momentkv-nc": "MomentKV normalization-corrected attention only (eviction by the base score)",
    "momentkv-zeroth": "MomentKV zeroth order: residual v − v̄ and correction by v̄ (no outer-product term)",
}
ALIASES = {"momentkv": "snapkv+momentkv"}
MI_MODIFIERS = ("momentkv", "momentkv-mi", "momentkv-zeroth")  # those with moment-informed eviction
ATTENTION_BASES = ("h2o", "tova", "snapkv")


def scorer_names() -> list[str]:
    """Every valid scorer name."""
    names = list(SCORERS) + [f"{b}+{m}" for b in ATTENTION_BASES for m in MODIFIERS]
    return names + ["streamingllm+momentkv-nc"] + list(ALIASES)


def split_name(name: str) -> tuple[str, str]:
    """``"snapkv+caote"`` -> ``("snapkv", "caote")``, validating against the grammar."""
    full = ALIASES.get(name, name)
    if not isinstance(name, str) or full not in scorer_names():
        raise ValueError(f"scorer={name!r} is unknown; valid scorers: {', '.join(sorted(scorer_names()))}")
    base, _, modifier = full.partition("+")
    return base, modifier


@dataclasses.dataclass(frozen=True)
class Policy:
    """Everything static about eviction: which scorer, the budget and the protected slots.

    budget: slots kept per (layer, row, KV head); n_sink: first tokens never evicted; window: most recent
    tokens never evicted; obs_window: scoring queries of "window" scorers; pool/kernel: 1-D pooling of the
    priorities along positions; aggregate: how the G query heads of a KV head combine ("layer": every
    query head of the layer, the same tokens kept in every KV head); mi_batch: tokens
    MomentKV's moment-informed eviction removes per statistics update (1 = Algorithm 1's exact rule);
    impl: how attention with scores runs (``kvjax.kernels``: None = per platform, XLA on CPU; "xla";
    "pallas" = the platform's kernels, interpreted on CPU; "pallas_tpu" / "pallas_gpu").
    """

    scorer: str
    budget: int
    n_sink: int
    window: int
    obs_window: int
    pool: str
    kernel: int
    aggregate: str
    modifier: str = ""
    mi_batch: int = 1
    impl: str | None = None

    @property
    def spec(self) -> ScorerSpec:
        return SCORERS[self.scorer]

    @property
    def name(self) -> str:
        return f"{self.scorer}+{self.modifier}" if self.modifier else self.scorer

    @property
    def score_kind(self) -> str:
        """What ``kvjax.ops.attention_with_scores`` accumulates: "attn" or an OBCache saliency."""
        return self.modifier if self.modifier.startswith("obcache") else "attn"

    @property
    def moment_eviction(self) -> bool:
        return self.modifier in MI_MODIFIERS

    @property
    def moment_correction(self) -> bool:
        return self.modifier in ("momentkv", "momentkv-nc", "momentkv-zeroth")

    @property
    def zeroth_order(self) -> bool:
        return self.modifier == "momentkv-zeroth"


def make_policy(scorer: str, budget: int, *, n_sink: int = 4, window: int | None = None, obs_window: int = 32,
                pool: str | None = None, kernel: int = 7, aggregate: str | None = None, mi_batch: int = 1,
                impl: str | None = None) -> Policy:
    """Validated ``Policy`` with the papers' defaults for what is left as None (aggregate: ``sum`` for
    OBCache as in its App. B.5, else ``mean`` as kvpress; the two rank identically)."""
    base, modifier = split_name(scorer)
    spec = SCORERS[base]
    for name, value in (("budget", budget), ("obs_window", obs_window), ("kernel", kernel), ("mi_batch", mi_batch)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if not (isinstance(n_sink, int) and n_sink >= 0):
        raise ValueError(f"n_sink={n_sink!r} must be an integer >= 0")
    if window is None:
        window = {"zero": 0, "quarter": budget // 4, "obs": obs_window}[spec.default_window]
    if not (isinstance(window, int) and window >= 0):
        raise ValueError(f"window={window!r} must be an integer >= 0")
    if budget <= n_sink + window:
        raise ValueError(f"budget={budget} must be larger than n_sink + window = {n_sink} + {window}")
    pool = spec.default_pool if pool is None else pool
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r} must be one of {POOLS}")
    if pool != "none" and kernel % 2 == 0:
        raise ValueError(f"kernel={kernel} must be odd (pooling is centred on each token)")
    aggregate = aggregate or ("sum" if modifier.startswith("obcache") else "mean")
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate={aggregate!r} must be one of {AGGREGATES}")
    if aggregate == "layer" and modifier in MI_MODIFIERS:
        raise ValueError(f"aggregate='layer' cannot be combined with {modifier!r}: its moment-informed eviction "
                         "scores every KV head by its own statistics, so the heads' kept tokens diverge")
    if mi_batch > 1 and modifier not in MI_MODIFIERS:
        raise ValueError(f"mi_batch={mi_batch} only applies to MomentKV's moment-informed eviction "
                         "(scorers ending in +momentkv, +momentkv-mi, +momentkv-zeroth)")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    return Policy(base, budget, n_sink, window, obs_window, pool, kernel, aggregate, modifier, mi_batch, impl)


def query_weights(policy: Policy, positions: jax.Array, valid: jax.Array, end: jax.Array) -> jax.Array | None:
    """[B, T] float32 weights of the scoring queries among a step's tokens, or None if the scorer has none.

    positions, valid: [B, T]; end: [B] one past the last position of the scoring span.
    """
    kind = policy.spec.queries
    if kind == "none":
        return None
    if kind == "all":
        chosen = valid
    elif kind == "last":
        chosen = valid & (positions == end[:, None] - 1)
    else:
        chosen = valid & (positions >= end[:, None] - policy.obs_window)
    return chosen.astype(jnp.float32)


def update_state(policy: Policy, state: jax.Array, col: jax.Array | None, has_query: jax.Array) -> jax.Array:
    """state, col: [B, Hk, G, S]; has_query: [B] whether the row had a scoring query this step."""
    if col is None:
        return state
    if policy.spec.update == "replace":
        return jnp.where(has_query[:, None, None, None], col, state)
    return state + col


def _pool(x: jax.Array, present: jax.Array, kind: str, kernel: int, order: jax.Array) -> jax.Array:
    """1-D pooling of x [B, Hk, ..., S] along positions, among the ``present`` [B, Hk, S] slots.

    ``order`` [B, Hk, S] lists the slots by position. In that order the present (unprotected) slots are one
    contiguous run: valid slots come first, the sinks are a prefix and the recent window a suffix of them.
    So a token's neighbours are the present tokens within ``kernel // 2`` places on either side; absent
    ones are left out (``max``) or counted as 0 (``avg``, divided by ``kernel``). Absent entries of x are
    returned unchanged.
    """
    extra = x.ndim - 3
    by_pos = order.reshape(order.shape[:2] + (1,) * extra + order.shape[2:])
    present = jnp.broadcast_to(jnp.take_along_axis(present, order, -1).reshape(by_pos.shape), x.shape)
    xs = jnp.take_along_axis(x, jnp.broadcast_to(by_pos, x.shape), -1)
    S = x.shape[-1]
    fill = -jnp.inf if kind == "max" else 0.0
    half = kernel // 2
    padded = jnp.pad(jnp.where(present, xs, fill), [(0, 0)] * (x.ndim - 1) + [(half, kernel - 1 - half)],
                     constant_values=fill)
    shifted = [padded[..., i: i + S] for i in range(kernel)]
    pooled = functools.reduce(jnp.maximum, shifted) if kind == "max" else sum(shifted) / kernel
    pooled = jnp.where(present, pooled, xs)
    rank = jnp.zeros_like(order).at[row_head_index(order) + (order,)].set(jnp.arange(S, dtype=order.dtype))
    return jnp.take_along_axis(pooled, jnp.broadcast_to(rank.reshape(by_pos.shape), x.shape), -1)


def _aggregate(policy: Policy, per_head: jax.Array) -> jax.Array:
    """[B, Hk, G, S] -> [B, Hk, S]. "layer" averages every query head of the layer (TOVA's and kvpress's
    choice) and gives the mean to every KV head: their slots hold the same positions (equal priorities
    make equal choices from the first eviction on), so every KV head keeps the same tokens."""
    if policy.aggregate == "layer":
        B, Hk, _, S = per_head.shape
        return jnp.broadcast_to(jnp.mean(per_head, axis=(1, 2))[:, None], (B, Hk, S))
    return {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max}[policy.aggregate](per_head, axis=2)


def caote(h: jax.Array, v: jax.Array, valid: jax.Array, fast: bool) -> jax.Array:
    """CAOTE meta-score per query head. h: [B, Hk, G, S] base scores; v: [B, Hk, S, K]; valid: [B, Hk, S].

    h is normalised to sum 1 over the valid slots; c_j = h_j/(1 − h_j) ‖m − v_j‖ with m = Σ h_i v_i
    (CAOTE) or the plain mean of the valid values (FastCAOTE).
    """
    valid4 = valid[:, :, None, :]
    h = jnp.where(valid4, jnp.maximum(h, 0.0), 0.0)
    h = h / jnp.maximum(h.sum(-1, keepdims=True), 1e-30)
    vf = v.astype(jnp.float32)
    if fast:
        mix = (jnp.einsum("bhs,bhsk->bhk", valid.astype(jnp.float32), vf)
               / jnp.maximum(valid.sum(-1), 1)[..., None])[:, :, None, :]
    else:
        mix = jnp.einsum("bhgs,bhsk->bhgk", h, vf)
    dist = jnp.linalg.norm(mix[:, :, :, None, :] - vf[:, :, None, :, :], axis=-1)  # [B, Hk, G, S]
    return h / jnp.maximum(1.0 - h, 1e-12) * dist


def priority(policy: Policy, state: jax.Array, pos: jax.Array, unprotected: jax.Array, v: jax.Array,
             order: jax.Array) -> jax.Array:
    """[B, Hk, S] float32 priority (higher = kept) of the unprotected valid slots.

    state: [B, Hk, G, S]; pos: [B, Hk, S] (-1 = empty); unprotected: [B, Hk, S] valid and evictable;
    v: [B, Hk, S, K] cached values (for CAOTE); order: [B, Hk, S] the slots by position (for pooling).
    Plain scores aggregate the query heads, then pool; CAOTE pools and scores per query head, then
    aggregates (its normalisation is per attention distribution).
    """
    if policy.scorer == "streamingllm":
        return pos.astype(jnp.float32)
    if policy.modifier in ("caote", "fastcaote"):
        per_head = state
        if policy.pool != "none":
            per_head = _pool(per_head, unprotected, policy.pool, policy.kernel, order)
        return _aggregate(policy, caote(per_head, v, pos >= 0, fast=policy.modifier == "fastcaote"))
    agg = _aggregate(policy, state)
    if policy.pool != "none":
        agg = _pool(agg, unprotected, policy.pool, policy.kernel, order)
    return agg
