"""``Segment``: the new tokens of one forward call, which the model passes to every layer's
``cache.attend``; ``when``: a step that runs on a static or traced flag."""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class Segment:
    """The new tokens of one forward call, shared by all layers.

    Fields:
        positions: [B, T] int32 absolute positions (rows are right-padded; padded queries' outputs
            are unused).
        valid: [B, T] bool, False for padding.
        query_weights: [B, T] float32 scoring queries, or None.
        seen: [B] int32 one past the newest valid position after this call.
        evict: whether this call ends with an eviction (a Python bool when known statically, else
            a traced bool scalar).
        from_start (static): positions are ``0 … T-1`` in every row (a prefill into an empty
            cache), which lets the full cache skip the masked upper triangle.
        policy (static): the ``kvjax.eviction.Policy`` of a budget cache (None for the full
            cache), taken from the engine's ``Eviction``.
        evict_in_layer (static): at an eviction point each layer evicts right after its attention
            has scored, instead of the step evicting after every layer
            (``Eviction.evicts_by_layer``, or ``decode_order="evict-first"``).
        attend_kept (static): with ``evict_in_layer``, the layer outputs the attention over the
            tokens it keeps (``decode_order="evict-first"``); else over all it attended, which is
            what an eviction after the step gives.
        fresh_state (static): the scorer's state is zero when this step begins (decoding that
            evicts at every step under a scorer that zeroes its state at every eviction point,
            after a prompt whose last block ended with one: ``Eviction.fresh_state``), so the
            step computes it from its own column without reading the stored one, and its
            eviction point leaves it as it is (the next step overwrites it); the caller zeroes
            it after the last such step.
    """

    positions: jax.Array
    from_start: bool = struct.field(pytree_node=False, default=False)
    valid: jax.Array | None = None
    query_weights: jax.Array | None = None
    seen: jax.Array | None = None
    evict: jax.Array | None = None
    policy: object = struct.field(pytree_node=False, default=None)
    evict_in_layer: bool = struct.field(pytree_node=False, default=False)
    attend_kept: bool = struct.field(pytree_node=False, default=False)
    fresh_state: bool = struct.field(pytree_node=False, default=False)


def when(flag, fn, x):
    """``fn(x)`` if ``flag`` else ``x``; flag: a Python bool (or None: False), or a traced bool
    scalar (then under ``lax.cond``)."""
    if flag is None or isinstance(flag, bool):
        return fn(x) if flag else x
    return jax.lax.cond(flag, fn, lambda y: y, x)
