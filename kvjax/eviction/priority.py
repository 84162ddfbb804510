"""The math scorers share, per (row, KV head) of one layer: the aggregate over query heads and the
pooling along positions (defined beside the dense cache's eviction kernel,
``kvjax.kernels.eviction_place.reference``), chunk means, CAOTE's meta-score, and
``eviction_keys`` (protected and empty slots around the scorer's priority). The semantics are in
``docs/eviction.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kernels.eviction_place import reference

# the keys' aggregate and pooling are the dense cache's eviction kernel's reference, one definition
from kvjax.kernels.eviction_place.reference import AGGREGATES as AGGREGATES
from kvjax.kernels.eviction_place.reference import POOLS as POOLS
from kvjax.kernels.eviction_place.reference import aggregate as aggregate
from kvjax.kernels.eviction_place.reference import pool_by_position
from kvjax.slots import inverse_permutation, set_slots


def pool(x: jax.Array, present: jax.Array, kind: str, kernel: int, order: jax.Array) -> jax.Array:
    """1-D pooling of x [B, Hk, ..., S] along positions, among the ``present`` [B, Hk, S] slots
    (``pool_by_position`` in the order of ``order`` [B, Hk, S], the slots by position, and back).
    Absent entries of x are returned unchanged."""
    if x.ndim == 3:  # both listed by one gather, and scattered back (docs/performance.md)
        xs, ps = reference.by_order(order, x, present)
        pooled = jnp.where(ps, pool_by_position(xs, ps, kind, kernel), xs)
        return set_slots(jnp.zeros_like(x), order, pooled, unique=True)
    # per query head ([B, Hk, G, S]: CAOTE's), a scatter back cost more than the inverse's gather
    by_pos = order.reshape(order.shape[:2] + (1,) * (x.ndim - 3) + order.shape[2:])
    present = jnp.broadcast_to(
        jnp.take_along_axis(present, order, -1).reshape(by_pos.shape), x.shape
    )
    xs = jnp.take_along_axis(x, jnp.broadcast_to(by_pos, x.shape), -1)
    pooled = jnp.where(present, pool_by_position(xs, present, kind, kernel), xs)
    rank = inverse_permutation(order)
    return jnp.take_along_axis(pooled, jnp.broadcast_to(rank.reshape(by_pos.shape), x.shape), -1)


def _chunk_mean(
    x: jax.Array, present: jax.Array, pos: jax.Array, order: jax.Array, chunk: int
) -> jax.Array:
    """x [B, Hk, S] with each ``present`` slot's value replaced by the mean over the present slots
    of its chunk (positions ``c·chunk … (c+1)·chunk − 1``). A chunk's present slots lie within
    ``chunk − 1`` places of each other in position order (``order`` [B, Hk, S])."""
    S = x.shape[-1]
    xs, ps, pos = reference.by_order(order, x, present, pos)
    cs = jnp.where(ps, pos // chunk, -1)
    pad = [(0, 0), (0, 0), (chunk - 1, chunk - 1)]
    xp, cp = jnp.pad(jnp.where(ps, xs, 0.0), pad), jnp.pad(cs, pad, constant_values=-1)
    total, count = jnp.zeros_like(xs), jnp.zeros_like(xs)
    for i in range(2 * chunk - 1):
        same = (cp[..., i : i + S] == cs) & ps
        total, count = total + jnp.where(same, xp[..., i : i + S], 0.0), count + same
    mean = jnp.where(ps, total / jnp.maximum(count, 1), xs)
    return set_slots(jnp.zeros_like(x), order, mean, unique=True)


def caote(h: jax.Array, v: jax.Array, valid: jax.Array, fast: bool) -> jax.Array:
    """CAOTE meta-score per query head.

    Args:
        h: [B, Hk, G, S] base scores.
        v: [B, Hk, S, K].
        valid: [B, Hk, S].

    h is normalised to sum 1 over the valid slots; c_j = h_j/(1 − h_j) ‖m − v_j‖ with m = Σ h_i v_i
    (CAOTE) or the plain mean of the valid values (FastCAOTE).
    """
    valid4 = valid[:, :, None, :]
    h = jnp.where(valid4, jnp.maximum(h, 0.0), 0.0)
    h = h / jnp.maximum(h.sum(-1, keepdims=True), 1e-30)
    vf = v.astype(jnp.float32)
    if fast:
        mix = (
            jnp.einsum("bhs,bhsk->bhk", valid.astype(jnp.float32), vf)
            / jnp.maximum(valid.sum(-1), 1)[..., None]
        )[:, :, None, :]
    else:
        mix = jnp.einsum("bhgs,bhsk->bhgk", h, vf)
    dist = jnp.linalg.norm(mix[:, :, :, None, :] - vf[:, :, None, :, :], axis=-1)  # [B, Hk, G, S]
    return h / jnp.maximum(1.0 - h, 1e-12) * dist


def eviction_keys(
    policy,
    state: jax.Array,
    pos: jax.Array,
    k: jax.Array | None,
    v: jax.Array | None,
    order: jax.Array,
    stats,
    seen: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's eviction keys [B, Hk, S]: +inf for protected slots (the ``n_sink`` first and
    ``window`` most recent positions), -inf for empty ones, else the scorer's priority (with
    ``chunk`` > 1, the mean over the slot's chunk). Also returns the priority and the unprotected
    mask [B, Hk, S]. Arguments as ``kvjax.eviction.base.Base.priority``."""
    protected, unprotected = reference.protection(pos, seen, policy.n_sink, policy.window)
    prio = policy.modifier_spec.priority(
        policy.scorer, policy, state, pos, unprotected, k, v, order, stats, seen
    )
    if policy.chunk > 1:
        prio = _chunk_mean(prio, unprotected, pos, order, policy.chunk)
    return jnp.where(unprotected, prio, jnp.where(protected, jnp.inf, -jnp.inf)), prio, unprotected


def keys_by_position(
    policy,
    state: jax.Array,
    pos: jax.Array,
    order: jax.Array,
    seen: jax.Array,
    with_positions: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``eviction_keys``' keys [B, Hk, S] listed by position (as ``order`` lists the slots), for a
    policy whose priority is its base's pooled aggregate (``Policy.pooled_aggregate``): pooled in
    that order (``kvjax.kernels.eviction_place.reference``), with no permutation back to the slots
    and none forth again (a decoding step of the dense cache inverted an [L, B, Hk, S] permutation
    for the pooling alone). The same keys, bit for bit; ``with_positions``: and the positions
    listed so."""
    return reference.keys_by_position(
        state,
        pos,
        order,
        seen,
        n_sink=policy.n_sink,
        window=policy.window,
        how=policy.aggregate,
        pool=policy.pool,
        kernel=policy.kernel,
        with_positions=with_positions,
    )
