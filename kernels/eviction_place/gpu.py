"""The lowest key's place as a Pallas GPU kernel (Triton backend).

Grid (B, Hk): each program reads its (row, KV head)'s order, and through it (gathered loads) the
positions and the G states of the slots at each place and at each place of its pooling window, and
writes one int32. XLA's form writes the aggregate, the keys and, to pool by position, an index array
per slot; here nothing but the place leaves the program. The aggregate and the pooling add in the
reference's order (query heads, then the window left to right), so the keys are the reference's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels._shared import next_pow2

KERNEL_AGGREGATES = ("sum", "mean", "max")  # "layer" reads every KV head: the reference runs


def _kernel(
    seen_ref,
    state_ref,
    pos_ref,
    order_ref,
    out_ref,
    *,
    n_slots: int,
    width: int,
    groups: int,
    n_sink: int,
    window: int,
    how: str,
    pool: str,
    kernel: int,
):
    b, h = pl.program_id(0), pl.program_id(1)
    seen = plgpu.load(seen_ref.at[b])
    place = jnp.arange(width, dtype=jnp.int32)

    def at(p):  # (aggregate, protected, unprotected) [width] of the slots at places p
        inside = (p >= 0) & (p < n_slots)
        slot = plgpu.load(order_ref.at[b, h, jnp.clip(p, 0, n_slots - 1)], mask=inside, other=0)
        pos = plgpu.load(pos_ref.at[b, h, slot], mask=inside, other=-1)
        valid = inside & (pos >= 0)
        protected = valid & ((pos < n_sink) | (pos >= seen - window))
        heads = [
            plgpu.load(state_ref.at[b, h, g, slot], mask=inside, other=0.0) for g in range(groups)
        ]
        if how == "max":
            agg = functools.reduce(jnp.maximum, heads)
        else:
            agg = functools.reduce(jnp.add, heads)
            agg = agg / groups if how == "mean" else agg
        return agg, protected, valid & ~protected

    agg, protected, unprotected = at(place)
    if pool != "none":
        fill = -jnp.inf if pool == "max" else 0.0
        half, total = kernel // 2, None
        for i in range(kernel):
            near, _, present = (agg, None, unprotected) if i == half else at(place + i - half)
            term = jnp.where(present, near, fill)
            if total is None:
                total = term
            else:
                total = jnp.maximum(total, term) if pool == "max" else total + term
        agg = total if pool == "max" else total / kernel
    key = jnp.where(unprotected, agg, jnp.where(protected, jnp.inf, -jnp.inf))
    key = jnp.where(place < n_slots, key, jnp.inf)
    lowest = jnp.min(key)
    out_ref[...] = jnp.full((1,), jnp.min(jnp.where(key == lowest, place, width)), jnp.int32)


def lowest_place_gpu(
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
    interpret=False,
    num_warps: int = 4,
):
    """``reference.lowest_place`` (arguments as there; ``how`` one of ``KERNEL_AGGREGATES``),
    [B, Hk] int32."""
    B, Hk, G, S = state.shape
    if how not in KERNEL_AGGREGATES:
        raise ValueError(f"aggregate={how!r}: the GPU kernel takes {KERNEL_AGGREGATES}")

    def whole(x):
        return pl.BlockSpec(x.shape, lambda b, h: (0,) * x.ndim)

    seen = seen.astype(jnp.int32)
    out = pl.pallas_call(
        functools.partial(
            _kernel,
            n_slots=S,
            width=next_pow2(S),
            groups=G,
            n_sink=n_sink,
            window=window,
            how=how,
            pool=pool,
            kernel=kernel,
        ),
        grid=(B, Hk),
        in_specs=[whole(seen), whole(state), whole(pos), whole(order)],
        out_specs=pl.BlockSpec((None, None, 1), lambda b, h: (b, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, 1), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="lowest_place",
    )(seen, state, pos, order)
    return out[..., 0]
