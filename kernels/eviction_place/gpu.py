"""The lowest key's place, and the few lowest with their counts, as Pallas GPU kernels (Triton
backend).

Grid (B, Hk): each program reads its (row, KV head)'s order, and through it (gathered loads) the
positions and the G states of the slots at each place and at each place of its pooling window, and
writes one int32 (``lowest_place``), or its ``picks`` lowest places and keys and two counts
(``lowest_places``). XLA's form writes the aggregate, the keys and, to pool by position, an index
array per slot; here nothing but the result leaves the program. The aggregate and the pooling add in
the reference's order (query heads, then the window left to right), so the keys are the reference's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels._shared import next_pow2
from kvjax.kernels.eviction_place import reference

KERNEL_AGGREGATES = ("sum", "mean", "max")  # "layer" reads every KV head: the reference runs


def _keys(
    seen_ref,
    state_ref,
    pos_ref,
    order_ref,
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
    """(keys [width] of program (b, h)'s places, those places): the reference's keys by position,
    +inf past the S slots."""
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
    return jnp.where(place < n_slots, key, jnp.inf), place


def _kernel(seen_ref, state_ref, pos_ref, order_ref, out_ref, **options):
    key, place = _keys(seen_ref, state_ref, pos_ref, order_ref, **options)
    lowest = jnp.min(key)
    out_ref[...] = jnp.full((1,), jnp.min(jnp.where(key == lowest, place, options["width"])))


def _lowest_kernel(
    seen_ref,
    state_ref,
    pos_ref,
    order_ref,
    place_ref,
    key_ref,
    count_ref,
    protected_ref,
    *,
    picks: int,
    **options,
):
    key, place = _keys(seen_ref, state_ref, pos_ref, order_ref, **options)
    width, out = options["width"], jnp.arange(place_ref.shape[-1], dtype=jnp.int32)
    inside = place < options["n_slots"]
    valid = inside & (key > -jnp.inf)
    count_ref[...] = jnp.full((1,), jnp.sum(valid.astype(jnp.int32)))
    protected_ref[...] = jnp.full((1,), jnp.sum((inside & (key == jnp.inf)).astype(jnp.int32)))
    rank = jnp.where(valid, key, jnp.inf)  # empty slots after the valid ones
    taken = place < 0
    places, keys = jnp.zeros_like(out), jnp.zeros(out.shape, jnp.float32)
    for i in range(picks):  # the lowest untaken, the first place of equal ones
        low = jnp.min(jnp.where(taken, jnp.inf, rank))
        p = jnp.min(jnp.where(~taken & (rank == low), place, width))
        hit = place == p
        places = jnp.where(out == i, p, places)
        keys = jnp.where(out == i, jnp.min(jnp.where(hit, key, jnp.inf)), keys)
        taken |= hit
    place_ref[...] = places
    key_ref[...] = keys


def lowest_place_gpu(state, pos, order, seen, *, interpret=False, **options):
    """``reference.lowest_place`` (arguments as there; ``how`` one of ``KERNEL_AGGREGATES``),
    [B, Hk] int32."""
    (out,) = _call(_kernel, "lowest_place", (1,), (state, pos, order, seen), options, interpret)
    return out[..., 0]


def lowest_places_gpu(state, pos, order, seen, *, picks: int, interpret=False, **options):
    """``reference.lowest_places`` (arguments as there; ``how`` one of ``KERNEL_AGGREGATES``), a
    ``reference.Lowest``. Its picks are ``picks`` greedy min-reductions over the keys in
    registers, each the lowest untaken key's first place (as ``jax.lax.top_k``'s ties go)."""
    wide = next_pow2(picks)
    place, key, count, protected = _call(
        functools.partial(_lowest_kernel, picks=picks),
        "lowest_places",
        (wide, wide, 1, 1),
        (state, pos, order, seen),
        options,
        interpret,
        dtypes=(jnp.int32, jnp.float32, jnp.int32, jnp.int32),
    )
    return reference.Lowest(place[..., :picks], key[..., :picks], count[..., 0], protected[..., 0])


def _call(body, name, widths, args, options, interpret, dtypes=(jnp.int32,)):
    """The grid (B, Hk) over ``body`` of ``args`` = (state, pos, order, seen), whose outputs are
    [B, Hk, width] for each of ``widths`` (powers of 2) in ``dtypes``; each program holds its
    head's S slots at once, in up to 16 warps (more registers for wider rows: the 8B's AdaKV has
    6,576 slots a head)."""
    state, pos, order, seen = args
    B, Hk, G, S = state.shape
    if options["how"] not in KERNEL_AGGREGATES:
        raise ValueError(f"aggregate={options['how']!r}: the GPU kernel takes {KERNEL_AGGREGATES}")
    width = next_pow2(S)

    def whole(x):
        return pl.BlockSpec(x.shape, lambda b, h: (0,) * x.ndim)

    seen = seen.astype(jnp.int32)
    return pl.pallas_call(
        functools.partial(body, n_slots=S, width=width, groups=G, **options),
        grid=(B, Hk),
        in_specs=[whole(seen), whole(state), whole(pos), whole(order)],
        out_specs=[pl.BlockSpec((None, None, w), lambda b, h: (b, h, 0)) for w in widths],
        out_shape=[jax.ShapeDtypeStruct((B, Hk, w), d) for w, d in zip(widths, dtypes)],
        compiler_params=plgpu.CompilerParams(num_warps=min(16, max(4, width // 512)), num_stages=1),
        interpret=interpret,
        name=name,
    )(seen, state, pos, order)
