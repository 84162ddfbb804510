"""Reference of block attention with eviction scores: ``kvjax.ops.attention_with_scores`` (the XLA
computation kvjax runs on CPU) with its dense mask built from positions — slot s is visible to query t
iff ``0 <= slot_pos[s] <= query_pos[t]``. The kernels are checked against this, and the default
``impl=None`` runs exactly this on CPU.
"""

from __future__ import annotations

import jax
from kvjax.kernels._shared import check_score, check_shapes

from kvjax.ops import attention_with_scores


def visibility(slot_pos: jax.Array, query_pos: jax.Array) -> jax.Array:
    """[B, Hk, T, S] bool: slot s (original position slot_pos [B, Hk, S], -1 = empty) is visible to query t
    (position query_pos [B, T])."""
    return (slot_pos >= 0)[:, :, None, :] & (slot_pos[:, :, None, :] <= query_pos[:, None, :, None])


def block_attention_with_scores(q, k, v, slot_pos, query_pos, query_weights=None, score: str = "attn"):
    """q [B, T, H, K]; k, v [B, Hk, S, K]; slot_pos [B, Hk, S] int32 (-1 = empty); query_pos [B, T] int32;
    query_weights [B, T] float32 or None. Returns (out [B, T, H, K] in q's dtype, lse [B, T, H] float32,
    col [B, Hk, G, S] float32 or None); the formulas are in ``kvjax.ops.attention_with_scores``.
    """
    check_score(score)
    check_shapes(q, k, v, slot_pos, query_pos, query_weights)
    return attention_with_scores(q, k, v, visibility(slot_pos, query_pos), query_weights, score)
