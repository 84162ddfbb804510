"""MomentKV's residual norms as a Pallas Mosaic-TPU kernel.

Grid (B, Hk, key tiles), all parallel; the layer is prefetched into SMEM
(``PrefetchScalarGridSpec``) and the tiles of keys and values are read out of the stacked
[L, B, Hk, S, K] arrays in place (``Quantized`` codes and scales dequantized in VMEM,
``tpu_common.load``). S k_j is one MXU product of the tile against the head's [K, K] sums at full
float32 precision; the squared norms are summed along lanes on the MXU (``tpu_common.row_sums``)
so that they land as the [1, bk] row written out. bk is a multiple of 128, or all of S; a ragged
last tile's rows past S are zeroed before the sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kvjax.kernels import tpu_common as common
from kvjax.kernels._shared import kv_spec, round_up
from kvjax.kernels.moment_residuals.tiles import (
    check_inputs,
    check_unrotated,
    head_stats,
    read_dtype,
    residuals,
)


def tile_norms(k_ref, v_ref, stat_refs, first, n_slots, zeroth: bool, dtype):
    """‖r_j‖ [1, bk] of the key and value tiles k_ref, v_ref [bk, K] (refs, or ``Quantized`` of
    refs, read in ``dtype``, then float32) from slot ``first`` on, under one head's statistics
    (count [1, 1], k_sum, v_sum [1, K] and, unless zeroth, vk_sum [K, K] refs): the rows past
    ``n_slots`` zeroed. The decode attention kernel calls it on the tiles its softmax pass
    holds."""
    k = common.load(k_ref, dtype).astype(jnp.float32)
    v = common.load(v_ref, dtype).astype(jnp.float32)
    stats = head_stats(stat_refs, lambda ref: ref[...])
    r = common.real_rows(residuals(k, v, *stats, zeroth, common.full_dot), first, n_slots)
    return jnp.sqrt(common.row_sums(r * r))


def _kernel(
    layer_ref,
    k_ref,
    v_ref,
    *refs,
    n_slots: int,
    block_k: int,
    zeroth: bool,
    dtype,
):
    del layer_ref  # read by the index maps
    *stat_refs, out_ref = refs
    first = pl.program_id(2) * block_k
    out_ref[...] = tile_norms(k_ref, v_ref, stat_refs, first, n_slots, zeroth, dtype)


def stat_specs(head_dim: int, zeroth: bool, stacked: bool = False):
    """The BlockSpecs of one head's statistics (``stat_inputs``; no vk_sum if zeroth) in a grid
    whose first two axes are the row and the KV head; ``stacked``: of every layer's ([L, ...]),
    read at the layer that the last scalar-prefetch ref holds."""
    K = head_dim

    def spec(block):
        zeros = (0,) * len(block)
        if stacked:
            index = lambda b, h, *rest: (rest[-1][0], b, h) + zeros  # noqa: E731
            return pl.BlockSpec((None, None, None, *block), index)
        return pl.BlockSpec((None, None, *block), lambda b, h, *_: (b, h) + zeros)

    return [spec(block) for block in ((1, 1), (1, K), (1, K), (K, K))[: 3 if zeroth else 4]]


def stat_inputs(count, k_sum, v_sum, vk_sum) -> tuple:
    """The statistics as the kernels take them: count [..., B, Hk, 1, 1] float32, k_sum, v_sum
    [..., B, Hk, 1, K] and vk_sum [..., B, Hk, K, K] (none if None: the zeroth order)."""
    f32 = jnp.float32
    outer = () if vk_sum is None else (vk_sum,)
    return count.astype(f32)[..., None, None], k_sum[..., None, :], v_sum[..., None, :], *outer


def moment_residual_norms_tpu(
    k,
    v,
    count,
    k_sum,
    v_sum,
    vk_sum,
    zeroth: bool = False,
    *,
    layer=None,
    block_k: int | None = None,
    interpret=False,
):
    """‖r_j‖ [B, Hk, S] float32, as ``reference.residual_norms`` of k, v (arrays, or ``Quantized``
    whose kind is not rotated) read in their model dtype (vk_sum None for the zeroth order); with
    ``layer`` (an int32 scalar), k, v are [L, B, Hk, S, K] and layer ``layer`` is read. block_k
    is rounded up to a multiple of 128."""
    k, v, layer, (B, Hk, S, K) = check_inputs(k, v, count, k_sum, v_sum, vk_sum, layer, zeroth)
    common.check_head_dim(K)
    check_unrotated(k)
    bk = min(S, round_up(block_k or common.DEFAULT_BLOCK_K, common.LANES))
    nk = -(-S // bk)
    tile = (None, None, None, bk, K)

    kinds = pltpu.GridDimensionSemantics
    out = pl.pallas_call(
        functools.partial(_kernel, n_slots=S, block_k=bk, zeroth=zeroth, dtype=read_dtype(k)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hk, nk),
            in_specs=[
                kv_spec(k, tile, lambda b, h, j, layer: (layer[0], b, h, j, 0)),
                kv_spec(v, tile, lambda b, h, j, layer: (layer[0], b, h, j, 0)),
                *stat_specs(K, zeroth),
            ],
            out_specs=pl.BlockSpec((None, None, 1, bk), lambda b, h, j, *_: (b, h, 0, j)),
        ),
        out_shape=jax.ShapeDtypeStruct((B, Hk, 1, S), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=(kinds.PARALLEL,) * 3),
        interpret=interpret,
        name="moment_residual_norms",
    )(layer, k, v, *stat_inputs(count, k_sum, v_sum, vk_sum))
    return out[:, :, 0]
