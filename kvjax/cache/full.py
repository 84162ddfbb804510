"""The uncompressed cache (``FullCache``).

A cache is a pytree whose leaves all carry a leading layer axis; the model's layer scan carries it
and calls ``cache.attend(layer, q, k, v, segment)``, the one place where caching and eviction plug
into the model. Updating the stacked keys and values in place (instead of scanning over per-layer
slices, which copies them whole every step) keeps decoding memory traffic at one read of them; a
budget cache's small per-layer fields are scanned over instead (``kvjax.model.layer_fields``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache.attention import ATTENTION_AXES, ATTENTION_OUT_AXES, KV
from kvjax.kernels import attention_with_scores, causal_attention, decode_attention_with_scores
from kvjax.kernels.quantized import Quantized, stored, values, zeros
from kvjax.model.config import ModelConfig
from kvjax.model.segment import Segment
from kvjax.sharding import per_shard
from kvjax.slots import scatter_at_layer


@struct.dataclass
class FullCache:
    """Uncompressed cache: slot s holds the token at position s.

    Fields:
        k, v: [L, B, Hk, S, K] with S the static capacity (prompt bucket + new tokens), in the
            model's dtype or ``Quantized`` (``kv_dtype``).
        impl: the attention's implementation (static; ``EvictionOptions.impl``): None = the
            platform's (XLA on CPU; on TPU and CUDA the decode kernel, and on CUDA cuDNN's
            flash attention for the prompt), "xla", "pallas".
    """

    k: jax.Array | Quantized
    v: jax.Array | Quantized
    impl: str | None = struct.field(pytree_node=False, default=None)

    AXES = dict(
        k=("layers", "batch", "kv_heads", "slots", "head_dim"),
        v=("layers", "batch", "kv_heads", "slots", "head_dim"),
    )

    @classmethod
    def init(
        cls,
        cfg: ModelConfig,
        batch: int,
        capacity: int,
        dtype,
        impl: str | None = None,
        kv_dtype: str | None = None,
    ) -> FullCache:
        """Empty; keys and values in ``dtype``, or quantized as ``kv_dtype`` says."""
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        return cls(k=zeros(shape, dtype, kv_dtype), v=zeros(shape, dtype, kv_dtype), impl=impl)

    @property
    def capacity(self) -> int:
        return self.k.shape[-2]

    @property
    def kv_dtype(self) -> str | None:
        """How keys and values are stored (None: the model's dtype)."""
        return self.k.kind if isinstance(self.k, Quantized) else None

    @property
    def kv(self) -> tuple[jax.Array, jax.Array]:
        return self.k, self.v

    def write(
        self, layer: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> FullCache:
        """Layer ``layer`` with k, v [B, T, Hk, K] written at their ``positions`` [B, T] (in
        place)."""
        at = positions[:, None, :]

        def write(store, new):
            return jax.tree.map(
                lambda s, n: scatter_at_layer(s, layer, at, n),
                store,
                stored(new.swapaxes(1, 2), store),
            )

        return self.replace(k=write(self.k, k), v=write(self.v, v))

    def attend(
        self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, seg: Segment
    ) -> tuple[jax.Array, FullCache]:
        """Layer ``layer``: write k, v [B, T, Hk, K] at their positions (in place), attend q
        [B, T, H, K]. A decode step (T = 1) runs the decode attention of ``impl`` (the platform's
        kernel reads the layer of the stacked cache in place); a prompt from position 0 runs
        ``causal_attention`` of ``impl`` (cuDNN on CUDA), other blocks XLA over the cache."""
        B, T, Hk, _ = k.shape
        cache = self.write(layer, k, v, seg.positions)
        if T == 1:
            S = self.capacity
            slot_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, Hk, S))
            out, _, _ = per_shard(
                lambda *a: decode_attention_with_scores(*a[:-1], layer=a[-1], impl=self.impl),
                (q, cache.k, cache.v, slot_pos, seg.positions, layer),
                (ATTENTION_AXES[0], (None, *KV), (None, *KV), KV, ("batch",), ()),
                ATTENTION_OUT_AXES,
                B,
                Hk,
            )
            return out, cache
        if seg.from_start:  # a prompt into an empty cache: token t at slot t, causal
            k_new, v_new = (values(stored(x.swapaxes(1, 2), self.k), q.dtype) for x in (k, v))
            return causal_attention(q, k_new, v_new, impl=self.impl), cache  # as cached
        k_layer, v_layer = (values(x[layer], q.dtype) for x in (cache.k, cache.v))
        slots = jnp.arange(self.capacity)
        mask = (slots[None, None, :] <= seg.positions[:, :, None])[:, None]  # [B, 1, T, S]
        return attention_with_scores(q, k_layer, v_layer, mask)[0], cache


def cache_bytes(cache, kv_only: bool = False) -> int:
    """Bytes a cache pytree allocates (abstract shapes from ``jax.eval_shape`` too): every array
    leaf, or with ``kv_only`` its keys and values alone (``cache.kv``, with their scales)."""
    leaves = jax.tree.leaves(cache.kv if kv_only else cache)
    return sum(x.size * x.dtype.itemsize for x in leaves)
