"""Decode attention (one query per sequence) with eviction scores as Pallas GPU kernels, Triton backend.

Triton rather than Mosaic GPU for the reasons given in ``kvjax.kernels.block_attention.gpu``: Mosaic GPU
needs Hopper or newer and warpgroup-sized (64-row) tiles, while a decode step has G ≤ 8 rows per KV head
and must run on any CUDA GPU.

A decode step has little parallelism per (row, KV head), so the softmax pass splits the cache
("flash-decoding"): grid (B, Hk, splits), each program runs the online softmax over its run of key tiles
and writes partial (o, m, l); the partials are merged in jnp (a log-sum-exp over ≤ 8 splits of [G, K]).
The scores pass, grid (B, Hk, key tiles), recomputes each tile's logits with the merged statistics and
writes the per-slot scores of the G rows (rows padded to 16, the minimum of ``tl.dot``). Unweighted: the
wrapper multiplies by the query's weight. The cache is read from the [B, Hk, S, K] arrays in masked
power-of-two tiles (``block_attention.gpu.load_tile``), never padded in HBM. The obcache-key/joint terms
use the differences v_s − o_g themselves, one head row at a time.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels._shared import (
    NT_DIMS,
    check_score,
    check_shapes,
    next_pow2,
    pad_axis,
)
from kvjax.kernels.block_attention.gpu import (
    DEFAULT_BLOCK_K,
    MIN_DOT,
    _stats_kernel,
    check_head_dim,
    load_tile,
    masked_logits,
)
from kvjax.kernels.decode_attention.reference import check_decode

MAX_SPLITS = 8


def _scores_kernel(q_ref, k_ref, v_ref, spos_ref, qpos_ref, o_ref, m_ref, l_ref, col_ref, *, score: str,
                   n_heads: int, n_slots: int, block_k: int, scale: float):
    q = q_ref[...]  # [Gp, K]
    bk = block_k
    first = pl.program_id(2) * bk
    k = load_tile(k_ref, first, bk, n_slots).astype(q.dtype)
    slot = first + jnp.arange(bk, dtype=jnp.int32)
    z = jax.lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) / scale  # [Gp, bk]
    spos = load_tile(spos_ref, first, bk, n_slots, -1)
    logits, visible = masked_logits(z, spos[None, :], qpos_ref[...][:, None], slot[None, :], n_slots)
    a = jnp.exp(logits - m_ref[...][:, None]) / l_ref[...][:, None]
    if score == "attn":
        col_ref[...] = a
        return
    vf = load_tile(v_ref, first, bk, n_slots).astype(jnp.float32)
    a2 = a * a
    total = jnp.zeros(a.shape, jnp.float32)
    if score in ("obcache-value", "obcache-joint"):
        total = a2 * jnp.sum(vf * vf, axis=1)[None, :]
    if score in ("obcache-key", "obcache-joint"):
        z0 = jnp.where(visible, z, 0.0)
        row = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
        dist = jnp.zeros(a.shape, jnp.float32)
        dots = jnp.zeros(a.shape, jnp.float32)
        for g in range(n_heads):
            diff = vf - o_ref[g, :][None, :]  # v_s − o_g, formed explicitly
            dist = jnp.where(row == g, jnp.sum(diff * diff, axis=1)[None, :], dist)
            if score == "obcache-joint":
                dots = jnp.where(row == g, jnp.sum(vf * diff, axis=1)[None, :], dots)
        total = total + a2 * z0 * z0 * dist
        if score == "obcache-joint":
            total = total + 2.0 * a2 * z0 * dots
    col_ref[...] = total


def decode_attention_gpu(q, k, v, slot_pos, query_pos, query_weights=None, score: str = "attn", *,
                         block_k: int | None = None, splits: int | None = None, interpret=False,
                         num_warps: int | None = None, num_stages: int = 2):
    """(o [B, 1, H, K] float32 — uncorrected —, lse [B, 1, H], col [B, Hk, G, S] or None), as
    ``reference.decode_attention_with_scores`` without moments. block_k is rounded up to a power of two
    ≥ 16; splits (default: up to 8) is the number of cache splits of the softmax pass."""
    check_score(score)
    check_decode(q)
    B, _, H, Hk, S, K = check_shapes(q, k, v, slot_pos, query_pos, query_weights)
    G = H // Hk
    check_head_dim(K)
    gp = max(MIN_DOT, next_pow2(G))
    bk = max(MIN_DOT, next_pow2(block_k or DEFAULT_BLOCK_K))
    nk = -(-S // bk)
    per_split = -(-nk // min(splits or MAX_SPLITS, nk))
    n_splits = -(-nk // per_split)  # every split starts with a real slot
    scale = math.sqrt(K)
    params = plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages)

    rows = pad_axis(q.reshape(B, Hk, G, K), 2, gp)
    spos = slot_pos.astype(jnp.int32)
    qpos = jnp.broadcast_to(query_pos.astype(jnp.int32).reshape(B, 1), (B, gp))

    head_spec = pl.BlockSpec((None, None, gp, K), lambda b, h, s: (b, h, 0, 0))
    head_kv = pl.BlockSpec((None, None, S, K), lambda b, h, s: (b, h, 0, 0))  # whole head: masked tile loads
    head_pos = pl.BlockSpec((None, None, S), lambda b, h, s: (b, h, 0))
    o_part, m_part, l_part = pl.pallas_call(
        functools.partial(_stats_kernel, n_slots=S, block_k=bk, n_tiles=per_split, scale=scale, split_axis=2),
        grid=(B, Hk, n_splits),
        in_specs=[head_spec, head_kv, head_kv, head_pos, pl.BlockSpec((None, gp), lambda b, h, s: (b, 0))],
        out_specs=[pl.BlockSpec((None, None, None, gp, K), lambda b, h, s: (b, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Hk, n_splits, gp, K), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, n_splits, gp), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, n_splits, gp), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="decode_attention_partial_softmax",
    )(rows, k, v, spos, qpos)

    # Merge the splits: m = max m_s, l = Σ l_s e^(m_s − m), o = Σ o_s l_s e^(m_s − m) / l (all finite).
    m = jnp.max(m_part, axis=2)
    scaled = l_part * jnp.exp(m_part - m[:, :, None])
    l = jnp.sum(scaled, axis=2)
    o = jnp.sum(o_part * scaled[..., None], axis=2) / l[..., None]  # [B, Hk, gp, K]
    out = o[:, :, :G].reshape(B, 1, H, K)
    lse = (m[:, :, :G] + jnp.log(l[:, :, :G])).reshape(B, 1, H)
    if query_weights is None:
        return out, lse, None

    head_kv = pl.BlockSpec((None, None, S, K), lambda b, h, j: (b, h, 0, 0))
    head_pos = pl.BlockSpec((None, None, S), lambda b, h, j: (b, h, 0))
    head_spec = pl.BlockSpec((None, None, gp, K), lambda b, h, j: (b, h, 0, 0))
    head_vec = pl.BlockSpec((None, None, gp), lambda b, h, j: (b, h, 0))
    col = pl.pallas_call(
        functools.partial(_scores_kernel, score=score, n_heads=G, n_slots=S, block_k=bk, scale=scale),
        grid=(B, Hk, nk),
        in_specs=[head_spec, head_kv, head_kv, head_pos, pl.BlockSpec((None, gp), lambda b, h, j: (b, 0)),
                  head_spec, head_vec, head_vec],
        out_specs=pl.BlockSpec((None, None, gp, bk), lambda b, h, j: (b, h, 0, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, gp, nk * bk), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="decode_attention_scores",
    )(rows, k, v, spos, qpos, o, m, l)
    return out, lse, col[:, :, :G, :S] * query_weights.astype(jnp.float32).reshape(B, 1, 1, 1)
