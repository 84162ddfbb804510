"""Index helpers over the slot axis of [B, Hk, S] arrays (one row per batch row and KV head)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_head_index(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Broadcast (row, head) indices for indexing the last axis of [B, Hk, S] arrays with x [B, Hk, ...]."""
    B, Hk = x.shape[:2]
    return jnp.arange(B)[:, None, None], jnp.arange(Hk)[None, :, None]

