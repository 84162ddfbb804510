"""Budget allocation: how many slots each (layer, row, KV head) keeps at an eviction point.

Each allocation is one class (``Allocation`` and its subclasses, listed in ``ALLOCATIONS``). It
turns the eviction keys of every slot (``+inf`` protected, ``-inf`` empty, else the scorer's
priority) into a kept count per (layer, row, KV head), ``targets``; which slots a head then keeps is
the scorer's business (its highest keys, or MomentKV's moment-informed eviction down to the count).
Allocations whose per-head counts differ run on the paged cache (``kvjax.cache.paged``), whose
memory follows the total budget. Semantics: ``docs/eviction.md`` ("Allocations").
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels.eviction_place import Lowest
from kvjax.slots import inverse_permutation

PYRAMID_BETA = 20
# How a shared allocation's floor counts a head's protected tokens (sinks and window): "adakv"
# keeps floor × (budget − protected) of its best unprotected tokens on top of them (AdaKV's code);
# "kvpress" keeps floor × budget of its best tokens, the protected among them (kvpress's
# AdaKVPress).
FLOOR_MODES = ("adakv", "kvpress")


def allocation_table() -> str:
    """The README's Markdown table of the allocations."""
    rows = ["| allocation | kept per (layer, KV head) | cache |", "| --- | --- | --- |"]
    return "\n".join(
        rows
        + [
            f"| `{name}` | {spec.description} | {'paged' if spec.paged else 'dense'} |"
            for name, spec in ALLOCATIONS.items()
        ]
    )


def pyramid_budgets(budget: int, window: int, n_layers: int) -> tuple[int, ...]:
    """PyramidKV's per-layer budgets: with m = budget − window, layer l keeps window + the linear
    schedule from 2m − m/β (first layer) down to m/β (last layer), whose mean is m; rounded to whole
    tokens by largest remainders so that the layers keep exactly ``n_layers × budget`` in all.
    (KVCache-Factory rounds m/β and the step down instead, which keeps more: 3.1–3.9% at budgets
    64–256 with 30 layers and window 32.)"""
    m = budget - window
    low, high = m / PYRAMID_BETA, 2 * m - m / PYRAMID_BETA
    exact = (
        [high - layer * (high - low) / (n_layers - 1) for layer in range(n_layers)]
        if n_layers > 1
        else [m]
    )
    whole = [math.floor(x) for x in exact]
    by_remainder = sorted(range(n_layers), key=lambda layer: (whole[layer] - exact[layer], layer))
    for layer in by_remainder[: n_layers * m - sum(whole)]:
        whole[layer] += 1
    return tuple(w + window for w in whole)


def whole_head_count(budget: int, reduced: int, context: int, heads: int) -> int:
    """How many of ``heads`` (layer, KV head) pairs keep a whole context of ``context`` tokens
    under kvzip-head, the others keeping their ``reduced`` sinks and window: as many as the budget
    pays for, round(heads · (budget − reduced) / (context − reduced))."""
    share = np.clip((budget - reduced) / max(context - reduced, 1), 0.0, 1.0)
    return round(share * heads)


def floor_count(floor: float, budget: int, protected: int, mode: str) -> int:
    """Tokens every head keeps at least under a shared allocation, its ``protected`` ones (sinks and
    window) included, by ``FLOOR_MODES``: "adakv" protected + ⌊floor × (budget − protected)⌋;
    "kvpress" ⌊floor × budget⌋, at least 1 when floor > 0. (Rounded down, as both codes do.)"""
    if mode == "adakv":
        return protected + math.floor(floor * (budget - protected))
    return max(1, math.floor(floor * budget)) if floor > 0 else 0


def ranks(*keys: jax.Array) -> jax.Array:
    """Rank of every entry along the last axis when sorted ascending by ``keys`` (lexicographic;
    ties by index). keys: arrays of one shape [..., N]."""
    index = jnp.broadcast_to(jnp.arange(keys[0].shape[-1]), keys[0].shape)
    return inverse_permutation(jax.lax.sort((*keys, index), dimension=-1, num_keys=len(keys))[-1])


