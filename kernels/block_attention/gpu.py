"""Block attention with eviction scores as two Pallas GPU kernels on the Triton backend.

Why Triton and not Mosaic GPU: Pallas' Mosaic GPU backend targets Hopper and newer (sm_90a /
Blackwell: TMA copies, warpgroup-level ``wgmma`` with 64-row warpgroup tiles, explicit SMEM
pipelining), while the Triton backend lowers one program per grid cell to Triton IR that XLA
compiles for any CUDA GPU from Ampere on (and for ROCm), with power-of-two block shapes as its only
shape rule. The shapes here are small and irregular (G = 3 query heads per KV head in SmolLM2, a
handful of scoring queries), which suits Triton's per-program tiles better than 64-row warpgroup
tiles; and jaxlib 0.10.2 lowers a Triton kernel without a GPU present (it emits the
``__gpu$xla.gpu.triton`` custom call carrying Triton IR, compiled by XLA on the device), so the
lowering is checkable from a CPU machine.

Layout: rows [B, Hk, G, Tp, K] (Tp = T padded to the power-of-two query tile ``bq``, at least 16,
the minimum of ``tl.dot``); the cache is read in power-of-two key tiles ``bk`` straight from the
[B, Hk, S, K] arrays — never padded in HBM: tiles are loaded with ``plgpu.load`` masked by slot
index, so slots past S are not read and come back as zero keys/values with position -1. Triton
programs are independent (no sequential grid axis, no VMEM scratch), so each pass loops inside the
program instead of over a grid axis:

* pass 1, grid (B, Hk, G·q tiles): one query tile, a ``fori_loop`` over key tiles with the
  online-softmax statistics in registers (``gpu_common.softmax_kernel``); writes o [.., Tp, K]
  float32 and m, l [.., Tp];
* pass 2, grid (B, Hk, G·key tiles): one key tile's column, a loop over query tiles (skipped with a
  ``cond`` when all their weights are zero) — attn and obcache-value from the tile's [bq, bk]
  weights; the obcache-key/joint terms one scoring query at a time (``cond`` on w_t ≠ 0), from the
  differences v_s − o_t themselves ([bk, K] per query) (``gpu_common.column_scores``).

Quantized keys and values are read the same way — codes and scales [S, 1] in masked tiles — and
dequantized in registers after the load (``gpu_common.load_values``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels import gpu_common as common
from kvjax.kernels._shared import (
    check_score,
    check_shapes,
    kv_spec,
    next_pow2,
    pad_axis,
    round_up,
)


def _scores_kernel(
    q_ref,
    k_ref,
    v_ref,
    spos_ref,
    qpos_ref,
    w_ref,
    o_ref,
    m_ref,
    l_ref,
    col_ref,
    *,
    score: str,
    n_slots: int,
    n_queries: int,
    block_q: int,
    block_k: int,
    scale: float,
    n_k_tiles: int,
):
    """The column of key tile program_id(2) mod n_k_tiles for one query head
    (``gpu_common.column_scores``)."""
    first = (pl.program_id(2) % n_k_tiles) * block_k
    v_ref = None if score == "attn" else v_ref
    tile = common.dense_tile(k_ref, v_ref, spos_ref, first, block_k, n_slots, q_ref.dtype)
    rows = common.QueryRefs(q_ref, qpos_ref, w_ref, o_ref, m_ref, l_ref)
    col_ref[...] = common.column_scores(
        score, tile, rows, n_queries=n_queries, block_q=block_q, scale=scale
    )


def block_attention_gpu(
    q,
    k,
    v,
    slot_pos,
    query_pos,
    query_weights=None,
    score: str = "attn",
    *,
    block_k: int | None = None,
    block_q: int | None = None,
    interpret=False,
    num_warps: int | None = None,
    num_stages: int = 2,
):
    """Same contract as ``reference.block_attention_with_scores``, as Pallas Triton kernels.

    Args:
        block_k / block_q: rounded up to powers of two ≥ 16 (block_q is capped at T rounded up
            that way).
        interpret: run with the Pallas interpreter (any backend); otherwise they only lower for
            CUDA/ROCm.
    """
    check_score(score)
    B, T, H, Hk, S, K = check_shapes(q, k, v, slot_pos, query_pos, query_weights)
    G = H // Hk
    common.check_head_dim(K)
    bk = max(common.MIN_DOT, next_pow2(block_k or common.DEFAULT_BLOCK_K))
    bq = common.query_tile(T, block_q)
    Tp = round_up(T, bq)
    nq, nk = Tp // bq, -(-S // bk)  # the last key tile may run past S: masked loads, no padded copy
    scale = math.sqrt(K)
    params = plgpu.CompilerParams(
        num_warps=num_warps or (4 if K <= 64 else 8), num_stages=num_stages
    )

    rows, qpos = common.block_queries(q, query_pos, Hk, Tp)
    spos = slot_pos.astype(jnp.int32)

    # whole head: tiles loaded inside
    def head_kv(x):
        return kv_spec(x, (None, None, S, K), lambda b, h, i: (b, h, 0, 0))

    head_pos = pl.BlockSpec((None, None, S), lambda b, h, x: (b, h, 0))
    tile_rows = pl.BlockSpec((None, None, None, bq, K), lambda b, h, x: (b, h, x // nq, x % nq, 0))
    tile_vec = pl.BlockSpec((None, None, None, bq), lambda b, h, x: (b, h, x // nq, x % nq))
    o, m, l = pl.pallas_call(
        functools.partial(common.softmax_kernel, n_slots=S, block_k=bk, n_tiles=nk, scale=scale),
        grid=(B, Hk, G * nq),
        in_specs=[
            tile_rows,
            head_kv(k),
            head_kv(v),
            head_pos,
            pl.BlockSpec((None, bq), lambda b, h, x: (b, x % nq)),
        ],
        out_specs=[tile_rows, tile_vec, tile_vec],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hk, G, Tp, K), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, G, Tp), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, G, Tp), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="block_attention_stats",
    )(rows, k, v, spos, qpos)

    out, lse = common.block_outputs(o, m, l, T, q.dtype)
    if query_weights is None:
        return out, lse, None

    w = pad_axis(query_weights.astype(jnp.float32), 1, Tp)
    all_rows = pl.BlockSpec((None, None, None, Tp, K), lambda b, h, x: (b, h, x // nk, 0, 0))
    all_vec = pl.BlockSpec((None, None, None, Tp), lambda b, h, x: (b, h, x // nk, 0))
    per_query = pl.BlockSpec((None, Tp), lambda b, h, x: (b, 0))
    col = pl.pallas_call(
        functools.partial(
            _scores_kernel,
            score=score,
            n_slots=S,
            n_queries=T,
            block_q=bq,
            block_k=bk,
            scale=scale,
            n_k_tiles=nk,
        ),
        grid=(B, Hk, G * nk),
        in_specs=[
            all_rows,
            head_kv(k),
            head_kv(v),
            head_pos,
            per_query,
            per_query,
            all_rows,
            all_vec,
            all_vec,
        ],
        out_specs=pl.BlockSpec((None, None, None, bk), lambda b, h, x: (b, h, x // nk, x % nk)),
        # a column tile per program
        out_shape=jax.ShapeDtypeStruct((B, Hk, G, nk * bk), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="block_attention_scores",
    )(rows, k, v, spos, qpos, w, o, m, l)
    return out, lse, col[..., :S]
