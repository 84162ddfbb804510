"""The paged budget cache: per-head budgets that differ, in memory that follows their total.

Each batch row has one pool of pages of P token slots, holding the keys and values of every layer
and KV head. A (layer, row, KV head) holds its n tokens in logical slots 0 … n−1, backed by the
first ⌈n / P⌉ pages of its page table. What is kept per slot — original position, scorer state, the
slot order by position — is per head in logical order with capacity C = M·P (M: the table's
length), as in ``BudgetCache``, so every scorer runs unchanged on it.

New tokens take the next logical slots; a head that needs a page takes one of the row's free pages.
An eviction point (every layer at once) asks the allocation (``kvjax.eviction.allocations``) how
many slots each head keeps, lets the scorer choose which, adds the evicted tokens to the moments,
moves each head's kept tokens above its new count into the holes below it (one row copy per such
token: the only time keys and values move) and returns the pages past the new count to the pool.
The pool holds the total budget plus the spare slots of one step, plus one page per (layer, KV
head) for partly filled pages (``pool_pages``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache.attention import ATTENTION_AXES, ATTENTION_OUT_AXES, KV, attend_scored
from kvjax.cache.slots_view import SlotsView, reset_state, write_token_state
from kvjax.eviction import Policy, eviction_keys
from kvjax.eviction.allocations import ranks
from kvjax.eviction.moments import Moments, over_layers
from kvjax.eviction.priority import keys_by_position
from kvjax.kernels.eviction_place import Lowest, lowest_places
from kvjax.kernels.eviction_place.reference import by_order, lowest_of
from kvjax.kernels.paged_attention import (
    paged_block_attention_with_scores,
    paged_decode_attention_with_scores,
)
from kvjax.kernels.paged_attention.reference import gather_pages
from kvjax.kernels.quantized import Quantized, stored, values, zeros
from kvjax.model.config import ModelConfig
from kvjax.model.layer_fields import put_layer
from kvjax.model.segment import Segment
from kvjax.sharding import per_shard
from kvjax.slots import FEW_FIRST, per_row, scatter_set, set_slots, true_first


def pool_pages(
    total_tokens: int, spare: int, n_layers: int, n_kv_heads: int, page_size: int
) -> int:
    """Pages a row's pool needs: every head's kept tokens (``total_tokens`` over all layers and
    heads) plus ``spare`` new tokens each, plus one partly filled page per (layer, KV head). (Heads
    holding n_h tokens use Σ ⌈n_h / P⌉ ≤ ⌊Σ n_h / P⌋ + heads pages.)"""
    heads = n_layers * n_kv_heads
    return (total_tokens + heads * spare) // page_size + heads


@struct.dataclass
class PagedCache(SlotsView):
    """The paged budget cache.

    Fields:
        k_pages, v_pages: [B, N, P, K] each row's page pool, in the model's dtype or
            ``Quantized`` (``kv_dtype``).
        table: [L, B, Hk, M] int32 the pages of each (layer, row, KV head) in logical order.
        n_pages: [L, B, Hk] int32 pages in use.
        free: [B, N] bool.
        pos: [L, B, Hk, C] int32 original positions by logical slot (C = M·P; valid slots are
            0 … n−1, -1 = empty).
        state: [L, B, Hk, G, C] float32 scorer state (G = 1: the query heads' aggregate,
            ``Policy.state_groups``).
        order: [L, B, Hk, C] int32 the slots by position, valid ones first, then the empty ones
            ascending.
        moments: ``Moments`` of the evicted tokens; a layer's view holds its own, or, in the
            layer scan's carried form, every layer's (``kvjax.model.layer_fields``).
        stats: the base scorer's own statistics (``Base.init_stats``), or None: stacked over
            layers in every view, each layer adding to its own in place (``Base.observe``).
        n_layers (static): L, which a layer's view (its ``LAYER_FIELDS`` without the layer axis)
            cannot read off its shapes.
        spare (static): the new tokens a head takes between eviction points (the geometry's
            ``spare``; the capacity C also holds the rounding up to whole pages), which bounds
            what one eviction point can drop.
    """

    k_pages: jax.Array | Quantized
    v_pages: jax.Array | Quantized
    table: jax.Array
    n_pages: jax.Array
    free: jax.Array
    pos: jax.Array
    state: jax.Array
    order: jax.Array
    moments: Moments
    stats: object = None
    n_layers: int = struct.field(pytree_node=False, default=0)
    spare: int = struct.field(pytree_node=False, default=0)

    # The pool is split by batch row only: its pages hold every KV head (see docs/sharding.md).
    AXES = dict(
        k_pages=("batch", "pages", "page", "head_dim"),
        v_pages=("batch", "pages", "page", "head_dim"),
        table=("layers", "batch", "kv_heads", "table"),
        n_pages=("layers", "batch", "kv_heads"),
        free=("batch", "pages"),
        pos=("layers", "batch", "kv_heads", "slots"),
        state=("layers", "batch", "kv_heads", "group", "slots"),
        order=("layers", "batch", "kv_heads", "slots"),
    )
    LAYER_FIELDS = ("table", "n_pages", "pos", "state", "order", "moments")

    def layer_fields(self, seg: Segment) -> tuple[str, ...]:
        """The ``LAYER_FIELDS`` a layer's ``attend`` reads or writes under ``seg``: new tokens
        take the next logical slots, whose places in the order are theirs already, so the order
        only where the layer evicts (``seg.evict_in_layer``); else it stays stacked, carried
        untouched (docs/performance.md, "The paged decoding step from each head's few lowest
        keys")."""
        if seg.evict_in_layer:
            return self.LAYER_FIELDS
        return tuple(n for n in self.LAYER_FIELDS if n != "order")

    @classmethod
    def init(
        cls,
        cfg: ModelConfig,
        batch: int,
        pages_per_head: int,
        page_size: int,
        n_pool: int,
        dtype,
        moment_dims: tuple[int, int],
        state_groups: int,
        spare: int,
        kv_dtype: str | None = None,
    ) -> PagedCache:
        """Empty, with room for a head's capacity plus ``spare`` new tokens between eviction points
        (``pages_per_head`` pages); ``moment_dims``: its ``Moments``' (``Policy.moment_dims``);
        ``state_groups``: the state's query-head axis (``Policy.state_groups``); keys and values
        in ``dtype``, or quantized as ``kv_dtype`` says."""
        L, Hk, K, M, P = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, pages_per_head, page_size
        C = M * P
        return cls(
            k_pages=zeros((batch, n_pool, P, K), dtype, kv_dtype),
            v_pages=zeros((batch, n_pool, P, K), dtype, kv_dtype),
            table=jnp.zeros((L, batch, Hk, M), jnp.int32),
            n_pages=jnp.zeros((L, batch, Hk), jnp.int32),
            free=jnp.ones((batch, n_pool), bool),
            pos=jnp.full((L, batch, Hk, C), -1, jnp.int32),
            state=jnp.zeros((L, batch, Hk, state_groups, C), jnp.float32),
            order=jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (L, batch, Hk, C)),
            moments=Moments.zeros((L, batch, Hk), moment_dims),
            n_layers=L,
            spare=spare,
        )

    @classmethod
    def from_dense(
        cls,
        k: jax.Array,
        v: jax.Array,
        pos: jax.Array,
        state: jax.Array,
        page_size: int,
        moment_dims: tuple[int, int],
    ) -> PagedCache:
        """The paged copy of a full cache. Head (l, h) gets the pages (l·Hk + h)·M … of its row's
        pool (M = ⌈S / P⌉); those past its tokens are free. Its ``spare`` is S: a head may lose
        every token.

        Args:
            k, v: [L, B, Hk, S, K] (arrays or ``Quantized``).
            pos: [L, B, Hk, S] with each head's valid tokens in slots 0 … n−1 in position order.
            state: [L, B, Hk, G, S].
            moment_dims: its (empty) ``Moments``' (``Policy.moment_dims``).
        """
        L, B, Hk, S, _ = k.shape
        P = page_size
        M = -(-S // P)
        C = M * P

        def pages(store):
            def one(x):
                x = jnp.pad(x, [(0, 0)] * 3 + [(0, C - S), (0, 0)]).reshape(L, B, Hk, M, P, -1)
                return x.transpose(1, 0, 2, 3, 4, 5).reshape(B, L * Hk * M, P, x.shape[-1])

            return jax.tree.map(one, store)

        pos = jnp.pad(pos, [(0, 0)] * 3 + [(0, C - S)], constant_values=-1)
        n_pages = -(-(pos >= 0).sum(-1) // P)
        first = (jnp.arange(L)[:, None] * Hk + jnp.arange(Hk)) * M  # [L, Hk]
        table = jnp.broadcast_to(
            (first[:, None, :, None] + jnp.arange(M)).astype(jnp.int32), (L, B, Hk, M)
        )
        used = jnp.arange(M) < n_pages[..., None]  # [L, B, Hk, M]
        free = ~used.transpose(1, 0, 2, 3).reshape(B, L * Hk * M)
        return cls(
            k_pages=pages(k),
            v_pages=pages(v),
            table=table,
            n_pages=n_pages.astype(jnp.int32),
            free=free,
            pos=pos,
            state=jnp.pad(state, [(0, 0)] * 4 + [(0, C - S)]),
            order=jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), pos.shape),
            moments=Moments.zeros((L, B, Hk), moment_dims),
            n_layers=L,
            spare=S,
        )

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def kv(self) -> tuple[jax.Array, jax.Array]:
        return self.k_pages, self.v_pages

    def _rows(self, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values [L, B, Hk, E, K] of logical slots [L, B, Hk, E] (their pages must be in
        use), as attention reads them (dequantized)."""
        P = self.page_size
        page = jnp.take_along_axis(self.table, slots // P, -1)

        def read(pool):
            return values(
                jax.tree.map(
                    lambda x: per_row(
                        lambda y, pg, off: y[pg, off], x, page, slots % P, axes=(0, 1, 1)
                    ).swapaxes(0, 1),
                    pool,
                )
            )

        return read(self.k_pages), read(self.v_pages)

    def _take_pages(self, tokens: int) -> PagedCache:
        """A layer's view: give every head the pages for ``tokens`` more slots, from its row's free
        pages."""
        P = self.page_size
        count = (self.pos >= 0).sum(-1)  # [B, Hk]
        extra = jnp.maximum(-(-(count + tokens) // P) - self.n_pages, 0)

        def take(cache: PagedCache) -> PagedCache:
            B, N = cache.free.shape
            # free pages first, ascending
            first_free = true_first(cache.free)
            start = jnp.cumsum(extra, -1) - extra  # [B, Hk]
            j = jnp.arange(-(-tokens // P) + 1)
            ok = j < extra[..., None]  # [B, Hk, E]
            page = jnp.take_along_axis(
                first_free[:, None, :], jnp.minimum(start[..., None] + j, N - 1), -1
            )
            table = set_slots(
                cache.table,
                jnp.where(ok, cache.n_pages[..., None] + j, cache.table.shape[-1]),
                page,
                mode="drop",
            )
            taken = jnp.where(ok, page, N).reshape(B, -1)
            free = per_row(
                lambda f, t: f.at[t].set(False, mode="drop"), cache.free, taken, axes=(0, 0)
            )
            return cache.replace(table=table, free=free, n_pages=cache.n_pages + extra)

        return jax.lax.cond(jnp.any(extra > 0), take, lambda c: c, self)

    def attend(
        self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, seg: Segment
    ) -> tuple[jax.Array, PagedCache]:
        """Layer ``layer`` of a cache whose ``LAYER_FIELDS`` are that layer's ([B, Hk, ...]): put
        k, v [B, T, Hk, K] in each head's next logical slots (taking pages as needed), attend q
        [B, T, H, K] and update the scores, as ``seg.policy`` says (``BudgetCache.attend`` on
        pages). Eviction comes after the step, for every layer at once (``evict``), or with
        ``seg.evict_in_layer`` here, before the layer's output: the attention over the tokens it
        keeps."""
        B, T, Hk, _ = k.shape
        P = self.page_size
        cache = self._take_pages(T)
        pos, table, n_pages = cache.pos, cache.table, cache.n_pages
        slot = (pos >= 0).sum(-1)[..., None] + jnp.arange(T)  # [B, Hk, T]: valid slots are 0 … n−1
        page = jnp.take_along_axis(table, slot // P, -1)

        def write(pool, new):  # each (KV head, token) its own (page, offset): unique updates
            return jax.tree.map(
                lambda x, val: per_row(
                    lambda y, pg, off, w: scatter_set(y, (pg, off), w, unique=True),
                    x,
                    page,
                    slot % P,
                    val,
                    axes=(0, 0, 0, 0),
                ),
                pool,
                stored(new.swapaxes(1, 2), pool),
            )

        k_pages, v_pages = write(cache.k_pages, k), write(cache.v_pages, v)
        new_pos = jnp.broadcast_to(jnp.where(seg.valid, seg.positions, -1)[:, None, :], (B, Hk, T))
        pos = set_slots(pos, slot, new_pos)
        p = seg.policy
        state = write_token_state(p.scorer, cache.state, slot, v, cache.v_pages, seg.valid)
        # pools: per row
        axes = (ATTENTION_AXES[0], ("batch",), ("batch",), KV, KV, *ATTENTION_AXES[3:])

        def decode(c: PagedCache):
            storage = (q, c.k_pages, c.v_pages, c.table, c.n_pages, c.pos, seg.positions)
            return lambda weights, moments, *static: per_shard(
                lambda *a: paged_decode_attention_with_scores(
                    *a[:-1], p.score_kind, a[-1], *static, impl=p.impl
                ),
                (*storage, weights, None if moments is None else moments.at(layer)),
                (*axes, KV),
                ATTENTION_OUT_AXES,
                B,
                Hk,
            )

        block = lambda weights: per_shard(  # noqa: E731
            lambda *a: paged_block_attention_with_scores(*a, p.score_kind, impl=p.impl),
            (q, k_pages, v_pages, table, n_pages, pos, seg.positions, weights),
            axes,
            ATTENTION_OUT_AXES,
            B,
            Hk,
        )
        cache = cache.replace(k_pages=k_pages, v_pages=v_pages, pos=pos, state=state)
        return attend_scored(
            cache,
            layer,
            q,
            seg,
            decode,
            block,
            # no residuals asked: MomentKV evicts after the step on the paged cache
            lambda c, _, moments: c._evict_layer(
                p, seg.seen, layer, moments, reset=not seg.fresh_state
            ),
        )

    def evict(
        self,
        p: Policy,
        seen: jax.Array,
        max_evict: int | None = None,
        head_budgets: jax.Array | None = None,
        reset: bool = True,
    ) -> PagedCache:
        """Every layer at once: the allocation's kept count per (layer, row, KV head), the scorer's
        choice of slots, the moments, compaction and page release.

        Args:
            seen: [B] one past the newest position.
            max_evict: the most slots one (layer, row, KV head) can lose (static). None: the bound
                when every layer held at most its total budget before the newest tokens (decoding,
                prompt blocks): the new tokens of a head (``spare``) times the heads that share a
                budget (``_most_dropped``); a cache filled otherwise (a full prefill being
                compressed) must give it.
            head_budgets: [L, Hk] int32 each head's budget under the "heads" allocation
                (kvzip-head).
            reset: False leaves the state of a scorer that zeroes it at every eviction point as
                it is (``Segment.fresh_state``).
        """
        L, B, Hk, C = self.pos.shape
        cap, sharing = p.head_capacity(L, Hk), p.allocation_spec.sharing(L, Hk)
        if max_evict is None:
            max_evict = self._most_dropped(sharing)
        budgets = p.layer_budgets(L)
        return self._evict(
            p, seen, max_evict, cap, budgets, p.group_budget(sharing), head_budgets, reset
        )

    def _evict_layer(
        self, p: Policy, seen: jax.Array, layer: jax.Array, moments, reset: bool = True
    ) -> PagedCache:
        """``evict`` on a layer's view (its statistics too), for layer ``layer`` (a traced index;
        not under a "global" allocation); ``moments``: the layer's (its own, or layer ``layer``'s
        of the view's every layer's, written back there)."""
        L, Hk = self.n_layers, self.pos.shape[1]
        cap, sharing = p.head_capacity(L, Hk), p.allocation_spec.sharing(L, Hk)
        max_evict = self._most_dropped(sharing)
        fields = {n: getattr(self, n) for n in self.LAYER_FIELDS} | dict(
            stats=self.stats, moments=moments
        )
        part = self.replace(**jax.tree.map(lambda x: x[None], fields))  # a stack of one layer
        budgets = jnp.asarray(p.layer_budgets(L), jnp.int32)[layer][None]
        part = part._evict(p, seen, max_evict, cap, budgets, p.group_budget(sharing), reset=reset)
        part = part.replace(**{n: jax.tree.map(lambda x: x[0], getattr(part, n)) for n in fields})
        if self.moments.every_layer:
            part = part.replace(moments=put_layer(self.moments, part.moments, layer))
        return part.replace(stats=self.stats)

    def _most_dropped(self, sharing: int) -> int:
        """The most slots one head can lose at an eviction point when every layer held at most its
        total budget before the newest tokens: the ``sharing`` heads of a budget took ``spare``
        each since, and one head may lose all of their excess. (Not C − cap: C rounds up to whole
        pages, 15 slots a head above a decoding step's one at 16-token pages.)"""
        return min(self.slots, self.spare * sharing)

    def _evict(
        self,
        p: Policy,
        seen: jax.Array,
        max_evict: int,
        cap: int,
        budgets,
        group: int,
        head_budgets: jax.Array | None = None,
        reset: bool = True,
    ) -> PagedCache:
        """``evict`` over this cache's layers (every layer, or one cut out with a leading axis of
        1), whose budgets are ``budgets``; ``group``: ``Policy.group_budget`` of the heads that
        share a budget; ``reset`` as in ``evict``."""
        kv = (None, None)
        if p.reads_kv:  # reads every slot's keys, values (as attention reads them)
            k_pages, v_pages = values(self.k_pages), values(self.v_pages)
            kv = jax.vmap(lambda t, n, s: gather_pages(k_pages, v_pages, t, n, s)[:2])(
                self.table, self.n_pages, self.pos
            )
        C = self.slots
        spec, floor = p.allocation_spec, p.floor_count()
        targets = (budgets, floor, cap, head_budgets, group)
        if p.pooled_aggregate:  # the keys by position (``keys_by_position``), in the branches
            key = prio = unprotected = None
        else:
            key, prio, unprotected = jax.vmap(
                lambda s, q, k, v, o, st: eviction_keys(p, s, q, k, v, o, st, seen)
            )(self.state, self.pos, *kv, self.order, self.stats)

        def by_position():  # keys and positions [L, B, Hk, C] listed by position: one gather
            if key is None:
                return jax.vmap(
                    lambda s, q, o: keys_by_position(p, s, q, o, seen, with_positions=True)
                )(self.state, self.pos, self.order)
            return by_order(self.order, key, self.pos)

        def ranked_by_position():  # kept counts [L, B, Hk]; kept and dropped places, by sorting
            by_pos, pos = by_position()  # ``targets`` and the ranks read no slot numbers
            kept = spec.targets(by_pos, pos, *targets)
            keep = (pos >= 0) & (ranks(-by_pos, -pos) < kept[..., None])
            return kept, keep, (pos >= 0) & ~keep

        def ranked():  # kept counts and kept slots [L, B, Hk, C]
            kept, keep, _ = ranked_by_position()
            return kept, set_slots(jnp.zeros_like(keep), self.order, keep, 3, unique=True)

        picks = spec.few_picks(self.pos.shape[2])
        if picks is not None:
            picks = min(picks, C)
            low = (
                self._lowest(p, seen, picks)
                if key is None
                else lowest_of(jnp.take_along_axis(key, self.order, -1), picks)
            )
            fits, dropped = spec.few_dropped(low, self.pos, self.order, *targets)
        # each head's slots before: 0 … count − 1 (a pooled key is -inf exactly at the empty ones)
        count = low.count if picks is not None and key is None else (self.pos >= 0).sum(-1)
        if picks is not None and max_evict <= FEW_FIRST and not p.modifier_spec.sequential_choice:
            # a decoding step's few drops, listed without a sort (sorted where they do not fit)
            gone, places = jax.lax.cond(
                fits,
                lambda: tuple(self._ascending(x, max_evict) for x in dropped()),
                lambda: self._ranked_lists(ranked_by_position()[2], max_evict),
            )
            return self._compact_few(p, gone, places, count, self._add_moments(gone), reset)
        valid = self.pos >= 0
        if picks is None:
            kept, keep = ranked()
        else:  # the few drops need no sort where they fit

            def unsorted():
                slot = dropped()[0]
                drop = set_slots(
                    jnp.zeros_like(valid), jnp.where(slot >= 0, slot, C), True, 3, mode="drop"
                )
                return (valid & ~drop).sum(-1).astype(jnp.int32), valid & ~drop

            kept, keep = jax.lax.cond(fits, unsorted, ranked)
        if p.modifier_spec.sequential_choice:  # the modifier chooses, a few layers at a time
            chosen = over_layers(
                lambda a: p.modifier_spec.choose(*a, max_evict, p),
                (prio, unprotected, count - kept, kv[0], kv[1], self.pos, self.moments),
                max_evict,
            )
            keep = valid & ~chosen
        if max_evict <= FEW_FIRST:
            gone, places = self._listed(valid & ~keep, max_evict)
            return self._compact_few(p, gone, places, count, self._add_moments(gone), reset)
        gone = self._first(valid & ~keep, max_evict)
        return self._compact(p, keep, gone, self._add_moments(gone), max_evict, reset)

    def _lowest(self, p: Policy, seen: jax.Array, picks: int) -> Lowest:
        """``Lowest`` [L, B, Hk, picks] of every layer's keys by position (``keys_by_position``):
        ``kvjax.kernels.lowest_places``, a kernel on CUDA, over the layers and rows as one batch."""

        def run(state, pos, order, seen):  # [L, B, Hk, ...] on each device: its rows and heads
            L, B = pos.shape[:2]
            flat = lambda x: x.reshape((L * B,) + x.shape[2:])  # noqa: E731
            args = (flat(state), flat(pos), flat(order), jnp.tile(seen, L))
            low = lowest_places(*args, picks=picks, **p.key_options)
            return tuple(x.reshape((L, B) + x.shape[1:]) for x in low)

        layers = (None, *KV)
        low = per_shard(
            run,
            (self.state, self.pos, self.order, seen),
            (layers, layers, layers, ("batch",)),
            (layers,) * 4,
            *self.pos.shape[1:3],
        )
        return Lowest(*low)

    def _ascending(self, x: jax.Array, width: int) -> jax.Array:
        """[L, B, Hk, width] the entries >= 0 of x [L, B, Hk, E <= width] ascending, then C: each
        put at its rank among the E (compared pairwise, no sort: E is a few)."""
        x = jnp.where(x >= 0, x, self.slots)
        x = jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])], constant_values=self.slots)
        i = jnp.arange(width)
        before = (x[..., None, :] < x[..., :, None]) | (
            (x[..., None, :] == x[..., :, None]) & (i < i[:, None])
        )
        return set_slots(jnp.zeros_like(x), before.sum(-1), x, lead=3, unique=True)

    def _first(self, mask: jax.Array, width: int) -> jax.Array:
        """[L, B, Hk, width] the True entries of mask [L, B, Hk, C] ascending, C past them (at
        most ``width`` of them)."""
        n = mask.sum(-1)[..., None]
        return jnp.where(jnp.arange(width) < n, true_first(mask, width), self.slots)

    def _ranked_lists(self, dropped: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
        """``_listed`` from the dropped places [L, B, Hk, C] of ``order`` (a sorted ranking's)."""
        places = self._first(dropped, width)
        slots = jnp.take_along_axis(self.order, jnp.minimum(places, self.slots - 1), -1)
        return self._ascending(jnp.where(places < self.slots, slots, -1), width), places

    def _listed(self, dropped: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
        """The ``dropped`` [L, B, Hk, C] slots ascending and their places in ``order`` ascending,
        [L, B, Hk, width] each, C past them (at most ``width`` <= ``FEW_FIRST`` dropped)."""
        in_order = jnp.take_along_axis(dropped, self.order, -1)
        return self._first(dropped, width), self._first(in_order, width)

    def _add_moments(self, gone: jax.Array) -> Moments:
        """The moments with the tokens of the ``gone`` [L, B, Hk, E] slots added (C: none)."""
        weight = (gone < self.slots).astype(jnp.float32)
        k_out, v_out = self._rows(jnp.minimum(gone, self.slots - 1))
        return jax.vmap(Moments.add)(self.moments, weight, k_out, v_out)

    def _state_after(self, p: Policy, reset: bool, moved) -> jax.Array:
        """The compacted state: reset (or, unreset, left for the next step to overwrite) where the
        scorer resets it after an eviction, else ``moved()``, its entries laid out as the slots."""
        if p.scorer.reset_after_evict:
            return reset_state(self.state) if reset else self.state
        return moved()

    def _laid_out(self, holes, tails, moving, n, **fields) -> PagedCache:
        """The compaction's end: the cache with ``fields`` (positions, state, order, moments)
        replaced, each ``moving`` [L, B, Hk, E] tail's keys and values copied into its hole's, and
        the pages past ⌈n / P⌉ of each head (n [L, B, Hk] its new count) returned to the pool."""
        L, B, Hk, C = self.pos.shape
        P, N, E = self.page_size, self.free.shape[1], holes.shape[-1]
        page_of = lambda s: jnp.take_along_axis(self.table, jnp.minimum(s, C - 1) // P, -1)  # noqa: E731
        # out of range, each its own page number (so every update is unique): dropped
        beyond = N + jnp.arange(L * Hk * E).reshape(L, 1, Hk, E)
        dst_page = jnp.where(moving, page_of(holes), beyond)

        def move(pool):  # per row: the tails' rows into the holes' rows
            def row(x, dst, dst_off, src, src_off):
                # not scatter_set: read here and scattered as bits, the pool was copied whole (the
                # H200 compile of AdaKV 1024 at batch 64: 27.9 GB per step)
                new = x[src, src_off]
                return x.at[dst, dst_off].set(new, mode="drop", unique_indices=True)

            return jax.tree.map(
                lambda x: per_row(
                    row, x, dst_page, holes % P, page_of(tails), tails % P, axes=(0, 1, 1, 1, 1)
                ),
                pool,
            )

        n_pages = -(-n // P)
        released = jnp.arange(self.table.shape[-1]) >= n_pages[..., None]
        released &= jnp.arange(self.table.shape[-1]) < self.n_pages[..., None]
        returned = jnp.where(released, self.table, N).swapaxes(0, 1).reshape(B, -1)
        free = per_row(
            lambda f, r: f.at[r].set(True, mode="drop"), self.free, returned, axes=(0, 0)
        )
        return self.replace(
            k_pages=move(self.k_pages),
            v_pages=move(self.v_pages),
            n_pages=n_pages.astype(jnp.int32),
            free=free,
            **fields,
        )

    def _compact_few(
        self,
        p: Policy,
        gone: jax.Array,
        places: jax.Array,
        count: jax.Array,
        moments: Moments,
        reset: bool = True,
    ) -> PagedCache:
        """``_compact`` from the lists of at most E <= ``FEW_FIRST`` dropped slots: ``gone`` and
        their ``places`` in ``order`` [L, B, Hk, E], each ascending, C past them; ``count`` [L, B,
        Hk] each head's slots before. Positions and state change at the moved and emptied slots
        alone (scatters of E), the order in one pass that shifts each place past the dropped ones
        by at most E (no [..., C] index array or permutation)."""
        L, B, Hk, C = self.pos.shape
        E = gone.shape[-1]
        k = (gone < C).sum(-1)
        n = count - k  # [L, B, Hk]
        window = n[..., None] + jnp.arange(E)  # [L, B, Hk, E]: the tails lie among these
        tail = (window < count[..., None]) & ~(window[..., None] == gone[..., None, :]).any(-1)
        tails, moving = _tails(window, tail)
        holes = gone  # ascending: the first ``tail.sum(-1)`` of them are below n
        # the tails' entries into the holes, every slot from n on emptied (E of them at most):
        # distinct slots, those out of range (C + i, also distinct) dropped
        at = jnp.concatenate(
            [
                jnp.where(moving, holes, C + jnp.arange(E)),
                jnp.where(window < count[..., None], window, C + E + jnp.arange(E)),
            ],
            -1,
        )

        def moved(x, empty, lead=3):  # x [L, B, Hk, (G,) C]
            src = jnp.minimum(tails, C - 1)
            if lead == 4:
                src, idx = src[:, :, :, None], at[:, :, :, None]
                src, idx = (jnp.broadcast_to(a, x.shape[:4] + a.shape[-1:]) for a in (src, idx))
            else:
                idx = at
            new = jnp.concatenate(
                [jnp.take_along_axis(x, src, -1), jnp.full(src.shape, empty, x.dtype)], -1
            )
            return set_slots(x, idx, new, lead=lead, mode="drop", unique=True)

        pos = moved(self.pos, -1)
        state = self._state_after(p, reset, lambda: moved(self.state, 0.0, lead=4))
        # place q < n takes the entry of place q + s, s the dropped places that q's entry passed
        # (places ascending: the i-th lies at or below q + i exactly where it is passed)
        q = jnp.arange(C)
        shift = sum(  # [L, B, Hk, C]; past the list (C) nothing is passed
            ((places[..., i : i + 1] - i <= q) & (places[..., i : i + 1] < C)).astype(jnp.int32)
            for i in range(E)
        )
        padded = jnp.pad(self.order, [(0, 0)] * 3 + [(0, E)])
        order = padded[..., :C]
        for s_ in range(1, E + 1):
            order = jnp.where(shift == s_, padded[..., s_ : s_ + C], order)
        for i in range(E):  # a moved tail's slot number is its hole's
            hit = (order == tails[..., i : i + 1]) & moving[..., i : i + 1]
            order = jnp.where(hit, holes[..., i : i + 1], order)
        order = jnp.where(q < n[..., None], order, q)  # the empty slots, ascending
        return self._laid_out(
            holes,
            tails,
            moving,
            n,
            pos=pos,
            state=state,
            order=order.astype(jnp.int32),
            moments=moments,
        )

    def _compact(
        self,
        p: Policy,
        keep: jax.Array,
        dropped: jax.Array,
        moments: Moments,
        max_moves: int,
        reset: bool = True,
    ) -> PagedCache:
        """Lay every head's ``keep`` [L, B, Hk, C] slots out in logical slots 0 … n−1 (the kept ones
        above n move into the holes below it) and free the pages past ⌈n / P⌉; ``dropped``
        [L, B, Hk, E]: the dropped slots ascending, C past them, at most E = ``max_moves``;
        ``reset`` as in ``evict``. (``_compact_few`` for a few dropped.)

        A head's tokens were in slots 0 … m−1 (``attend`` appends), so of the m − n ≤ E dropped,
        the holes are the first ones (those below n), and the tails, as many, lie in the E slots
        from n: neither list needs a pass over the C slots."""
        C = self.slots
        slot = jnp.arange(C)
        n = keep.sum(-1)  # [L, B, Hk]
        window = n[..., None] + jnp.arange(max_moves)  # [L, B, Hk, E]
        tail = jnp.take_along_axis(keep, jnp.minimum(window, C - 1), -1) & (window < C)
        holes = dropped  # ascending: the first ``tail.sum(-1)`` of them are below n
        tails, moving = _tails(window, tail)
        identity = jnp.broadcast_to(slot, keep.shape)
        source = set_slots(identity, jnp.where(moving, holes, C), tails, lead=3, mode="drop")
        new_slot = set_slots(identity, jnp.where(moving, tails, C), holes, lead=3, mode="drop")

        def from_tails(x):  # x [L, B, Hk, ..., C]: each moving hole takes its tail's entry
            at = source.reshape(source.shape[:3] + (1,) * (x.ndim - 4) + (C,))
            return jnp.take_along_axis(x, jnp.broadcast_to(at, x.shape), -1)

        live = slot < n[..., None]
        pos = jnp.where(live, from_tails(self.pos), -1)
        state = self._state_after(
            p, reset, lambda: jnp.where(live[..., None, :], from_tails(self.state), 0.0)
        )
        kept_in_order = jnp.take_along_axis(keep, self.order, -1)
        rank = jnp.where(kept_in_order, jnp.cumsum(kept_in_order, -1) - 1, C)
        order = set_slots(
            identity, rank, jnp.take_along_axis(new_slot, self.order, -1), lead=3, mode="drop"
        )
        return self._laid_out(
            holes,
            tails,
            moving,
            n,
            pos=pos.astype(jnp.int32),
            state=state,
            order=order.astype(jnp.int32),
            moments=moments,
        )

    def resize(self, pages_per_head: int, n_pool: int, spare: int) -> PagedCache:
        """The same contents in a new pool of ``n_pool`` pages and tables of ``pages_per_head``
        pages, each head's pages packed in (layer, KV head) order, for ``spare`` new tokens per
        head between eviction points. Every head's tokens must be in slots 0 … n−1 (as after an
        eviction point) and fit."""
        L, B, Hk, M = self.table.shape
        P = self.page_size
        M2, C2 = pages_per_head, pages_per_head * P
        start = (
            (
                jnp.cumsum(self.n_pages.transpose(1, 0, 2).reshape(B, L * Hk), -1)
                - self.n_pages.transpose(1, 0, 2).reshape(B, L * Hk)
            )
            .reshape(B, L, Hk)
            .transpose(1, 0, 2)
        )
        j = jnp.arange(M)
        # [L, B, Hk, M]
        new_page = jnp.where(j < self.n_pages[..., None], start[..., None] + j, n_pool)
        by_row = lambda x: x.swapaxes(0, 1).reshape(B, -1)  # noqa: E731
        source = per_row(
            lambda s, at, old: s.at[at].set(old, mode="drop"),
            jnp.zeros((B, n_pool), jnp.int32),
            by_row(new_page),
            by_row(self.table),
            axes=(0, 0, 0),
        )

        def gather(pages):
            return jax.tree.map(
                lambda x: jnp.take_along_axis(x, source[:, :, None, None], 1), pages
            )

        table = start[..., None] + jnp.arange(M2)
        total = self.n_pages.sum((0, 2))  # [B]
        fit = lambda x, fill: (  # noqa: E731
            jax.lax.slice_in_dim(x, 0, C2, axis=-1)
            if C2 <= x.shape[-1]
            else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, C2 - x.shape[-1])], constant_values=fill)
        )
        order = jnp.take_along_axis(self.pos, self.order, -1) >= 0  # valid first: keep their order
        order = jnp.where(
            order, self.order, jnp.broadcast_to(jnp.arange(self.slots), self.order.shape)
        )
        order = fit(order, 0)
        if C2 > self.slots:
            order = jnp.where(jnp.arange(C2) < self.slots, order, jnp.arange(C2))
        return self.replace(
            k_pages=gather(self.k_pages),
            v_pages=gather(self.v_pages),
            table=table.astype(jnp.int32),
            n_pages=self.n_pages,
            free=jnp.arange(n_pool) >= total[:, None],
            pos=fit(self.pos, -1),
            state=fit(self.state, 0.0),
            order=order.astype(jnp.int32),
            spare=spare,
        )


def _tails(window: jax.Array, tail: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kept slots a compaction moves, from the E slots ``window`` [L, B, Hk, E] past each
    head's new count and which of them hold a kept token (``tail``): those slots ascending, first
    (the rest arbitrary), and which entries are real ([L, B, Hk, E] each)."""
    return (
        jnp.take_along_axis(window, true_first(tail), -1),
        jnp.arange(tail.shape[-1]) < tail.sum(-1)[..., None],
    )