def _floored(key: jax.Array, floor: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Of heads sharing a budget, key [..., H, S]: the valid slots, each head's count [..., H] and
    the count it keeps at least (its protected slots, and ``floor``, as far as it has them)."""
    valid = key > -jnp.inf
    count = valid.sum(-1)
    return valid, count, jnp.minimum(jnp.maximum(floor, (key == jnp.inf).sum(-1)), count)


def shared_targets(key: jax.Array, pos: jax.Array, total: int, floor: int, cap: int) -> jax.Array:
    """Kept counts [..., H] of H heads sharing ``total`` slots; key, pos: [..., H, S].

    Every head keeps its protected slots (key +inf) and at least ``floor`` (its best ones); the rest
    of ``total`` goes to the best remaining slots over all H heads (key descending, then the later
    position, then the lower head); no head keeps more than ``cap`` or than its protected slots if
    those are more. With no more valid slots than ``total``, every one is kept.
    """
    H, S = key.shape[-2:]
    valid, count, floored = _floored(key, floor)
    rank = ranks(-key, -pos)  # within each head; protected slots first
    eligible = valid & (rank >= floored[..., None]) & (rank < cap)
    rest = jnp.maximum(total - floored.sum(-1), 0)
    flat = lambda x: x.reshape(x.shape[:-2] + (H * S,))  # noqa: E731
    head = jnp.broadcast_to(jnp.arange(H)[:, None], key.shape)
    overall = ranks(flat(jnp.where(eligible, -key, jnp.inf)), flat(-pos), flat(head))
    chosen = (overall < rest[..., None]).reshape(key.shape) & eligible
    kept = floored + chosen.sum(-1)
    return jnp.where(count.sum(-1, keepdims=True) <= total, count, kept)


def shared_drops(
    low: Lowest, pos: jax.Array, order: jax.Array, total, floor: int, cap
) -> tuple[jax.Array, jax.Array]:
    """The slots ``shared_targets`` leaves out of H heads, for when at most ``picks`` go (the heads'
    count over ``total``), found in ``picks`` greedy steps over each head's ``picks`` lowest keys
    instead of two sorts: (slots, their places in ``order``), each [..., H, picks], -1 past a
    head's drops.

    Args:
        low: ``Lowest`` [..., H, picks] of each head's keys listed by position (at the places of
            ``order``).
        pos: [..., H, S] the positions by slot.
        order: [..., H, S] each head's slots by position, valid ones first (``SlotsView.order``).
        total, cap: ints, or arrays broadcasting to [..., 1].

    Each step drops one slot: while a head holds more than ``cap``, the lowest of such heads' slots;
    else the lowest of the heads above their floor (sorted last by ``shared_targets``: lowest key,
    then earliest position, then highest head). A head's drops are its lowest slots by key, then
    position: the first of its lowest.
    """
    H, picks = low.place.shape[-2:]
    count = low.count
    floored = jnp.minimum(jnp.maximum(floor, low.protected), count)
    over = count.sum(-1, keepdims=True) > total  # [..., 1]: else every slot is kept
    slot = jnp.take_along_axis(order, low.place, -1)
    low_valid = low.key > -jnp.inf
    low_pos = jnp.take_along_axis(pos, slot, -1)
    head = jnp.arange(H)

    def lowest(x, among, fill):  # [..., 1] the least x over the heads ``among``
        return jnp.min(jnp.where(among, x, fill), -1, keepdims=True)

    taken, n = jnp.zeros(count.shape, jnp.int32), count
    for _ in range(picks):
        forced = n > cap  # [..., H]
        anyone = forced.any(-1, keepdims=True)
        go = over & (anyone | (n.sum(-1, keepdims=True) > total))
        heads = jnp.where(anyone, forced, n > floored) & go
        at = jnp.minimum(taken, picks - 1)[..., None]  # each head's lowest slot not yet dropped
        k, p, ok = (jnp.take_along_axis(x, at, -1)[..., 0] for x in (low.key, low_pos, low_valid))
        cand = heads & ok & (taken < picks)
        cand &= k == lowest(k, cand, jnp.inf)
        cand &= p == lowest(p, cand, jnp.iinfo(jnp.int32).max)
        cand &= head == -lowest(-head, cand, 1)  # the highest head
        taken, n = taken + cand, n - cand
    gone = jnp.arange(picks) < taken[..., None]  # [..., H, picks]
    return jnp.where(gone, slot, -1), jnp.where(gone, low.place, -1)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """Every head by itself keeps its layer's budget; the allocations below subclass it.

    Class attributes:
        name: its name in the scorer grammar (a prefix, or the ``allocation`` keyword).
        description: one line for the README's table.
        shared: None (every head by itself), "layer" (the KV heads of a layer share its budget) or
            "all" (every layer and KV head of a row share one threshold).
        paged: per-head counts differ, so the cache is paged.
        default_floor: the fraction of the budget every head keeps at least (shared allocations).
    """

    name: ClassVar[str]
    description: ClassVar[str]
    shared: ClassVar[str | None] = None
    paged: ClassVar[bool] = True
    default_floor: ClassVar[float] = 0.0

    def layer_budgets(self, budget: int, window: int, n_layers: int) -> tuple[int, ...]:
        """The budget of each layer's every KV head (its average under a shared allocation)."""
        return (budget,) * n_layers

    def head_capacity(
        self, budget: int, window: int, n_layers: int, n_kv_heads: int, floor: int = 0
    ) -> int:
        """The most tokens one (layer, row, KV head) may keep after an eviction point (``floor``:
        ``floor_count``)."""
        return max(self.layer_budgets(budget, window, n_layers))

    def sharing(self, n_layers: int, n_kv_heads: int) -> int:
        """How many heads share one budget (what one head may gain from the others)."""
        return 1

    def targets(
        self,
        key: jax.Array,
        pos: jax.Array,
        budgets,
        floor: int,
        cap: int,
        head_budgets: jax.Array | None = None,
        group: int | None = None,
    ) -> jax.Array:
        """[L, B, Hk] kept counts from the eviction keys and positions [L, B, Hk, S] of every slot.

        Args:
            budgets: the per-layer budgets (``layer_budgets``, or an int array of them).
            floor: ``floor_count``.
            cap: ``head_capacity``.
            head_budgets: [L, Hk] int32 each head's budget (``Heads`` only).
            group: the slots kept by the heads that share a budget (``Policy.group_budget``;
                shared allocations only; None: their count × the budget).
        """
        count = (key > -jnp.inf).sum(-1)
        return jnp.minimum(count, self.limits(budgets, head_budgets, key.shape[2]))

    def limits(self, budgets, head_budgets: jax.Array | None, n_kv_heads: int) -> jax.Array:
        """[L, 1, Hk or 1] int32 the most slots each head keeps (heads keeping budgets by
        themselves)."""
        return jnp.asarray(budgets, jnp.int32)[:, None, None]

    def few_picks(self, n_kv_heads: int) -> int | None:
        """How many of each head's lowest keys ``few_dropped`` reads (at most one slot over each
        head's limit: one), or None where this allocation has no sort-free decoding step."""
        return 1

    def few_dropped(
        self, low: Lowest, pos, order, budgets, floor, cap, head_budgets=None, group=None
    ):
        """(fits, dropped) for a decoding step's eviction, found without a sort. fits: a bool
        scalar, True where every head holds at most one slot over its limit (heads sharing a
        budget: at most one each over their total); dropped: a function of no arguments returning
        the slots that ``targets`` and the ranking leave out and their places in ``order``
        (``shared_drops``' lists [L, B, Hk, picks]), valid only where fits. low: ``Lowest`` [L, B,
        Hk, picks] of the keys listed by position as ``order`` [L, B, Hk, S] lists the slots (valid
        ones first, ``SlotsView.order``), picks = ``few_picks``; the other arguments as for
        ``targets``."""
        limit = self.limits(budgets, head_budgets, pos.shape[2])  # [L, 1, Hk|1]
        fits = jnp.all(low.count <= limit + 1)
        one_head = lambda x: x[..., None, :]  # noqa: E731  each head a budget of its own

        def dropped():  # shared_drops over one head: its lowest key, then earliest position
            low1 = Lowest(
                one_head(low.place),
                one_head(low.key),
                low.count[..., None],
                low.protected[..., None],
            )
            gone = shared_drops(
                low1, one_head(pos), one_head(order), limit[..., None], 0, limit[..., None]
            )
            return tuple(x[..., 0, :] for x in gone)

        return fits, dropped


