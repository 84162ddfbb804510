"""The attention path both budget caches share: a step's attention with per-slot scores (the
cache's kernels over its storage), MomentKV's correction, and the scorer's state and statistics
update.

Each cache passes its kernels as two functions over its own storage, so that kernel dispatch, the
correction and the scorer's bookkeeping exist once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from kvjax.kernels import corrected_attention

# The leading logical axes of the attention kernels' arguments (q, k, v, slot_pos, query_pos,
# query_weights) and outputs (out, lse, col), for running them per shard.
KV = ("batch", "kv_heads")
ATTENTION_AXES = (("batch", None, "heads"), KV, KV, KV, ("batch",), ("batch",))
ATTENTION_OUT_AXES = (("batch", None, "heads"), ("batch", None, "heads"), KV)

Kernel = Callable[..., tuple[jax.Array, jax.Array, jax.Array | None]]


def scored_attention(
    policy, seg, q: jax.Array, block: Kernel, decode: Kernel, moments
) -> tuple[jax.Array, jax.Array | None]:
    """The output [B, T, H, K] of queries q [B, T, H, K] and the scoring queries' per-slot column
    [B, Hk, G, S] (None if none score), MomentKV's correction included.

    Args:
        policy: the ``kvjax.eviction.Policy``.
        seg: the ``kvjax.cache.Segment``.
        block(weights) -> (out, lse, col): the cache's block kernel over its slots.
        decode(weights, moments) -> (out, lse, col): its decode kernel (moments None:
            uncorrected).
        moments: this layer's ``Moments``.
    """
    if q.shape[1] == 1:
        out, _, col = decode(seg.query_weights, moments if policy.moment_correction else None)
        return out, col
    out, lse, col = block(seg.query_weights)
    if policy.moment_correction:
        out = corrected_attention(out, lse, q, moments, policy.zeroth_order)
    return out, col


def fold_scores(policy, seg, q: jax.Array, state: jax.Array, stats, col: jax.Array | None):
    """One layer's scorer state [B, Hk, G, S] and statistics after the step (``Base.update_state``,
    ``Base.observe``)."""
    if col is not None:  # new slots start from zero: empty slots hold a zero state
        state = policy.scorer.update_state(state, col, seg.query_weights.sum(-1) > 0)
    return state, policy.scorer.observe(stats, q, seg.positions, seg.valid, policy)


def kept_attention(policy, decode: Kernel, moments) -> jax.Array:
    """Decoding under ``decode_order="evict-first"``: the output over the tokens a layer kept, from
    the cache's decode kernel after its eviction (no scores)."""
    return decode(None, moments if policy.moment_correction else None)[0]
