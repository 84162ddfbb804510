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
    by_pos: jax.Array, pos: jax.Array, order: jax.Array, total, floor: int, cap, picks: int
) -> jax.Array:
    """[..., H, S] the slots ``shared_targets`` leaves out, found in ``picks`` greedy steps instead
    of two sorts, for when at most ``picks`` slots go (the heads' count over ``total``).

    Args:
        by_pos: [..., H, S] each head's eviction keys listed by position (at the places of
            ``order``).
        pos: [..., H, S] the positions by slot.
        order: [..., H, S] each head's slots by position, valid ones first (``SlotsView.order``).
        total, cap: ints, or arrays broadcasting to [..., 1].

    Each step drops one slot: while a head holds more than ``cap``, the lowest of such heads' slots;
    else the lowest of the heads above their floor (sorted last by ``shared_targets``: lowest key,
    then earliest position, then highest head). A head's drops are its lowest slots by key, then
    position, so the steps run on each head's ``picks`` lowest, found in one pass over its slots
    (``jax.lax.top_k`` in position order, whose ties go to the lower index: the earlier position).
    """
    H, S = by_pos.shape[-2:]
    picks = min(picks, S)
    valid, count, floored = _floored(by_pos, floor)
    over = count.sum(-1, keepdims=True) > total  # [..., 1]: else every slot is kept
    # +0.0: -0.0 and 0.0, equal keys, rank alike; empty slots (after the valid ones) last
    place = jax.lax.top_k(-jnp.where(valid, by_pos + 0.0, jnp.inf), picks)[1]  # [..., H, picks]
    slot = jnp.take_along_axis(order, place, -1)
    low_key, low_valid = (jnp.take_along_axis(x, place, -1) for x in (by_pos, valid))
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
        k, p, ok = (jnp.take_along_axis(x, at, -1)[..., 0] for x in (low_key, low_pos, low_valid))
        cand = heads & ok & (taken < picks)
        cand &= k == lowest(k, cand, jnp.inf)
        cand &= p == lowest(p, cand, jnp.iinfo(jnp.int32).max)
        cand &= head == -lowest(-head, cand, 1)  # the highest head
        taken, n = taken + cand, n - cand
    gone = jnp.where(jnp.arange(picks) < taken[..., None], slot, -1)  # [..., H, picks]
    return (jnp.arange(S)[:, None] == gone[..., None, :]).any(-1)


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

    def few_dropped(self, by_pos, pos, order, budgets, floor, cap, head_budgets=None, group=None):
        """(fits, dropped) for a decoding step's eviction, found without a sort, or None where this
        allocation has none. fits: a bool scalar, True where every head holds at most one slot
        over its limit (heads sharing a budget: at most one each over their total); dropped: a
        function of no arguments returning the [L, B, Hk, S] slots that ``targets`` and the
        ranking leave out, valid only where fits. by_pos: the keys [L, B, Hk, S] listed by
        position, as ``order`` [L, B, Hk, S] lists the slots (valid ones first,
        ``SlotsView.order``); the other arguments as for ``targets``."""
        limit = self.limits(budgets, head_budgets, by_pos.shape[2])[..., None]  # [L, 1, Hk|1, 1]
        fits = jnp.all((by_pos > -jnp.inf).sum(-1) <= limit[..., 0] + 1)
        one_head = lambda x: x[..., None, :]  # noqa: E731  each head a budget of its own

        def dropped():  # shared_drops over one head: its lowest key, then earliest position
            heads = (one_head(x) for x in (by_pos, pos, order))
            return shared_drops(*heads, limit, 0, limit, 1)[..., 0, :]

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

    def few_dropped(self, by_pos, pos, order, budgets, floor, cap, head_budgets=None, group=None):
        Hk = by_pos.shape[2]
        group = Hk * budgets[0] if group is None else group
        fits = jnp.all((by_pos > -jnp.inf).sum((-2, -1)) <= group + Hk)
        return fits, lambda: shared_drops(by_pos, pos, order, group, floor, cap, Hk)


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

    def few_dropped(self, by_pos, pos, order, budgets, floor, cap, head_budgets=None, group=None):
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