@dataclasses.dataclass(frozen=True)
class Uniform(Allocation):
    name = "uniform"
    description = "every layer and KV head keeps `budget` tokens"
    paged = False


@dataclasses.dataclass(frozen=True)
class PyramidKV(Allocation):
    name = "pyramidkv"
    description = (
        "layer budgets decreasing linearly with depth, averaging `budget` (PyramidKV, β = 20); "
        "the KV heads of a layer keep the same number"
    )

    def layer_budgets(self, budget: int, window: int, n_layers: int) -> tuple[int, ...]:
        return pyramid_budgets(budget, window, n_layers)


@dataclasses.dataclass(frozen=True)
class AdaKV(Allocation):
    name = "adakv"
    description = (
        "each layer keeps `n_kv_heads × budget` tokens, shared among its KV heads by score "
        "(top-k over the layer's heads), every head at least its sinks and window plus `floor × "
        "(budget − sinks − window)` (AdaKV, α = 0.2; `floor_mode`)"
    )
    shared = "layer"
    default_floor = 0.2

    def head_capacity(self, budget, window, n_layers, n_kv_heads, floor=0):
        # the layer's n_kv_heads × budget less what the other heads keep at least: every head
        # holds at least ``floor`` tokens once it has seen them, and until then all heads hold all
        # they have seen (fewer than ``floor``), so ``shared_targets`` never keeps more than this
        return n_kv_heads * budget - (n_kv_heads - 1) * min(floor, budget)

    def sharing(self, n_layers, n_kv_heads):
        return n_kv_heads

    def targets(self, key, pos, budgets, floor, cap, head_budgets=None, group=None):
        group = key.shape[2] * budgets[0] if group is None else group
        return shared_targets(key, pos, group, floor, cap).astype(jnp.int32)

    def few_picks(self, n_kv_heads):
        return n_kv_heads  # the layer's new tokens may all leave one head

    def few_dropped(self, low, pos, order, budgets, floor, cap, head_budgets=None, group=None):
        Hk = pos.shape[2]
        group = Hk * budgets[0] if group is None else group
        fits = jnp.all(low.count.sum(-1) <= group + Hk)
        return fits, lambda: shared_drops(low, pos, order, group, floor, cap)


