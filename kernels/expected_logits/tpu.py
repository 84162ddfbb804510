"""Expected Attention's expected logits as a Pallas Mosaic-TPU kernel.

Grid (B, Hk, key tiles), all parallel; tiles of keys are read from the cache in place
(``Quantized`` codes and scales dequantized in VMEM, ``tpu_common.load``). The tile is rotated by
one MXU product against the row's [K, K] R̄, and Q_g k'_j is one more per query head against its
[K, K] sum of outer products, at full float32 precision; the terms are summed along lanes on the
MXU (``tpu_common.row_sums``) so that each head's logits land as a [1, bk] row of the [G, bk]
block written out. Queries whose outer products the sums do not hold yet (``pending``, E of them
on sublanes) add one [E, bk] product per query head, summed over sublanes. bk is a multiple of
128, or all of S; a ragged last tile's rows past S are zeroed first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kvjax.kernels import tpu_common as common
from kvjax.kernels._shared import kv_spec, round_up
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
    first = pl.program_id(2) * block_k
    k = common.real_rows(common.load(k_ref, dtype).astype(jnp.float32), first, n_slots)
    kr = common.full_dot(k, rot_t_ref[...])  # row j: R̄ᵀ k_j
    inv = None if inv_ref is None else inv_ref[...]  # [1, 1]
    G = mean_ref.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (G, 1), 0)
    out = jnp.zeros((G, k.shape[0]), jnp.float32)
    for g in range(G):
        qq = None if qq_ref is None else qq_ref[g]
        lin, quad = logit_terms(kr, mean_ref[pl.ds(g, 1), :], qq, inv, common.full_dot)
        quad = None if quad is None else common.row_sums(quad)
        if pending_ref is not None:
            quad += jnp.sum(
                pending_terms(kr, pending_ref[g], inv, common.full_dot), axis=0, keepdims=True
            )
        z = combine(common.row_sums(lin), quad, k.shape[1])
        out = jnp.where(row == g, z, out)  # [1, bk] into row g
    out_ref[...] = out


def expected_logits_tpu(
    k,
    rotation,
    mean,
    qq_sum=None,
    count=None,
    pending=None,
    *,
    block_k: int | None = None,
    interpret=False,
):
    """z [B, Hk, G, S] float32, as ``reference.expected_logits`` of k (an array, or ``Quantized``
    whose kind is not rotated) read in its model dtype. block_k is rounded up to a multiple of
    128; pending queries, padded to a multiple of 8 (a float32 sublane tile)."""
    B, Hk, G, S, K = check_inputs(k, rotation, mean, qq_sum, count, pending)
    pending = pad_pending(pending, common.CHUNK)
    common.check_head_dim(K)
    check_unrotated(k)
    bk = min(S, round_up(block_k or common.DEFAULT_BLOCK_K, common.LANES))
    nk = -(-S // bk)
    kinds = pltpu.GridDimensionSemantics
    return pl.pallas_call(
        functools.partial(_kernel, n_slots=S, block_k=bk, dtype=read_dtype(k)),
        grid=(B, Hk, nk),
        in_specs=[
            kv_spec(k, (None, None, bk, K), lambda b, h, j: (b, h, j, 0)),
            *stat_specs(G, K, qq_sum is not None, 0 if pending is None else pending.shape[3]),
        ],
        out_specs=pl.BlockSpec((None, None, G, bk), lambda b, h, j: (b, h, 0, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, G, S), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=(kinds.PARALLEL,) * 3),
        interpret=interpret,
        name="expected_logits",
    )(k, *operands(rotation, mean, qq_sum, count, pending))
