"""The eviction keys of a cache's slots listed by position, as kvjax computes them in XLA; the
place of the lowest (the dense cache's decoding step: one eviction), and the few lowest places
with what a shared allocation's choice reads (the paged cache's decoding step).

A slot's key is its base scorer's priority: the per-slot state [B, Hk, G, S] aggregated over the G
query heads of its KV head (``aggregate``), pooled along positions among the unprotected slots
(``pool_by_position``); protected slots (the ``n_sink`` first and ``window`` most recent
positions) get +inf, empty ones (position -1) -inf. ``order`` [B, Hk, S] lists the slots by
position (valid ones first), so the first place of the lowest key is the slot to evict, ties going
to the earlier position.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

AGGREGATES = ("sum", "mean", "max", "layer")  # "layer": mean over all query heads of the layer
POOLS = ("none", "max", "avg")


def aggregate(how: str, per_head: jax.Array) -> jax.Array:
    """[B, Hk, G, S] -> [B, Hk, S] by ``how`` (``AGGREGATES``). "layer" averages every query head of
    the layer (TOVA's and kvpress's choice) and gives the mean to every KV head: their slots hold
    the same positions (equal priorities make equal choices from the first eviction on), so every KV
    head keeps the same tokens."""
    if how == "layer":
        B, Hk, _, S = per_head.shape
        return jnp.broadcast_to(jnp.mean(per_head, axis=(1, 2))[:, None], (B, Hk, S))
    return {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max}[how](per_head, axis=2)


def pool_by_position(xs: jax.Array, present: jax.Array, kind: str, kernel: int) -> jax.Array:
    """1-D pooling of xs [..., S] listed by position, among the ``present`` [..., S] ones.

    In that order the present (unprotected) slots are one contiguous run: valid slots come first,
    the sinks are a prefix and the recent window a suffix of them. So a token's neighbours are the
    present tokens within ``kernel // 2`` places on either side; absent ones are left out (``max``)
    or counted as 0 (``avg``, divided by ``kernel``). Absent entries are not meaningful.
    """
    S = xs.shape[-1]
    fill = -jnp.inf if kind == "max" else 0.0
    half = kernel // 2
    padded = jnp.pad(
        jnp.where(present, xs, fill),
        [(0, 0)] * (xs.ndim - 1) + [(half, kernel - 1 - half)],
        constant_values=fill,
    )
    shifted = [padded[..., i : i + S] for i in range(kernel)]
    return functools.reduce(jnp.maximum, shifted) if kind == "max" else sum(shifted) / kernel


def protection(
    pos: jax.Array, seen: jax.Array, n_sink: int, window: int
) -> tuple[jax.Array, jax.Array]:
    """(protected, unprotected) [B, Hk, S] of the valid slots at positions ``pos`` (``seen`` [B]
    one past the newest): the ``n_sink`` first and ``window`` most recent positions are
    protected."""
    valid = pos >= 0
    protected = valid & ((pos < n_sink) | (pos >= seen[:, None, None] - window))
    return protected, valid & ~protected


def by_order(order: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Each of xs [..., S] (32-bit or bool) listed by ``order`` [..., S], by one gather of them
    stacked.

    A gather per array would share one index, which XLA:GPU writes out whole (every entry's
    coordinates: 16 bytes an entry, 2.15 GB a step at the 8B's batch 64 under AdaKV); a single
    gather computes its index where it reads."""

    def bits(x):
        return x.astype(jnp.int32) if x.dtype == bool else jax.lax.bitcast_convert_type(x, "int32")

    def back(b, x):
        return b != 0 if x.dtype == bool else jax.lax.bitcast_convert_type(b, x.dtype)

    taken = jnp.take_along_axis(jnp.stack([bits(x) for x in xs], -1), order[..., None], -2)
    return tuple(back(taken[..., i], x) for i, x in enumerate(xs))


def keys_by_position(
    state,
    pos,
    order,
    seen,
    *,
    n_sink: int,
    window: int,
    how: str,
    pool: str,
    kernel: int,
    with_positions: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """[B, Hk, S] float32 the key of the slot at each place of ``order`` (and, ``with_positions``,
    the positions [B, Hk, S] listed so, from the same gather).

    Args:
        state: [B, Hk, G, S] float32 the per-slot state.
        pos: [B, Hk, S] int32 positions (-1: empty).
        order: [B, Hk, S] int32 the slots by position.
        seen: [B] int32 one past each row's newest position.
        how / pool / kernel: the aggregate over the query heads, the pooling and its width.
    """
    # written once: XLA would compute it again from the state (G times its bytes) in each consumer
    agg = jax.lax.optimization_barrier(aggregate(how, state))
    agg, pos = by_order(order, agg, pos)
    protected, unprotected = protection(pos, seen, n_sink, window)
    if pool != "none":
        agg = pool_by_position(agg, unprotected, pool, kernel)
    key = jnp.where(unprotected, agg, jnp.where(protected, jnp.inf, -jnp.inf))
    return (key, pos) if with_positions else key


def lowest_place(state, pos, order, seen, **options) -> jax.Array:
    """[B, Hk] int32 the first place of ``order`` holding the lowest key (``keys_by_position``,
    whose arguments these are)."""
    return jnp.argmin(keys_by_position(state, pos, order, seen, **options), -1).astype(jnp.int32)


class Lowest(NamedTuple):
    """A head's ``picks`` lowest keys listed by position, and its counts.

    Fields:
        place: [..., picks] int32 places of ``order``: the valid slots' (key > -inf) by key
            ascending, then by place (the earlier position), the empty ones after them.
        key: [..., picks] float32 their keys.
        count: [..., ] int32 the valid slots.
        protected: [..., ] int32 the protected ones (key +inf).
    """

    place: jax.Array
    key: jax.Array
    count: jax.Array
    protected: jax.Array


def lowest_of(key: jax.Array, picks: int) -> Lowest:
    """``Lowest`` of keys [..., S] listed by position, by one ``jax.lax.top_k`` (its ties go to the
    lower index); picks <= S."""
    valid = key > -jnp.inf
    # +0.0: -0.0 and 0.0, equal keys, rank alike; empty slots (after the valid ones) last
    place = jax.lax.top_k(-jnp.where(valid, key + 0.0, jnp.inf), picks)[1].astype(jnp.int32)
    return Lowest(
        place,
        jnp.take_along_axis(key, place, -1),
        valid.sum(-1, dtype=jnp.int32),
        (key == jnp.inf).sum(-1, dtype=jnp.int32),
    )


def lowest_places(state, pos, order, seen, *, picks: int, **options) -> Lowest:
    """``Lowest`` [B, Hk, ...] of the keys by position (``keys_by_position``, whose other arguments
    these are)."""
    return lowest_of(keys_by_position(state, pos, order, seen, **options), picks)
