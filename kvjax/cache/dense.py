"""The fixed-budget KV cache: static slot count, original positions, scorer state, moments of the
evicted.

All leaves carry a leading layer axis L. The model's layer loop carries the keys and values, which
``attend(layer, ...)`` updates in place, and hands it the layer's slice of the rest
(``LAYER_FIELDS``; ``kvjax.model.layer_fields``). Keys and values never move once written: a
new token takes a free slot, an evicted token frees its slot. ``order`` lists the slots of each
(layer, row, KV head) by position (valid slots first, in increasing position, then the empty ones),
which is what pooling and the earliest-position tie-break need; evicting edits ``order``, not the
keys and values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache.attention import ATTENTION_AXES, ATTENTION_OUT_AXES, KV, attend_scored
from kvjax.cache.slots_view import SlotsView, reset_state, write_token_state
from kvjax.eviction import Policy, eviction_keys
from kvjax.eviction.moments import Moments, over_layers
from kvjax.eviction.priority import keys_by_position
from kvjax.kernels import block_attention_with_scores, decode_attention_with_scores, lowest_place
from kvjax.kernels.quantized import Quantized, stored, values, zeros
from kvjax.model.config import ModelConfig
from kvjax.model.segment import Segment
from kvjax.sharding import per_shard
from kvjax.slots import inverse_permutation, set_layer_slots, set_slots, true_first


@struct.dataclass
class BudgetCache(SlotsView):
    """The fixed-budget KV cache.

    Fields:
        k, v: [L, B, Hk, S, K] in the model's dtype, or ``Quantized`` (``kv_dtype``).
        pos: [L, B, Hk, S] int32 original positions (-1 = empty).
        state: [L, B, Hk, G, S] float32 per-slot scorer state, per query head, or G = 1: their
            aggregate (``Policy.state_groups``); zero in empty slots.
        order: [L, B, Hk, S] int32 the slots by position, valid ones first.
        moments: ``Moments``; a layer's view holds its own, or, in the layer scan's carried form,
            every layer's (``kvjax.model.layer_fields``).
        stats: the base scorer's own statistics (``Base.init_stats``), or None: stacked over
            layers in every view, each layer adding to its own in place (``Base.observe``).

    S (slots) = budget + spare, where spare holds the tokens of one step before eviction.
    """

    k: jax.Array | Quantized
    v: jax.Array | Quantized
    pos: jax.Array
    state: jax.Array
    order: jax.Array
    moments: Moments
    stats: object = None

    AXES = dict(
        k=("layers", "batch", "kv_heads", "slots", "head_dim"),
        v=("layers", "batch", "kv_heads", "slots", "head_dim"),
        pos=("layers", "batch", "kv_heads", "slots"),
        state=("layers", "batch", "kv_heads", "group", "slots"),
        order=("layers", "batch", "kv_heads", "slots"),
    )
    LAYER_FIELDS = ("pos", "state", "order", "moments")

    @classmethod
    def init(
        cls,
        cfg: ModelConfig,
        batch: int,
        slots: int,
        dtype,
        moment_dims: tuple[int, int],
        state_groups: int,
        kv_dtype: str | None = None,
    ) -> BudgetCache:
        """Empty; ``moment_dims``: its ``Moments``' (``Policy.moment_dims``); ``state_groups``: the
        state's query-head axis (``Policy.state_groups``); keys and values in ``dtype``, or
        quantized as ``kv_dtype`` says."""
        L, Hk, K = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        f32 = jnp.float32
        return cls(
            k=zeros((L, batch, Hk, slots, K), dtype, kv_dtype),
            v=zeros((L, batch, Hk, slots, K), dtype, kv_dtype),
            pos=jnp.full((L, batch, Hk, slots), -1, jnp.int32),
            state=jnp.zeros((L, batch, Hk, state_groups, slots), f32),
            order=jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (L, batch, Hk, slots)),
            moments=Moments.zeros((L, batch, Hk), moment_dims),
        )

    @property
    def kv(self) -> tuple[jax.Array, jax.Array]:
        return self.k, self.v

    def resize(self, slots: int) -> BudgetCache:
        """Same contents in ``slots`` slots laid out in position order (the valid tokens must fit).
        Works on stacked or sliced caches."""
        k, v = (
            jax.tree.map(lambda x: jnp.take_along_axis(x, self.order[..., None], -2), kv)
            for kv in (self.k, self.v)
        )
        pos, state = self.sorted_pos, jnp.take_along_axis(self.state, self.order[..., None, :], -1)
        grow = slots - self.slots
        if grow <= 0:

            def cut(x, axis):
                return jax.tree.map(lambda a: jax.lax.slice_in_dim(a, 0, slots, axis=axis), x)

            k, v, pos, state = cut(k, -2), cut(v, -2), cut(pos, -1), cut(state, -1)
        else:

            def pad(x, axis, value=0):
                def one(a):
                    widths = [(0, 0)] * (a.ndim + axis) + [(0, grow)] + [(0, 0)] * (-axis - 1)
                    return jnp.pad(a, widths, constant_values=value)

                return jax.tree.map(one, x)

            k, v, pos, state = pad(k, -2), pad(v, -2), pad(pos, -1, -1), pad(state, -1)
        order = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), pos.shape)
        return self.replace(k=k, v=v, pos=pos, state=state, order=order)

    def attend(
        self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, seg: Segment
    ) -> tuple[jax.Array, BudgetCache]:
        """Layer ``layer`` of a cache whose ``LAYER_FIELDS`` are that layer's ([B, Hk, ...]): put
        k, v [B, T, Hk, K] in the first free slots of ``order`` (written in place in the stacked
        keys and values, which never move), attend q [B, T, H, K] and update the scores, as
        ``seg.policy`` says. Eviction comes after the step, for every layer at once (``evict``), or
        with ``seg.evict_in_layer`` here (before the layer's output with ``seg.attend_kept``: the
        attention over the tokens it keeps). Returns the output and the cache with the layer's
        fields."""
        B, T, Hk, _ = k.shape
        count = (self.pos >= 0).sum(-1)  # [B, Hk]
        free = jnp.take_along_axis(self.order, count[..., None] + jnp.arange(T), -1)  # [B, Hk, T]
        k_all, k_here = _write(self.k, layer, free, k)
        v_all, v_here = _write(self.v, layer, free, v)
        new_pos = jnp.broadcast_to(jnp.where(seg.valid, seg.positions, -1)[:, None, :], (B, Hk, T))
        p = seg.policy
        here = self.replace(
            k=k_here,
            v=v_here,
            pos=set_slots(self.pos, free, new_pos),
            state=write_token_state(p.scorer, self.state, free, v, self.v, seg.valid),
        )

        def decode(h: BudgetCache):  # reads layer ``layer`` of the stacked k_all, v_all in place
            def kernel(weights, moments, *static, residuals=None):
                asked, *flags = residuals or (None,)  # the modifier's moments and static flags
                return per_shard(
                    lambda *a: decode_attention_with_scores(
                        *a[:6],
                        p.score_kind,
                        a[6],
                        *static,
                        layer=a[7],
                        residuals=None if residuals is None else (a[8], *flags),
                        impl=p.impl,
                    ),
                    (q, k_all, v_all, h.pos, seg.positions, weights, moments, layer, asked),
                    (ATTENTION_AXES[0], (None, *KV), (None, *KV), *ATTENTION_AXES[3:])
                    + (moment_axes(moments), (), moment_axes(asked)),
                    ATTENTION_OUT_AXES + ((KV,) if residuals else ()),
                    B,
                    Hk,
                )

            return kernel

        block = lambda weights: per_shard(  # noqa: E731
            lambda *a: block_attention_with_scores(*a, p.score_kind, impl=p.impl),
            (q, here.k, here.v, here.pos, seg.positions, weights),
            ATTENTION_AXES,
            ATTENTION_OUT_AXES,
            B,
            Hk,
        )
        # a decoding step's eviction of one slot can read the residual norms the kernel gives
        residuals = (
            p.modifier_spec.residuals(self.moments, self.slots - p.budget, p)
            if seg.evict_in_layer and T == 1
            else None
        )
        out, here = attend_scored(
            here,
            layer,
            q,
            seg,
            decode,
            block,
            lambda h, norms, moments: h._evict_layer(
                p,
                seg.seen,
                (k_all, v_all, layer, moments),
                reset=not seg.fresh_state,
                norms=norms,
            ),
            residuals,
        )
        return out, here.replace(k=k_all, v=v_all)

    def evict(self, p: Policy, seen: jax.Array, reset: bool = True) -> BudgetCache:
        """Keep ``p.budget`` slots per (layer, row, KV head), every layer at once (a few at a time
        when the modifier's choice is a long loop: ``over_layers``); seen: [B] one past the newest
        position; ``reset``: False leaves the state of a scorer that zeroes it at every eviction
        point as it is (``Segment.fresh_state``). Only the small per-slot arrays, the statistics
        and the moments change."""
        k, v = self.k, self.v
        steps = self.slots - p.budget if p.modifier_spec.sequential_choice else 0
        small = over_layers(
            lambda a: (
                a[0]
                .replace(k=a[1], v=a[2])
                ._evict_layer(p, seen, reset=reset)
                .replace(k=None, v=None)
            ),
            (self.replace(k=None, v=None), k, v),
            steps,
        )
        return small.replace(k=k, v=v)

    def _evict_layer(
        self,
        p: Policy,
        seen: jax.Array,
        stack: tuple | None = None,
        reset: bool = True,
        norms: jax.Array | None = None,
    ) -> BudgetCache:
        """One layer's slice ([B, Hk, ...] leaves); ``stack``: (stored keys, values, layer,
        that layer's moments) of every layer, of which this slice's keys and values are that
        layer's (read in place by the modifier's kernels), and the moments, as read (the slice's
        own may be every layer's: ``Moments.add`` adds to that layer's); ``reset`` as in
        ``evict``; ``norms``: the residual norms [B, Hk, S] the decode kernel gave for
        ``Modifier.residuals``, or None."""
        b = p.budget
        if self.slots <= b:  # everything fits: only the state reset remains
            resets = p.scorer.reset_after_evict and reset
            return self.replace(state=reset_state(self.state)) if resets else self
        n_drop = self.slots - b
        layer = None if stack is None else stack[2]
        if n_drop == 1 and p.pooled_aggregate:  # a decoding step's: in a kernel on CUDA
            return self._drop_few(p, self._lowest_place(p, seen)[..., None], reset, layer)
        # in position order: ties go to the earlier position
        if p.pooled_aggregate:
            key = keys_by_position(p, self.state, self.pos, self.order, seen)
        else:
            key = jnp.take_along_axis(self._keys(p, seen, n_drop, stack, norms), self.order, -1)
        if n_drop <= UNROLLED_DROPS:
            return self._drop_few(p, lowest_few(key, n_drop), reset, layer)
        drop = lowest_slots(key, n_drop)
        # Stable partition of the order: kept slots first (valid ones stay in position order),
        # dropped after.
        order = jnp.take_along_axis(self.order, true_first(~drop), -1)
        return self._release(p, order, order[..., b:], reset, layer)

    def _lowest_place(self, p: Policy, seen: jax.Array) -> jax.Array:
        """[B, Hk] the place in ``order`` of each head's lowest key (``keys_by_position``), the
        earliest of equal ones: ``kvjax.kernels.lowest_place``."""
        (place,) = per_shard(
            lambda *a: (lowest_place(*a, **p.key_options),),
            (self.state, self.pos, self.order, seen),
            (KV, KV, KV, ("batch",)),
            (KV,),
            *self.pos.shape[:2],
        )
        return place

    def _keys(
        self, p: Policy, seen: jax.Array, n_drop: int, stack: tuple | None, norms=None
    ) -> jax.Array:
        """``eviction_keys`` [B, Hk, S] by slot, the modifier's choice of ``n_drop`` at most
        (if it chooses) the lowest (from the decode kernel's residual ``norms`` if given)."""
        pos = self.pos
        k, v = values(self.k), values(self.v)  # what attention reads (unused ones: dropped)
        key, prio, unprotected = eviction_keys(
            p, self.state, pos, k, v, self.order, self.stats, seen
        )
        n_evict = jnp.maximum((pos >= 0).sum(-1) - p.budget, 0)
        moments, stored = (self.moments, None) if stack is None else (stack[3], stack[:3])
        chosen = p.modifier_spec.choose(
            prio, unprotected, n_evict, k, v, pos, moments, n_drop, p, stored, norms
        )
        if chosen is not None:  # the modifier chose: its evicted slots lowest, the rest above
            key = jnp.where(unprotected, jnp.where(chosen, 0.0, 1.0), key)
        return key

    def _drop_few(
        self, p: Policy, dropped: jax.Array, reset: bool = True, layer=None
    ) -> BudgetCache:
        """Drop the distinct places ``dropped`` [B, Hk, n] of ``order``: one shift per place,
        highest first, each moving the freed slot to the end of the order (no sort, no gather of
        keys or values); ``layer`` as in ``_release``."""
        order = self.order
        rank = jnp.arange(self.slots)
        slots = jnp.take_along_axis(order, dropped, -1)
        highest_first = jnp.sort(dropped, axis=-1)[..., ::-1]
        for i in range(dropped.shape[-1]):
            place = highest_first[..., i, None]  # [B, Hk, 1]
            freed = jnp.take_along_axis(order, place, -1)
            shifted = jnp.concatenate([order[..., 1:], freed], -1)
            order = jnp.where(rank >= place, shifted, order)
        return self._release(p, order, slots, reset, layer)

    def _release(
        self, p: Policy, order: jax.Array, dropped: jax.Array, reset: bool = True, layer=None
    ) -> BudgetCache:
        """Free the ``dropped`` [B, Hk, E] slots (empty ones among them are left as they are): their
        tokens join the moments (layer ``layer``'s, if they are every layer's), their position
        becomes -1 and their state 0 (every slot's, for a scorer that zeroes its state at every
        eviction point, unless not ``reset``); ``order`` is the new order."""

        def take(x):
            return values(jax.tree.map(lambda a: jnp.take_along_axis(a, dropped[..., None], -2), x))

        weight = (jnp.take_along_axis(self.pos, dropped, -1) >= 0).astype(jnp.float32)
        freed = set_slots(jnp.zeros(self.pos.shape, bool), dropped, True)
        state = jnp.where(freed[:, :, None, :], 0.0, self.state)
        if p.scorer.reset_after_evict:
            # zeroed after the keys' reads (a reset that XLA:GPU was free to run first made it copy
            # the state every step); left as it is unless ``reset``: the next step overwrites it
            state = reset_state(state) if reset else self.state
        return self.replace(
            pos=jnp.where(freed, -1, self.pos),
            state=state,
            order=order,
            moments=self.moments.add(weight, take(self.k), take(self.v), layer),
        )


def moment_axes(moments) -> tuple:
    """The leading logical axes of a decode kernel's moments: one layer's or every layer's."""
    return (None, *KV) if moments is not None and moments.every_layer else KV


def _write(store, layer: jax.Array, free: jax.Array, new: jax.Array):
    """(``store`` [L, B, Hk, S, K] with new [B, T, Hk, K] written in layer ``layer`` at slots free
    [B, Hk, T], that layer so updated): ``set_layer_slots`` of the stored form (cast, or quantized
    with one scale per token and KV head) on each of its arrays."""
    both = jax.tree.map(
        lambda s, n: set_layer_slots(s, layer, free, n), store, stored(new.swapaxes(1, 2), store)
    )
    return (
        jax.tree.map(lambda pair: pair[0], both, is_leaf=lambda x: isinstance(x, tuple)),
        jax.tree.map(lambda pair: pair[1], both, is_leaf=lambda x: isinstance(x, tuple)),
    )


UNROLLED_DROPS = 8  # up to this many evictions per step, repeated argmins and shifts beat a sort


def lowest_few(key: jax.Array, n: int) -> jax.Array:
    """[B, Hk, n] distinct indices of the ``n`` lowest entries of key [B, Hk, S] by repeated argmin
    (the first of equal keys first)."""
    found = []
    for _ in range(n):
        found.append(jnp.argmin(key, axis=-1))
        key = jnp.where(jnp.arange(key.shape[-1]) == found[-1][..., None], jnp.inf, key)
    return jnp.stack(found, axis=-1)


def lowest_slots(key: jax.Array, n: int) -> jax.Array:
    """[B, Hk, S] mask of the ``n`` lowest entries of key; among equal keys the first goes first."""
    index = jnp.broadcast_to(jnp.arange(key.shape[-1]), key.shape)
    _, order = jax.lax.sort((key, index), dimension=-1, num_keys=2)
    return inverse_permutation(order) < n
