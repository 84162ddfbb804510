"""The fixed-budget KV cache: static slot count, original positions, scorer state, moments of the evicted.

All leaves carry the leading layer axis L; the model's layer scan calls ``attend(layer, ...)``, which works
on that layer's slice and writes it back. Invariant per (layer, row, KV head): valid slots form a prefix, sorted by position; empty slots
(position -1) follow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import Segment
from kvjax.config import ModelConfig
from kvjax.moments import corrected_attention, moment_informed_eviction
from kvjax.ops import attention_with_scores
from kvjax.scorers import Policy, priority, update_state


@struct.dataclass
class Moments:
    """Statistics of the evicted tokens per (layer, row, KV head), float32.

    count: [L, B, Hk]; k_sum, v_sum: [L, B, Hk, K]; vk_sum: [L, B, Hk, K, K] with [i, j] = Σ v_i k_j.
    """

    count: jax.Array
    k_sum: jax.Array
    v_sum: jax.Array
    vk_sum: jax.Array

    def add(self, weight: jax.Array, k: jax.Array, v: jax.Array) -> Moments:
        """Add tokens k, v [B, Hk, E, K] with 0/1 weight [B, Hk, E] (one layer's slice)."""
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        return Moments(count=self.count + weight.sum(-1),
                       k_sum=self.k_sum + jnp.einsum("bhe,bhek->bhk", weight, k),
                       v_sum=self.v_sum + jnp.einsum("bhe,bhek->bhk", weight, v),
                       vk_sum=self.vk_sum + jnp.einsum("bhe,bhei,bhej->bhij", weight, v, k))


@struct.dataclass
class BudgetCache:
    """k, v: [L, B, Hk, S, K]; pos: [L, B, Hk, S] int32 original positions (-1 = empty);
    state: [L, B, Hk, G, S] float32 per-slot, per-query-head scorer state; moments: ``Moments``.
    S (slots) = budget + spare, where spare holds the tokens of one step before eviction.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    state: jax.Array
    moments: Moments
    policy: Policy = struct.field(pytree_node=False)

    @classmethod
    def init(cls, cfg: ModelConfig, policy: Policy, batch: int, slots: int, dtype) -> BudgetCache:
        L, Hk, K = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        f32 = jnp.float32
        return cls(k=jnp.zeros((L, batch, Hk, slots, K), dtype), v=jnp.zeros((L, batch, Hk, slots, K), dtype),
                   pos=jnp.full((L, batch, Hk, slots), -1, jnp.int32),
                   state=jnp.zeros((L, batch, Hk, cfg.group_size, slots), f32),
                   moments=Moments(count=jnp.zeros((L, batch, Hk), f32), k_sum=jnp.zeros((L, batch, Hk, K), f32),
                                   v_sum=jnp.zeros((L, batch, Hk, K), f32),
                                   vk_sum=jnp.zeros((L, batch, Hk, K, K), f32)),
                   policy=policy)

    @property
    def slots(self) -> int:
        return self.pos.shape[-1]

    def resize(self, slots: int) -> BudgetCache:
        """Same contents in ``slots`` slots (the valid prefix must fit). Works on stacked or sliced caches."""
        grow = slots - self.slots
        if grow <= 0:
            cut = lambda x, axis: jax.lax.slice_in_dim(x, 0, slots, axis=axis)  # noqa: E731
            return self.replace(k=cut(self.k, -2), v=cut(self.v, -2), pos=cut(self.pos, -1),
                                state=cut(self.state, -1))
        pad = lambda x, axis, value=0: jnp.pad(  # noqa: E731
            x, [(0, 0)] * (x.ndim + axis) + [(0, grow)] + [(0, 0)] * (-axis - 1), constant_values=value)
        return self.replace(k=pad(self.k, -2), v=pad(self.v, -2), pos=pad(self.pos, -1, -1),
                            state=pad(self.state, -1))

    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               seg: Segment) -> tuple[jax.Array, BudgetCache]:
        """Layer ``layer`` of the stacked cache: see ``attend_slice``."""
        out, updated = jax.tree.map(lambda x: x[layer], self).attend_slice(q, k, v, seg)
        return out, jax.tree.map(lambda full, new: full.at[layer].set(new), self, updated)

    def attend_slice(self, q: jax.Array, k: jax.Array, v: jax.Array, seg: Segment) -> tuple[jax.Array, BudgetCache]:
        """One layer's slice: append k, v [B, T, Hk, K], attend q [B, T, H, K], update scores, evict if asked."""
        count = (self.pos >= 0).sum(-1)  # [B, Hk]
        new_pos = jnp.where(seg.valid, seg.positions, -1)[:, None, :]  # [B, 1, T]
        T = q.shape[1]

        def write(buf, new, axis):  # per (b, h): buf [..., S, ...], new [..., T, ...], written at count[b, h]
            put = lambda b, n, c: jax.lax.dynamic_update_slice_in_dim(b, n, c, axis=axis)  # noqa: E731
            return jax.vmap(jax.vmap(put))(buf, new.astype(buf.dtype), count)

        Hk = self.pos.shape[1]
        k_all = write(self.k, k.swapaxes(1, 2), 0)
        v_all = write(self.v, v.swapaxes(1, 2), 0)
        pos = write(self.pos, jnp.broadcast_to(new_pos, (new_pos.shape[0], Hk, T)), 0)
        state = write(self.state, jnp.zeros(self.state.shape[:3] + (T,), jnp.float32), 1)
        mask = (pos >= 0)[:, :, None, :] & (pos[:, :, None, :] <= seg.positions[:, None, :, None])
        p = self.policy
        out, lse, col = attention_with_scores(q, k_all, v_all, mask, seg.query_weights, p.score_kind)
        if p.moment_correction:
            out = corrected_attention(out, lse, q, self.moments, p.zeroth_order)
        if col is not None:
            state = update_state(self.policy, state, col, seg.query_weights.sum(-1) > 0)
        cache = self.replace(k=k_all, v=v_all, pos=pos, state=state)
        return out, jax.lax.cond(seg.evict, lambda c: c.evict(seg.seen), lambda c: c, cache)

    def evict(self, seen: jax.Array) -> BudgetCache:
        """One layer: keep ``budget`` slots per (row, KV head); seen: [B] one past the newest position."""
        p, b = self.policy, self.policy.budget
        if self.slots <= b:  # everything fits: only the state reset remains
            return self.replace(state=jnp.zeros_like(self.state)) if p.spec.reset_after_evict else self
        pos = self.pos
        valid = pos >= 0
        protected = valid & ((pos < p.n_sink) | (pos >= seen[:, None, None] - p.window))
        unprotected = valid & ~protected
        prio = priority(p, self.state, pos, unprotected, self.v)
        if p.moment_eviction:
            n_evict = jnp.maximum(valid.sum(-1) - b, 0)
            evicted = moment_informed_eviction(prio, unprotected, n_evict, self.k, self.v, self.moments,
                                               p.zeroth_order, self.slots - b)
            prio = jnp.where(evicted, 0.0, 1.0)
        key = jnp.where(unprotected, prio, jnp.where(protected, jnp.inf, -jnp.inf))
        drop = lowest_slots(key, pos, self.slots - b)
        # Stable partition: kept slots first (valid ones stay in position order, empty ones after them).
        dest = jnp.where(drop, b + jnp.cumsum(drop, -1) - 1, jnp.cumsum(~drop, -1) - 1)
        slot = jnp.broadcast_to(jnp.arange(self.slots), pos.shape)
        index = jnp.zeros_like(slot).at[_rows(dest) + (dest,)].set(slot)
        gather = lambda x: jnp.take_along_axis(x, index[..., None], axis=-2)  # noqa: E731
        new_pos = jnp.take_along_axis(pos, index, -1).at[..., b:].set(-1)
        if p.spec.reset_after_evict:
            new_state = jnp.zeros_like(self.state)
        else:
            new_state = jnp.take_along_axis(self.state, index[:, :, None, :], -1).at[..., b:].set(0.0)
        dropped_slots = index[..., b:]
        take = lambda x: jnp.take_along_axis(x, dropped_slots[..., None], axis=-2)  # noqa: E731
        dropped = (jnp.take_along_axis(pos, dropped_slots, -1) >= 0).astype(jnp.float32)
        return self.replace(k=gather(self.k), v=gather(self.v), pos=new_pos, state=new_state,
                            moments=self.moments.add(dropped, take(self.k), take(self.v)))


def _rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Broadcast (row, head) indices for scattering along the last axis of x [B, Hk, S]."""
    B, Hk, _ = x.shape
    return jnp.arange(B)[:, None, None], jnp.arange(Hk)[None, :, None]


UNROLLED_DROPS = 8  # up to this many evictions per step, repeated argmins beat a full sort


def lowest_slots(key: jax.Array, pos: jax.Array, n: int) -> jax.Array:
    """[B, Hk, S] mask of the ``n`` slots of lowest key; among equal keys the earlier position goes first.

    Valid slots are a position-sorted prefix and empty slots (key -inf) follow, so "earlier slot" means
    "earlier position" wherever it matters.
    """
    if n <= UNROLLED_DROPS:
        drop = jnp.zeros(key.shape, bool)
        for _ in range(n):
            j = jnp.argmin(jnp.where(drop, jnp.inf, key), axis=-1)  # first minimum: the earliest slot
            drop = drop | (jnp.arange(key.shape[-1]) == j[..., None])
        return drop
    slot = jnp.broadcast_to(jnp.arange(key.shape[-1]), key.shape)
    _, _, order = jax.lax.sort((key, pos, slot), dimension=-1, num_keys=2)  # lowest key, earliest position
    rank = jnp.zeros_like(slot).at[_rows(order) + (order,)].set(slot)
    return rank < n


def cache_bytes(cache) -> int:
    """Bytes allocated by a cache pytree (every array leaf; abstract shapes from ``jax.eval_shape`` too)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
