"""Block attention with eviction scores as two Pallas GPU kernels on the Triton backend.

Why Triton and not Mosaic GPU: Pallas' Mosaic GPU backend targets Hopper and newer (sm_90a / Blackwell:
TMA copies, warpgroup-level ``wgmma`` with 64-row warpgroup tiles, explicit SMEM pipelining), while the
Triton backend lowers one program per grid cell to Triton IR that XLA compiles for any CUDA GPU from
Ampere on (and for ROCm), with power-of-two block shapes as its only shape rule. The shapes here are small
and irregular (G = 3 query heads per KV head in SmolLM2, a handful of scoring queries), which suits
Triton's per-program tiles better than 64-row warpgroup tiles; and jaxlib 0.10.2 lowers a Triton kernel
without a GPU present (it emits the ``__gpu$xla.gpu.triton`` custom call carrying Triton IR, compiled by
XLA on the device), so the lowering is checkable from a CPU machine.

Layout: rows [B, Hk, G, Tp, K] (Tp = T padded to the power-of-two query tile ``bq``, at least 16, the
minimum of ``tl.dot``); the cache is read in power-of-two key tiles ``bk`` straight from the [B, Hk, S, K]
arrays — never padded in HBM: tiles are loaded with ``plgpu.load`` masked by slot index, so slots past S
are not read and come back as zero keys/values with position -1.
Triton programs are independent (no sequential grid axis, no VMEM scratch), so each pass loops inside the
program instead of over a grid axis:

* pass 1, grid (B, Hk, G·q tiles): one query tile, a ``fori_loop`` over key tiles with the online-softmax
  statistics in registers; writes o [.., Tp, K] float32 and m, l [.., Tp];
* pass 2, grid (B, Hk, G·key tiles): one key tile's column, a loop over query tiles (skipped with a
  ``cond`` when all their weights are zero) — attn and obcache-value from the tile's [bq, bk] weights; the
  obcache-key/joint terms one scoring query at a time (``cond`` on w_t ≠ 0), from the differences
  v_s − o_t themselves ([bk, K] per query).

The Triton lowering has no ``slice`` of values, so rows are read from refs (``ref[t, :]``), never sliced
out of a loaded tile.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels._shared import (
    NEG_INF,
    NN_DIMS,
    NT_DIMS,
    check_score,
    check_shapes,
    next_pow2,
    pad_axis,
    round_up,
)

DEFAULT_BLOCK_K = 64
DEFAULT_BLOCK_Q = 64
MIN_DOT = 16  # tl.dot needs every dimension ≥ 16


def supports(head_dim: int) -> bool:
    """Whether the Triton kernels take this head dim (a power of two ≥ 16: a ``tl.dot`` dimension)."""
    return head_dim >= MIN_DOT and head_dim == next_pow2(head_dim)


def check_head_dim(head_dim: int) -> None:
    if not supports(head_dim):
        raise ValueError(f"head dim {head_dim} must be a power of two ≥ 16 for the Triton kernel")


def masked_logits(z, spos, qpos, slot, n_slots: int):
    """(logits, visible) with the reference's masking: invisible real slots -1e30, slots past ``n_slots``
    -inf. Either z [R, bk], spos/slot [1, bk], qpos [R, 1], or z/spos/slot [bk] and qpos a scalar."""
    real = slot < n_slots
    visible = real & (spos >= 0) & (spos <= qpos)
    return jnp.where(visible, z, jnp.where(real, jnp.float32(NEG_INF), -jnp.inf)), visible


def load_tile(ref, start, size: int, n_slots: int, other=0):
    """Slots start .. start + size − 1 of a whole-head ref ([S, K] or [S]); slots past ``n_slots`` are not
    read (masked load) and come back as ``other``: the cache is never padded in HBM."""
    slot = start + jnp.arange(size, dtype=jnp.int32)
    mask = slot < n_slots
    if len(ref.shape) == 2:
        return plgpu.load(ref.at[pl.ds(start, size), :], mask=mask[:, None], other=other)
    return plgpu.load(ref.at[pl.ds(start, size)], mask=mask, other=other)


def _dot(a, b, dims):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _stats_kernel(q_ref, k_ref, v_ref, spos_ref, qpos_ref, o_ref, m_ref, l_ref, *, n_slots: int, block_k: int,
                  n_tiles: int, scale: float, split_axis: int | None = None):
    """Online softmax of a tile of query rows over ``n_tiles`` key tiles of the whole-head refs k_ref,
    v_ref [S, K] and spos_ref [S]: from slot 0, or — with split_axis — from the split chosen by that grid
    axis (n_tiles tiles per split; every split must start with a real slot)."""
    q = q_ref[...]  # [bq, K]
    qpos = qpos_ref[...]
    bq, head_dim = q.shape
    offset = 0 if split_axis is None else pl.program_id(split_axis) * (n_tiles * block_k)

    def body(j, carry):
        acc, m, l = carry
        start = offset + j * block_k
        k = load_tile(k_ref, start, block_k, n_slots).astype(q.dtype)
        v = load_tile(v_ref, start, block_k, n_slots)
        slot = start + jnp.arange(block_k, dtype=jnp.int32)
        spos = load_tile(spos_ref, start, block_k, n_slots, -1)
        logits, _ = masked_logits(_dot(q, k, NT_DIMS) / scale, spos[None, :],
                                  qpos[:, None], slot[None, :], n_slots)
        m_next = jnp.maximum(m, jnp.max(logits, axis=1))  # finite from tile 0 on (its first slot is real)
        p = jnp.exp(logits - m_next[:, None])
        alpha = jnp.exp(m - m_next)
        return (alpha[:, None] * acc + _dot(p.astype(v.dtype), v, NN_DIMS), m_next,
                alpha * l + jnp.sum(p, axis=1))

    init = (jnp.zeros((bq, head_dim), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_tiles, body, init)
    o_ref[...] = acc / l[:, None]
    m_ref[...] = m
    l_ref[...] = l


def _scores_kernel(q_ref, k_ref, v_ref, spos_ref, qpos_ref, w_ref, o_ref, m_ref, l_ref, col_ref, *, score: str,
                   n_slots: int, n_queries: int, block_q: int, block_k: int, scale: float, n_k_tiles: int):
    bk = block_k
    first = (pl.program_id(2) % n_k_tiles) * bk
    k = load_tile(k_ref, first, bk, n_slots)
    spos = load_tile(spos_ref, first, bk, n_slots, -1)
    slot = first + jnp.arange(bk, dtype=jnp.int32)
    vf = load_tile(v_ref, first, bk, n_slots).astype(jnp.float32) if score != "attn" else None
    v_sq = jnp.sum(vf * vf, axis=1) if score in ("obcache-value", "obcache-joint") else None

    if score in ("attn", "obcache-value"):
        def tile(i, col):
            start = pl.multiple_of(i * block_q, block_q)
            w = w_ref[pl.ds(start, block_q)]

            def compute():
                q = q_ref[pl.ds(start, block_q), :]
                logits, _ = masked_logits(_dot(q, k.astype(q.dtype), NT_DIMS) / scale, spos[None, :],
                                          qpos_ref[pl.ds(start, block_q)][:, None], slot[None, :], n_slots)
                a = jnp.exp(logits - m_ref[pl.ds(start, block_q)][:, None]) / l_ref[pl.ds(start, block_q)][:, None]
                wa = w[:, None] * a
                if score == "attn":
                    return col + jnp.sum(wa, axis=0)
                return col + jnp.sum(wa * a, axis=0) * v_sq

            return jax.lax.cond(jnp.max(jnp.abs(w)) > 0, compute, lambda: col)

        n_q_tiles = q_ref.shape[0] // block_q
        col_ref[...] = jax.lax.fori_loop(0, n_q_tiles, tile, jnp.zeros((bk,), jnp.float32))
        return

    kf = k.astype(jnp.float32)

    def row(t, col):
        w_t = w_ref[t]

        def compute():
            z = jnp.sum(q_ref[t, :].astype(jnp.float32)[None, :] * kf, axis=1) / scale  # [bk]
            logits, visible = masked_logits(z, spos, qpos_ref[t], slot, n_slots)
            a = jnp.exp(logits - m_ref[t]) / l_ref[t]
            z0 = jnp.where(visible, z, 0.0)
            a2 = w_t * a * a
            diff = vf - o_ref[t, :][None, :]  # v_s − o_t, formed explicitly
            total = a2 * z0 * z0 * jnp.sum(diff * diff, axis=1)
            if score == "obcache-joint":
                total = total + a2 * v_sq + 2.0 * a2 * z0 * jnp.sum(vf * diff, axis=1)
            return col + total

        return jax.lax.cond(w_t != 0, compute, lambda: col)

    col_ref[...] = jax.lax.fori_loop(0, n_queries, row, jnp.zeros((bk,), jnp.float32))


def block_attention_gpu(q, k, v, slot_pos, query_pos, query_weights=None, score: str = "attn", *,
                        block_k: int | None = None, block_q: int | None = None, interpret=False,
                        num_warps: int | None = None, num_stages: int = 2):
    """Same contract as ``reference.block_attention_with_scores``, as Pallas Triton kernels.

    block_k / block_q are rounded up to powers of two ≥ 16 (block_q is capped at T rounded up that way).
    interpret: run with the Pallas interpreter (any backend); otherwise they only lower for CUDA/ROCm.
    """
    check_score(score)
    B, T, H, Hk, S, K = check_shapes(q, k, v, slot_pos, query_pos, query_weights)
    G = H // Hk
    check_head_dim(K)
    bk = max(MIN_DOT, next_pow2(block_k or DEFAULT_BLOCK_K))
    bq = min(max(MIN_DOT, next_pow2(block_q or DEFAULT_BLOCK_Q)), max(MIN_DOT, next_pow2(T)))
    Tp = round_up(T, bq)
    nq, nk = Tp // bq, -(-S // bk)  # the last key tile may run past S: masked loads, no padded copy
    scale = math.sqrt(K)
    params = plgpu.CompilerParams(num_warps=num_warps or (4 if K <= 64 else 8), num_stages=num_stages)

    rows = pad_axis(jnp.transpose(q.reshape(B, T, Hk, G, K), (0, 2, 3, 1, 4)), 3, Tp)  # [B, Hk, G, Tp, K]
    spos = slot_pos.astype(jnp.int32)
    qpos = pad_axis(query_pos.astype(jnp.int32), 1, Tp, -1)

    head_kv = pl.BlockSpec((None, None, S, K), lambda b, h, x: (b, h, 0, 0))  # whole head: tiles loaded inside
    head_pos = pl.BlockSpec((None, None, S), lambda b, h, x: (b, h, 0))
    tile_rows = pl.BlockSpec((None, None, None, bq, K), lambda b, h, x: (b, h, x // nq, x % nq, 0))
    tile_vec = pl.BlockSpec((None, None, None, bq), lambda b, h, x: (b, h, x // nq, x % nq))
    o, m, l = pl.pallas_call(
        functools.partial(_stats_kernel, n_slots=S, block_k=bk, n_tiles=nk, scale=scale),
        grid=(B, Hk, G * nq),
        in_specs=[tile_rows, head_kv, head_kv, head_pos, pl.BlockSpec((None, bq), lambda b, h, x: (b, x % nq))],
        out_specs=[tile_rows, tile_vec, tile_vec],
        out_shape=[jax.ShapeDtypeStruct((B, Hk, G, Tp, K), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, G, Tp), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, G, Tp), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="block_attention_stats",
    )(rows, k, v, spos, qpos)

    out = jnp.transpose(o[:, :, :, :T], (0, 3, 1, 2, 4)).reshape(B, T, H, K).astype(q.dtype)
    lse = jnp.transpose(m[..., :T] + jnp.log(l[..., :T]), (0, 3, 1, 2)).reshape(B, T, H)
    if query_weights is None:
        return out, lse, None

    w = pad_axis(query_weights.astype(jnp.float32), 1, Tp)
    all_rows = pl.BlockSpec((None, None, None, Tp, K), lambda b, h, x: (b, h, x // nk, 0, 0))
    all_vec = pl.BlockSpec((None, None, None, Tp), lambda b, h, x: (b, h, x // nk, 0))
    per_query = pl.BlockSpec((None, Tp), lambda b, h, x: (b, 0))
    col = pl.pallas_call(
        functools.partial(_scores_kernel, score=score, n_slots=S, n_queries=T, block_q=bq, block_k=bk,
                          scale=scale, n_k_tiles=nk),
        grid=(B, Hk, G * nk),
        in_specs=[all_rows, head_kv, head_kv, head_pos, per_query, per_query, all_rows, all_vec, all_vec],
        out_specs=pl.BlockSpec((None, None, None, bk), lambda b, h, x: (b, h, x // nk, x % nk)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, G, nk * bk), jnp.float32),  # a column tile per program
        compiler_params=params,
        interpret=interpret,
        name="block_attention_scores",
    )(rows, k, v, spos, qpos, w, o, m, l)
    return out, lse, col[..., :S]
