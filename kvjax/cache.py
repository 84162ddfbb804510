"""KV caches. A cache is a pytree whose leaves all carry a leading layer axis; the model's layer scan carries
it and calls ``cache.attend(layer, q, k, v, segment)``, the one place where caching and eviction plug into
the model. Updating the stacked cache in place (instead of scanning over per-layer slices, which copies the
whole cache every step) keeps decoding memory traffic at one read of the cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.config import ModelConfig
from kvjax.kernels import attention_with_scores

if TYPE_CHECKING:
    from kvjax.eviction import Policy

PREFILL_CHUNK = 256  # query chunk of the full-cache causal prefill


@struct.dataclass
class Segment:
    """The new tokens of one forward call, shared by all layers.

    positions: [B, T] int32 absolute positions (rows are right-padded; padded queries' outputs are unused);
    valid: [B, T] bool, False for padding; query_weights: [B, T] float32 scoring queries, or None;
    seen: [B] int32 one past the newest valid position after this call; evict: whether this call ends with
    an eviction (a Python bool when known statically, else a traced bool scalar); from_start (static):
    positions are ``0 … T-1`` in every row (a prefill into an empty cache), which lets the full cache skip
    the masked upper triangle; policy (static): how a budget cache scores and evicts (None for the full
    cache), taken from the engine's ``Eviction``; evict_in_layer (static): at an eviction point each layer
    evicts right after its attention has scored, and outputs the attention over the tokens it keeps
    (decoding under ``decode_order="evict-first"``), instead of the step evicting after every layer.
    """

    positions: jax.Array
    from_start: bool = struct.field(pytree_node=False, default=False)
    valid: jax.Array | None = None
    query_weights: jax.Array | None = None
    seen: jax.Array | None = None
    evict: jax.Array | None = None
    policy: Policy | None = struct.field(pytree_node=False, default=None)
    evict_in_layer: bool = struct.field(pytree_node=False, default=False)


def when(flag, fn, x):
    """``fn(x)`` if ``flag`` else ``x``; flag: a Python bool (or None: False), or a traced bool scalar (then under
    ``lax.cond``)."""
    if flag is None or isinstance(flag, bool):
        return fn(x) if flag else x
    return jax.lax.cond(flag, fn, lambda y: y, x)


@struct.dataclass
class FullCache:
    """Uncompressed cache: slot s holds the token at position s.

    k, v: [L, B, Hk, S, K] with S the static capacity (prompt bucket + new tokens).
    """

    k: jax.Array
    v: jax.Array

    AXES = dict(k=("layers", "batch", "kv_heads", "slots", "head_dim"),
                v=("layers", "batch", "kv_heads", "slots", "head_dim"))

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, capacity: int, dtype) -> FullCache:
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[-2]

    @property
    def kv(self) -> tuple[jax.Array, jax.Array]:
        return self.k, self.v

    def write(self, layer: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> FullCache:
        """Layer ``layer`` with k, v [B, T, Hk, K] written at their ``positions`` [B, T] (in place)."""
        B, _, Hk, _ = k.shape
        index = (layer, jnp.arange(B)[:, None, None], jnp.arange(Hk)[None, :, None], positions[:, None, :])
        return FullCache(k=self.k.at[index].set(k.swapaxes(1, 2).astype(self.k.dtype)),
                         v=self.v.at[index].set(v.swapaxes(1, 2).astype(self.v.dtype)))

    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               seg: Segment) -> tuple[jax.Array, FullCache]:
        """Layer ``layer``: write k, v [B, T, Hk, K] at their positions (in place), attend q [B, T, H, K]."""
        T = k.shape[1]
        cache = self.write(layer, k, v, seg.positions)
        k_layer, v_layer = cache.k[layer], cache.v[layer]
        if seg.from_start and T > PREFILL_CHUNK and T % PREFILL_CHUNK == 0:
            # Causal prefill: query chunk c only needs the keys of chunks 0..c.
            outs = []
            for end in range(PREFILL_CHUNK, T + 1, PREFILL_CHUNK):
                causal = jnp.arange(end)[None, :] <= jnp.arange(end - PREFILL_CHUNK, end)[:, None]
                outs.append(attention_with_scores(q[:, end - PREFILL_CHUNK: end], k_layer[:, :, :end],
                                                  v_layer[:, :, :end], causal[None, None])[0])
            return jnp.concatenate(outs, axis=1), cache
        slots = jnp.arange(self.capacity)
        mask = (slots[None, None, :] <= seg.positions[:, :, None])[:, None]  # [B, 1, T, S]
        return attention_with_scores(q, k_layer, v_layer, mask)[0], cache


def cache_bytes(cache, kv_only: bool = False) -> int:
    """Bytes a cache pytree allocates (abstract shapes from ``jax.eval_shape`` too): every array leaf, or with
    ``kv_only`` its keys and values alone (``cache.kv``)."""
    return sum(x.size * x.dtype.itemsize for x in (cache.kv if kv_only else jax.tree.leaves(cache)))