@dataclasses.dataclass(frozen=True)
class Global(AdaKV):
    name = "global"
    description = (
        "one threshold over every layer and KV head: `n_layers × n_kv_heads × budget` tokens in "
        "all; compressed once (KVzip) no limit on one head, as kvpress's `KVzipPress()`, else at "
        "most `n_kv_heads × budget` in one head"
    )
    shared = "all"
    default_floor = 0.0

    def head_capacity(self, budget, window, n_layers, n_kv_heads, floor=0):
        return n_kv_heads * budget  # its limit where it evicts again (else ``Policy.cap``)

    def sharing(self, n_layers, n_kv_heads):
        return n_layers * n_kv_heads

    def targets(self, key, pos, budgets, floor, cap, head_budgets=None, group=None):
        L, B, Hk, S = key.shape
        group = L * Hk * budgets[0] if group is None else group
        rows = lambda x: x.transpose(1, 0, 2, 3).reshape(B, L * Hk, S)  # noqa: E731
        kept = shared_targets(rows(key), rows(pos), group, floor, cap)
        return kept.reshape(B, L, Hk).transpose(1, 0, 2).astype(jnp.int32)

    def few_picks(self, n_kv_heads):
        return None  # one new slot per head is L × Hk greedy steps over a whole row: the sorts


@dataclasses.dataclass(frozen=True)
class Heads(Allocation):
    name = "heads"
    description = (
        "a fixed budget per layer and KV head (kvzip-head: the best heads by saved head scores "
        "keep the whole context, the others their sinks and window)"
    )

    def limits(self, budgets, head_budgets, n_kv_heads):
        return jnp.asarray(head_budgets, jnp.int32).reshape(-1, 1, n_kv_heads)


ALLOCATIONS: dict[str, Allocation] = {
    a.name: a for a in (Uniform(), PyramidKV(), AdaKV(), Global(), Heads())
}
