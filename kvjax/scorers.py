"""Eviction scorers behind one registry, and the static ``Policy`` that configures one.

Interface (see ``docs/eviction.md``): a scorer says which queries of a step are *scoring queries*
(``queries``), how their attention column sums ``col [B, Hk, G, S]`` update the per-slot state
(``update``: accumulate or replace), whether the state is reset after an eviction, and how the state turns
into an eviction priority (``priority``: group aggregation, then optional pooling along positions).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

AGGREGATES = ("sum", "mean", "max")
POOLS = ("none", "max", "avg")


@dataclasses.dataclass(frozen=True)
class ScorerSpec:
    queries: str  # "none" | "all" | "last" | "window"
    update: str  # "accumulate" | "replace"
    reset_after_evict: bool
    default_window: str  # "zero" | "quarter" (budget // 4) | "obs" (the observation window)
    default_pool: str = "none"


SCORERS: dict[str, ScorerSpec] = {
    "streamingllm": ScorerSpec("none", "accumulate", False, "zero"),
    "h2o": ScorerSpec("all", "accumulate", False, "quarter"),
    "tova": ScorerSpec("last", "replace", True, "zero"),
    "snapkv": ScorerSpec("window", "accumulate", True, "obs", default_pool="max"),
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Everything static about eviction: which scorer, the budget and the protected slots.

    budget: slots kept per (layer, row, KV head); n_sink: first tokens never evicted; window: most recent
    tokens never evicted; obs_window: scoring queries of "window" scorers; pool/kernel: 1-D pooling of the
    priorities along positions; aggregate: how the G query heads of a KV head combine.
    """

    scorer: str
    budget: int
    n_sink: int
    window: int
    obs_window: int
    pool: str
    kernel: int
    aggregate: str

    @property
    def spec(self) -> ScorerSpec:
        return SCORERS[self.scorer]


def make_policy(scorer: str, budget: int, *, n_sink: int = 4, window: int | None = None, obs_window: int = 32,
                pool: str | None = None, kernel: int = 7, aggregate: str = "mean") -> Policy:
    """Validated ``Policy`` with the papers' defaults for what is left as None."""
    if scorer not in SCORERS:
        raise ValueError(f"scorer={scorer!r} is unknown; valid scorers: {', '.join(sorted(SCORERS))}")
    spec = SCORERS[scorer]
    for name, value in (("budget", budget), ("obs_window", obs_window), ("kernel", kernel)):
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
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate={aggregate!r} must be one of {AGGREGATES}")
    return Policy(scorer, budget, n_sink, window, obs_window, pool, kernel, aggregate)


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


def _pool(x: jax.Array, present: jax.Array, kind: str, kernel: int) -> jax.Array:
    """1-D pooling over the last axis among ``present`` entries of x [..., S], in slot (= position) order.

    Absent entries are left out of the neighbourhoods: they are skipped over, so a token's neighbours are
    the nearest present tokens on either side (``max``: missing neighbours ignored; ``avg``: counted as 0).
    """
    S = x.shape[-1]
    # Rank present entries consecutively, pool over ranks, then read back per slot.
    rank = jnp.cumsum(present, axis=-1) - 1
    order = jnp.argsort(~present, axis=-1, stable=True)  # present slots first, in slot order
    packed = jnp.take_along_axis(jnp.where(present, x, 0.0), order, axis=-1)
    n_present = present.sum(-1, keepdims=True)
    fill = -jnp.inf if kind == "max" else 0.0
    packed = jnp.where(jnp.arange(S) < n_present, packed, fill)
    half = kernel // 2
    padded = jnp.pad(packed, [(0, 0)] * (x.ndim - 1) + [(half, kernel - 1 - half)], constant_values=fill)
    windows = jnp.stack([padded[..., i: i + S] for i in range(kernel)], axis=-1)
    pooled = windows.max(-1) if kind == "max" else windows.sum(-1) / kernel
    return jnp.where(present, jnp.take_along_axis(pooled, jnp.maximum(rank, 0), axis=-1), x)


def priority(policy: Policy, state: jax.Array, pos: jax.Array, unprotected: jax.Array) -> jax.Array:
    """[B, Hk, S] float32 priority (higher = kept) of the unprotected valid slots.

    state: [B, Hk, G, S]; pos: [B, Hk, S] (-1 = empty); unprotected: [B, Hk, S] valid and evictable.
    """
    if policy.scorer == "streamingllm":
        return pos.astype(jnp.float32)
    agg = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max}[policy.aggregate](state, axis=2)
    if policy.pool != "none":
        agg = _pool(agg, unprotected, policy.pool, policy.kernel)
    return agg
