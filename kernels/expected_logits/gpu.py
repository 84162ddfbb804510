"""Expected Attention's expected logits as a Pallas GPU kernel (Triton backend).

Grid (B, Hk, key tiles): each program loads a tile of bk keys of its (row, KV head) straight out
of the cache (masked loads, ``gpu_common.load_tile``: never sliced or padded in HBM; ``Quantized``
codes and scales dequantized in registers), rotates them with one ``tl.dot`` against the row's
[K, K] R̄, then forms Q_g k'_j with one ``tl.dot`` per query head of the group against its [K, K]
sum of outer products, and writes the G logits only: G · bk floats where the XLA form writes
R̄ᵀk_j and Q_g k'_j ([bk, K] and [G, bk, K] float32) and reads them back. Queries whose outer
products the sums do not hold yet (``pending``) add one more ``tl.dot`` per query head against them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels import gpu_common as common
from kvjax.kernels._shared import NT_DIMS, kv_spec, next_pow2
from kvjax.kernels.expected_logits.tiles import (
    check_inputs,
    combine,
    logit_terms,
    operands,
    pad_pending,
    pending_terms,
    stat_specs,
)
from kvjax.kernels.moment_residuals.tiles import check_unrotated, read_dtype


def _kernel(
    k_ref,
    rot_t_ref,
    mean_ref,
    qq_ref,
    inv_ref,
    pending_ref,
    out_ref,
    *,
    n_slots: int,
    block_k: int,
    dtype,
):
    load = functools.partial(
        common.load_tile,
        start=pl.program_id(2) * block_k,
        size=block_k,
        n_slots=n_slots,
        head=(pl.program_id(0), pl.program_id(1)),
    )

    def dot(a, b):
        return common.dot(a, b, NT_DIMS)

    k = common.load_values(k_ref, dtype, load).astype(jnp.float32)
    kr = dot(k, rot_t_ref[...])  # row j: R̄ᵀ k_j
    inv = None if inv_ref is None else inv_ref[...]  # [1, 1]
    for g in range(mean_ref.shape[0]):
        qq = None if qq_ref is None else qq_ref[g]
        lin, quad = logit_terms(kr, mean_ref[g][None, :], qq, inv, dot)
        quad = None if quad is None else jnp.sum(quad, axis=1)
        if pending_ref is not None:
            quad += jnp.sum(pending_terms(kr, pending_ref[g], inv, dot), axis=0)
        out_ref[g, :] = combine(jnp.sum(lin, axis=1), quad, kr.shape[1])


def expected_logits_gpu(
    k,
    rotation,
    mean,
    qq_sum=None,
    count=None,
    pending=None,
    *,
    block_k: int | None = None,
    interpret=False,
    num_warps: int | None = None,
    num_stages: int = 2,
):
    """z [B, Hk, G, S] float32, as ``reference.expected_logits`` of k (an array, or ``Quantized``
    whose kind is not rotated) read in its model dtype. block_k is rounded up to a power of two
    ≥ 16; num_warps None: 4, or 8 for tiles of more than 64 slots; pending queries, padded to a
    multiple of 16 (``tl.dot``'s least)."""
    B, Hk, G, S, K = check_inputs(k, rotation, mean, qq_sum, count, pending)
    pending = pad_pending(pending, common.MIN_DOT)
    common.check_head_dim(K)
    check_unrotated(k)
    bk = max(common.MIN_DOT, next_pow2(block_k or common.DEFAULT_BLOCK_K))
    nk = -(-S // bk)
    out = pl.pallas_call(
        functools.partial(_kernel, n_slots=S, block_k=bk, dtype=read_dtype(k)),
        grid=(B, Hk, nk),
        in_specs=[
            kv_spec(k, k.shape, lambda b, h, j: (0,) * len(k.shape)),
            *stat_specs(G, K, qq_sum is not None, 0 if pending is None else pending.shape[3]),
        ],
        out_specs=pl.BlockSpec((None, None, G, bk), lambda b, h, j: (b, h, 0, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, G, nk * bk), jnp.float32),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or (4 if bk <= 64 else 8), num_stages=num_stages
        ),
        interpret=interpret,
        name="expected_logits",
    )(k, *operands(rotation, mean, qq_sum, count, pending))
    return out[..., :S]
