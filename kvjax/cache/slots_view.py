"""What both budget caches (``BudgetCache``, ``PagedCache``) read the same way off their slots,
and the reset of their scorer state.

A mixin of properties only: it adds no fields, so each cache stays the same ``flax.struct`` pytree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
