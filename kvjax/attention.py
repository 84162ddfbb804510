"""Masked grouped-query attention over cache slots (the XLA reference every cache uses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention of queries over slots, with G = H / Hk query heads per KV head.

    q: [B, T, H, K]; k, v: [B, Hk, S, K]; mask: [B, Hk or 1, T, S] bool (True = visible).
    Returns [B, T, H, K] in q's dtype; logits and softmax in float32.
    """
    B, T, H, K = q.shape
    Hk = k.shape[1]
    qg = q.reshape(B, T, Hk, H // Hk, K)
    logits = jnp.einsum("bthgk,bhsk->bhgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(K).astype(
        jnp.float32)
    logits = jnp.where(mask[:, :, None], logits, NEG_INF)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgts,bhsk->bthgk", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, K).astype(q.dtype)
