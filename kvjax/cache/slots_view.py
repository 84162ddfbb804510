"""What both budget caches (``BudgetCache``, ``PagedCache``) read the same way off their slots,
and the writes and reset of their scorer state.

A mixin of properties only: it adds no fields, so each cache stays the same ``flax.struct`` pytree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kernels.quantized import stored, values
from kvjax.slots import set_slots


class SlotsView:
    """The slot count and the sorted positions of a cache with ``pos`` and ``order`` fields.

    Fields: none of its own; it reads the cache's:
        pos: [L, B, Hk, S] int32 original positions by slot (-1 = empty).
        order: [L, B, Hk, S] int32 the slots by position, valid ones first.
    """

    pos: jax.Array
    order: jax.Array

    @property
    def slots(self) -> int:
        return self.pos.shape[-1]

    @property
    def sorted_pos(self) -> jax.Array:
        """Positions in ``order``: each (layer, row, KV head)'s valid positions ascending,
        then -1s."""
        return jnp.take_along_axis(self.pos, self.order, -1)


def reset_state(state: jax.Array) -> jax.Array:
    """Zeros in place of a (finite) scorer state, computed from it: with a data dependency on the
    old state, XLA overwrites it in place; plain zeros made XLA copy the stacked state in the decode
    loop (floating-point x * 0 is not folded, because of NaN and inf; docs/performance.md)."""
    return state * 0.0


def write_token_state(scorer, state, slots, v, like, valid) -> jax.Array:
    """The state [B, Hk, G, S] with the new tokens' ``slots`` [B, Hk, T] set to the base scorer's
    ``token_state`` of their values v [B, T, Hk, K] as stored like ``like`` and read by the
    attention, alike for each query head, zero for tokens not ``valid`` [B, T]; unchanged for a
    scorer without one."""
    new = scorer.token_state(values(stored(v.swapaxes(1, 2), like)))
    if new is None:
        return state
    new = jnp.where(valid[:, None, :], new, 0.0)
    return jax.vmap(lambda s: set_slots(s, slots, new, unique=True), in_axes=2, out_axes=2)(state)


def filled_token_state(scorer, state, pos, v) -> jax.Array:
    """The state [..., G, S] of slots whose positions are ``pos`` [..., S] (-1 = empty) and values
    v [..., S, K] (stored), set as ``write_token_state`` sets a new token's; unchanged for a
    scorer without one."""
    new = scorer.token_state(values(v))
    if new is None:
        return state
    return jnp.broadcast_to(jnp.where(pos >= 0, new, 0.0)[..., None, :], state.shape)
