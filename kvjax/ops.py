"""Attention with eviction scores: the single operation every scorer computes from.

This XLA version is the reference; a Pallas kernel with the same signature is the drop-in replacement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def attention_with_scores(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                          query_weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Grouped-query attention over cache slots plus the column sums of the attention weights.

    q: [B, T, H, K]; k, v: [B, Hk, S, K]; mask: [B, Hk or 1, T, S] bool (True = visible);
    query_weights: [B, T] float32 or None.
    Returns out [B, T, H, K] (q's dtype) and, unless query_weights is None,
    col [B, Hk, G, S] float32 with col[b, h, g, s] = Σ_t query_weights[b, t] · A[b, h, g, t, s].
    Softmax is float32; a fully masked query row gets finite garbage, never NaN.
    """
    B, T, H, K = q.shape
    Hk = k.shape[1]
    qg = q.reshape(B, T, Hk, H // Hk, K)
    # Matmuls in the activation dtype (as transformers does; XLA:CPU lacks bf16 x bf16 -> f32 dots).
    logits = jnp.einsum("bthgk,bhsk->bhgts", qg, k.astype(q.dtype)).astype(jnp.float32)
    logits = jnp.where(mask[:, :, None], logits / jnp.sqrt(jnp.float32(K)), NEG_INF)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgts,bhsk->bthgk", weights.astype(v.dtype), v).reshape(B, T, H, K).astype(q.dtype)
    if query_weights is None:
        return out, None
    return out, jnp.einsum("bhgts,bt->bhgs", weights, query_weights.astype(jnp.float32))
