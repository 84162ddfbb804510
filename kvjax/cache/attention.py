"""The attention path both budget caches share: a step's attention with per-slot scores (the
cache's kernels over its storage), the modifier's correction of it, and the scorer's state and
statistics update.

Each cache passes its kernels as two functions over its own storage, so that kernel dispatch, the
correction and the scorer's bookkeeping exist once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

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
    [B, Hk, G, S] (None if none score), the modifier's correction included.

    Args:
        policy: the ``kvjax.eviction.Policy``.
        seg: the ``kvjax.cache.Segment``.
        block(weights) -> (out, lse, col): the cache's block kernel over its slots.
        decode(weights, *correction) -> (out, lse, col): its decode kernel, corrected by the
            modifier's arguments (``Modifier.correction``).
        moments: this layer's ``Moments``.
    """
    modifier = policy.modifier_spec
    if q.shape[1] == 1:
        out, _, col = decode(seg.query_weights, *modifier.correction(moments))
        return out, col
    out, lse, col = block(seg.query_weights)
    return modifier.correct(out, lse, q, moments), col


def fold_scores(policy, seg, q: jax.Array, state: jax.Array, stats, col: jax.Array | None):
    """One layer's scorer state [B, Hk, G, S] and statistics after the step (``Base.update_state``,
    ``Base.observe``)."""
    if col is not None:  # new slots start from zero: empty slots hold a zero state
        state = policy.scorer.update_state(state, col, seg.query_weights.sum(-1) > 0)
    return state, policy.scorer.observe(stats, q, seg.positions, seg.valid, policy)


def kept_attention(policy, decode: Kernel, moments) -> jax.Array:
    """Decoding under ``decode_order="evict-first"``: the output over the tokens a layer kept, from
    the cache's decode kernel after its eviction (no scores)."""
    return decode(None, *policy.modifier_spec.correction(moments))[0]
