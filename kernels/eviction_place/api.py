"""``lowest_place`` and ``lowest_places``: the Triton kernels on CUDA, the XLA reference
elsewhere (Mosaic TPU has no loads gathered by an index array, which the kernels' pooling by
position reads through; the reference runs on TPU and CPU whatever ``impl`` asks, and for the
"layer" aggregate, which reads every KV head, on every platform)."""

from __future__ import annotations

import functools

import jax
from kvjax.kernels._shared import check_impl
from kvjax.kernels.eviction_place import gpu, reference


def lowest_place(
    state,
    pos,
    order,
    seen,
    *,
    n_sink: int,
    window: int,
    aggregate: str,
    pool: str,
    kernel: int,
    impl: str | None = None,
    interpret=False,
):
    """[B, Hk] int32 the first place of ``order`` whose slot has the lowest eviction key
    (``reference.keys_by_position``: the state's aggregate over the query heads, pooled along
    positions among the unprotected slots; protected +inf, empty -inf): a decoding step's one
    eviction per (row, KV head) in the dense cache.

    Args:
        state: [B, Hk, G, S] float32.
        pos, order: [B, Hk, S] int32 positions (-1: empty) and the slots by position.
        seen: [B] int32 one past each row's newest position.
        n_sink, window: the protected first and most recent positions.
        aggregate, pool, kernel: ``reference.AGGREGATES``, ``reference.POOLS`` and the pooling's
            width.
        impl / interpret: as ``block_attention_with_scores``.
    """
    options = dict(n_sink=n_sink, window=window, how=aggregate, pool=pool, kernel=kernel)
    xla, on_gpu = reference.lowest_place, gpu.lowest_place_gpu
    return _select(xla, on_gpu, options, impl, interpret, (state, pos, order, seen))


def lowest_places(
    state,
    pos,
    order,
    seen,
    *,
    picks: int,
    n_sink: int,
    window: int,
    aggregate: str,
    pool: str,
    kernel: int,
    impl: str | None = None,
    interpret=False,
) -> reference.Lowest:
    """The ``picks`` lowest eviction keys of each (row, KV head) listed by position (the keys of
    ``lowest_place``), with the counts a shared allocation's choice reads: a
    ``reference.Lowest`` (places [B, Hk, picks] of ``order``, valid slots by key then place, empty
    ones after; their keys; the valid and the protected slots [B, Hk]). The paged cache's decoding
    step: AdaKV drops the layer's new tokens from its heads' few lowest, with no pass over every
    slot besides this one. Arguments as ``lowest_place``'s; 1 <= picks <= S."""
    if not 1 <= picks <= state.shape[-1]:
        raise ValueError(f"picks={picks} must be in [1, S={state.shape[-1]}]")
    options = dict(
        picks=picks, n_sink=n_sink, window=window, how=aggregate, pool=pool, kernel=kernel
    )
    xla, on_gpu = reference.lowest_places, gpu.lowest_places_gpu
    return _select(xla, on_gpu, options, impl, interpret, (state, pos, order, seen))


def _select(xla, on_gpu, options, impl, interpret, args):
    """Checks the shapes of ``args`` = (state, pos, order, seen), and runs the kernel ``on_gpu``
    where ``impl`` and the platform say, else the reference ``xla``."""
    check_impl(impl)
    state, pos, order, seen = args
    B, Hk, G, S = state.shape
    for name, x in (("pos", pos), ("order", order)):
        if x.shape != (B, Hk, S):
            raise ValueError(
                f"{name} must be (B, Hk, S) = {(B, Hk, S)} like state's, got {x.shape}"
            )
    if seen.shape != (B,):
        raise ValueError(f"seen must be (B,) = {(B,)}, got {seen.shape}")
    xla = functools.partial(xla, **options)
    on_gpu = functools.partial(on_gpu, interpret=interpret, **options)
    if impl == "pallas_gpu":
        return on_gpu(*args)
    if impl == "xla" or options["how"] not in gpu.KERNEL_AGGREGATES:
        return xla(*args)
    return jax.lax.platform_dependent(*args, cpu=xla, tpu=xla, cuda=on_gpu, default=xla)
