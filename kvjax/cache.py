"""KV caches. A cache is a pytree whose leaves all carry a leading layer axis; the model scans over it and
calls ``attend`` on each layer's slice, the one place where caching and eviction plug into the model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.ops import attention_with_scores
from kvjax.config import ModelConfig


@struct.dataclass
class Segment:
    """The new tokens of one forward call, shared by all layers.

    positions: [B, T] int32 absolute positions (rows are right-padded; padded queries' outputs are unused);
    valid: [B, T] bool, False for padding; query_weights: [B, T] float32 scoring queries, or None;
    seen: [B] int32 one past the newest valid position after this call; evict: bool scalar, whether this
    call ends with an eviction. Only ``positions`` matters to the full cache.
    """

    positions: jax.Array
    valid: jax.Array | None = None
    query_weights: jax.Array | None = None
    seen: jax.Array | None = None
    evict: jax.Array | None = None


@struct.dataclass
class FullCache:
    """Uncompressed cache: slot s holds the token at position s.

    k, v: [L, B, Hk, S, K] with S the static capacity (prompt bucket + new tokens).
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, capacity: int, dtype) -> FullCache:
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[-2]

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, seg: Segment) -> tuple[jax.Array, FullCache]:
        """One layer: write k, v [B, T, Hk, K] at their positions, attend q [B, T, H, K] causally."""
        start = seg.positions[:, 0]
        write = jax.vmap(lambda buf, new, s: jax.lax.dynamic_update_slice_in_dim(buf, new, s, axis=1))
        k_all = write(self.k, k.swapaxes(1, 2).astype(self.k.dtype), start)
        v_all = write(self.v, v.swapaxes(1, 2).astype(self.v.dtype), start)
        slots = jnp.arange(self.capacity)
        mask = (slots[None, None, :] <= seg.positions[:, :, None])[:, None]  # [B, 1, T, S]
        return attention_with_scores(q, k_all, v_all, mask)[0], FullCache(k=k_all, v=v_all)
