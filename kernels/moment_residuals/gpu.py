"""MomentKV's residual norms as a Pallas GPU kernel (Triton backend).

Grid (B, Hk, key tiles): each program loads a tile of bk keys and values of its (row, KV head)
straight out of the stacked [L, B, Hk, S, K] arrays at the layer given (masked loads,
``gpu_common.load_tile``: the cache is never sliced or padded in HBM; ``Quantized`` codes and
scales dequantized in registers), forms S k_j for the tile with one ``tl.dot`` against the head's
[K, K] sums and writes ‖r_j‖ only: bk floats where the XLA form writes S k_j, [bk, K] float32, and
reads it back twice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels import gpu_common as common
from kvjax.kernels._shared import NT_DIMS, kv_spec, next_pow2
from kvjax.kernels.moment_residuals.tiles import (
    check_inputs,
    check_unrotated,
    head_stats,
    read_dtype,
    residuals,
)


def tile_norms(k, v, stat_refs, zeroth: bool, head: tuple = ()):
    """‖r_j‖ [bk] of a tile's keys and values k, v [bk, K] (read in the model's dtype) under one
    head's statistics (count [1], k_sum, v_sum [K] and, unless zeroth, vk_sum [K, K] refs; with
    ``head``, the head at those leading indices of larger refs). The decode attention kernel
    calls it on the tiles its softmax pass holds."""
    count, k_sum, v_sum, vk_sum = head_stats(stat_refs, lambda r: r[head] if head else r[...])
    stats = (count[:, None], k_sum[None, :], v_sum[None, :], vk_sum)  # [1, 1], [1, K] ×2, [K, K]
    f32 = jnp.float32
    r = residuals(
        k.astype(f32), v.astype(f32), *stats, zeroth, lambda a, b: common.dot(a, b, NT_DIMS)
    )
    return jnp.sqrt(jnp.sum(r * r, axis=1))


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
    head = (layer_ref[0], pl.program_id(0), pl.program_id(1))
    load = functools.partial(
        common.load_tile, start=pl.program_id(2) * block_k, size=block_k, n_slots=n_slots, head=head
    )
    k = common.load_values(k_ref, dtype, load)
    v = common.load_values(v_ref, dtype, load)
    *stat_refs, out_ref = refs
    out_ref[...] = tile_norms(k, v, stat_refs, zeroth)


def stat_specs(head_dim: int, zeroth: bool):
    """The BlockSpecs of one head's statistics (``stat_inputs``) in a grid whose first two axes
    are the row and the KV head."""
    K = head_dim

    def spec(block):
        return pl.BlockSpec((None, None, *block), lambda b, h, *_: (b, h) + (0,) * len(block))

    return [spec(block) for block in ((1,), (K,), (K,), (K, K))[: 3 if zeroth else 4]]


def stat_inputs(count, k_sum, v_sum, vk_sum) -> tuple:
    """The statistics as the kernels take them: count [..., B, Hk, 1] float32, k_sum, v_sum
    [..., B, Hk, K] and vk_sum [..., B, Hk, K, K] (none if None: the zeroth order)."""
    outer = () if vk_sum is None else (vk_sum,)
    return count.astype(jnp.float32)[..., None], k_sum, v_sum, *outer


def moment_residual_norms_gpu(
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
    num_warps: int | None = None,
    num_stages: int = 2,
):
    """‖r_j‖ [B, Hk, S] float32, as ``reference.residual_norms`` of k, v (arrays, or ``Quantized``
    whose kind is not rotated) read in their model dtype (vk_sum None for the zeroth order); with
    ``layer`` (an int32 scalar), k, v are [L, B, Hk, S, K] and layer ``layer`` is read. block_k
    is rounded up to a power of two ≥ 16; num_warps None: 4, or 8 for tiles of more than 64
    slots."""
    k, v, layer, (B, Hk, S, K) = check_inputs(k, v, count, k_sum, v_sum, vk_sum, layer, zeroth)
    common.check_head_dim(K)
    check_unrotated(k)
    bk = max(common.MIN_DOT, next_pow2(block_k or common.DEFAULT_BLOCK_K))
    nk = -(-S // bk)

    def whole(x):
        return kv_spec(x, x.shape, lambda b, h, j: (0,) * len(x.shape))

    out = pl.pallas_call(
        functools.partial(_kernel, n_slots=S, block_k=bk, zeroth=zeroth, dtype=read_dtype(k)),
        grid=(B, Hk, nk),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, j: (0,)),
            whole(k),
            whole(v),
            *stat_specs(K, zeroth),
        ],
        out_specs=pl.BlockSpec((None, None, bk), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, nk * bk), jnp.float32),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or (4 if bk <= 64 else 8), num_stages=num_stages
        ),
        interpret=interpret,
        name="moment_residual_norms",
    )(layer, k, v, *stat_inputs(count, k_sum, v_sum, vk_sum))
    return out[:, :, :S]
