"""Paged attention with eviction scores as Pallas Triton kernels: the passes of ``block_attention.gpu`` and
``decode_attention.gpu`` with the cache read through per-head page tables.

A page is a key tile: Triton tiles must be powers of two (each ``tl.dot`` dimension ≥ 16), so P must be a
power of two ≥ 16 and each loop step loads one page, ``k_pages[b, page_table[b, h, j]]`` [P, K], through
the table row of its (row, KV head) (loaded as scalars; the row's pool is passed whole, a pointer, and only
the pages named by used entries are loaded). Its slot positions are the contiguous logical slice
slot_pos[j·P : (j+1)·P]. Every slot of a used page is real, so no slot mask is needed.

* block, pass 1, grid (B, Hk, G·query tiles): the online softmax loops over the head's n_pages pages (a
  ``fori_loop`` with the traced bound n_pages) and the unused pages' slots join the statistics at the end
  without being read (``reference.with_unread_slots``);
* block, pass 2, grid (B, Hk, G·M): one page's column of one query head per program, as
  ``block_attention.gpu``'s scores kernel with the page as key tile; a program whose page is unused
  reads nothing and writes zeros;
* decode, pass 1, grid (B, Hk, splits): flash-decoding over pages — split s takes the s-th run of
  ⌈n_pages / splits⌉ used pages (so a head's work is spread by its own page count), the partials are
  merged in XLA, unused slots added there;
* decode, pass 2, grid (B, Hk, M): one page's scores for the G query heads (rows padded to 16).

The wrapper sets the score columns of unused pages (``reference.fill_unused_pages``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels._shared import NN_DIMS, NT_DIMS, check_score, next_pow2, pad_axis, round_up
from kvjax.kernels.block_attention import gpu as block_gpu
from kvjax.kernels.block_attention.gpu import DEFAULT_BLOCK_Q, MIN_DOT, masked_logits
from kvjax.kernels.decode_attention.gpu import MAX_SPLITS
from kvjax.kernels.decode_attention.reference import check_decode
from kvjax.kernels.paged_attention.reference import check_paged_shapes, fill_unused_pages, with_unread_slots


def supports(head_dim: int, page_size: int) -> bool:
    """Whether the Triton paged kernels take this head dim and page size (both powers of two ≥ 16)."""
    return block_gpu.supports(head_dim) and page_size >= MIN_DOT and page_size == next_pow2(page_size)


def check_supported(head_dim: int, page_size: int) -> None:
    block_gpu.check_head_dim(head_dim)
    if not supports(head_dim, page_size):
        raise ValueError(f"page size {page_size} must be a power of two ≥ 16 for the Triton kernel")


def _dot(a, b, dims):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def page_refs(table_ref, j, k_ref, v_ref, spos_ref, page_size: int):
    """Refs of the head's page j: its K and V [P, K] in the row's pool [N, P, K], its positions [P]."""
    page = table_ref[j]
    return k_ref.at[page], v_ref.at[page], spos_ref.at[pl.ds(j * page_size, page_size)]


def _stats_kernel(table_ref, n_ref, q_ref, k_ref, v_ref, spos_ref, qpos_ref, o_ref, m_ref, l_ref, *,
                  page_size: int, n_table: int, scale: float, split_axis: int | None = None):
    """Online softmax of a tile of query rows over the head's used pages, then the unused pages' slots
    (o normalised, final m, l). With split_axis: over that grid axis' run of used pages only, writing the
    partial (o, m, l) — o = 0 and l = 0 for an empty run."""
    q = q_ref[...]  # [bq, K]
    qpos = qpos_ref[...]
    n = n_ref[0]
    start, stop = 0, n
    if split_axis is not None:
        per_split = jax.lax.div(n + pl.num_programs(split_axis) - 1, pl.num_programs(split_axis))
        start = jnp.minimum(n, pl.program_id(split_axis) * per_split)
        stop = jnp.minimum(n, start + per_split)
    slot = jnp.arange(page_size, dtype=jnp.int32)

    def body(j, carry):
        acc, m, l = carry
        k_page, v_page, spos_page = page_refs(table_ref, j, k_ref, v_ref, spos_ref, page_size)
        k = plgpu.load(k_page).astype(q.dtype)
        v = plgpu.load(v_page)
        logits, _ = masked_logits(_dot(q, k, NT_DIMS) / scale, plgpu.load(spos_page)[None, :], qpos[:, None],
                                  slot[None, :], page_size)
        m_next = jnp.maximum(m, jnp.max(logits, axis=1))  # finite: every slot of a used page is real
        p = jnp.exp(logits - m_next[:, None])
        alpha = jnp.exp(m - m_next)
        return alpha[:, None] * acc + _dot(p.astype(v.dtype), v, NN_DIMS), m_next, alpha * l + jnp.sum(p, axis=1)

    bq, head_dim = q.shape
    init = (jnp.zeros((bq, head_dim), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(start, stop, body, init)
    if split_axis is None:
        m, l, alpha = with_unread_slots(m, l, (n_table - n) * page_size)
        o_ref[...] = acc * (alpha / l)[:, None]
    else:
        o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]
    m_ref[...] = m
    l_ref[...] = l


def _block_scores_kernel(table_ref, n_ref, q_ref, k_ref, v_ref, spos_ref, qpos_ref, w_ref, o_ref, m_ref, l_ref,
                         col_ref, *, score: str, page_size: int, n_table: int, n_queries: int, block_q: int,
                         scale: float):
    """The column of page j = program_id(2) mod M (its key tile) for one query head — ``block_attention.gpu``'s
    scores kernel on a page: attn and obcache-value from [bq, P] weight tiles (query tiles without weight
    skipped), the key terms one scoring query at a time. Zeros for an unused page, which is not read."""
    j = pl.program_id(2) % n_table
    used = j < n_ref[0]

    @pl.when(used)
    def _page():
        k_page, v_page, spos_page = page_refs(table_ref, j, k_ref, v_ref, spos_ref, page_size)
        k = plgpu.load(k_page)
        spos = plgpu.load(spos_page)
        slot = jnp.arange(page_size, dtype=jnp.int32)
        vf = plgpu.load(v_page).astype(jnp.float32) if score != "attn" else None
        v_sq = jnp.sum(vf * vf, axis=1) if score in ("obcache-value", "obcache-joint") else None

        if score in ("attn", "obcache-value"):
            def tile(i, col):
                start = pl.multiple_of(i * block_q, block_q)
                w = w_ref[pl.ds(start, block_q)]

                def compute():
                    q = q_ref[pl.ds(start, block_q), :]
                    logits, _ = masked_logits(_dot(q, k.astype(q.dtype), NT_DIMS) / scale, spos[None, :],
                                              qpos_ref[pl.ds(start, block_q)][:, None], slot[None, :], page_size)
                    a = (jnp.exp(logits - m_ref[pl.ds(start, block_q)][:, None])
                         / l_ref[pl.ds(start, block_q)][:, None])
                    wa = w[:, None] * a
                    if score == "attn":
                        return col + jnp.sum(wa, axis=0)
                    return col + jnp.sum(wa * a, axis=0) * v_sq

                return jax.lax.cond(jnp.max(jnp.abs(w)) > 0, compute, lambda: col)

            col_ref[...] = jax.lax.fori_loop(0, q_ref.shape[0] // block_q, tile,
                                             jnp.zeros((page_size,), jnp.float32))
            return

        kf = k.astype(jnp.float32)

        def row(t, col):
            w_t = w_ref[t]

            def compute():
                z = jnp.sum(q_ref[t, :].astype(jnp.float32)[None, :] * kf, axis=1) / scale  # [P]
                logits, visible = masked_logits(z, spos, qpos_ref[t], slot, page_size)
                a = jnp.exp(logits - m_ref[t]) / l_ref[t]
                z0 = jnp.where(visible, z, 0.0)
                a2 = w_t * a * a
                diff = vf - o_ref[t, :][None, :]  # v_s − o_t, formed explicitly
                total = a2 * z0 * z0 * jnp.sum(diff * diff, axis=1)
                if score == "obcache-joint":
                    total = total + a2 * v_sq + 2.0 * a2 * z0 * jnp.sum(vf * diff, axis=1)
                return col + total

            return jax.lax.cond(w_t != 0, compute, lambda: col)

        col_ref[...] = jax.lax.fori_loop(0, n_queries, row, jnp.zeros((page_size,), jnp.float32))

    @pl.when(~used)
    def _unused():
        col_ref[...] = jnp.zeros(col_ref.shape, jnp.float32)


def _decode_scores_kernel(table_ref, n_ref, q_ref, k_ref, v_ref, spos_ref, qpos_ref, o_ref, m_ref, l_ref, col_ref,
                          *, score: str, n_heads: int, page_size: int, scale: float):
    """Unweighted scores of page j = program_id(2) for the Gp rows (query heads) of a KV head, as
    ``decode_attention.gpu``'s scores kernel; zeros for an unused page, which is not read."""
    j = pl.program_id(2)
    used = j < n_ref[0]

    @pl.when(used)
    def _page():
        k_page, v_page, spos_page = page_refs(table_ref, j, k_ref, v_ref, spos_ref, page_size)
        q = q_ref[...]  # [Gp, K]
        slot = jnp.arange(page_size, dtype=jnp.int32)
        z = _dot(q, plgpu.load(k_page).astype(q.dtype), NT_DIMS) / scale  # [Gp, P]
        logits, visible = masked_logits(z, plgpu.load(spos_page)[None, :], qpos_ref[...][:, None],
                                        slot[None, :], page_size)
        a = jnp.exp(logits - m_ref[...][:, None]) / l_ref[...][:, None]
        if score == "attn":
            col_ref[...] = a
            return
        vf = plgpu.load(v_page).astype(jnp.float32)
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

    @pl.when(~used)
    def _unused():
        col_ref[...] = jnp.zeros(col_ref.shape, jnp.float32)


def _paged_specs(N, M, P, K):
    """BlockSpecs of (table row [M], n_pages [1], K pool, V pool [N, P, K], slot positions [M·P]) of the
    program's (row, KV head), for a 3-axis grid."""
    pool = pl.BlockSpec((None, N, P, K), lambda b, h, x: (b, 0, 0, 0))
    return [pl.BlockSpec((None, None, M), lambda b, h, x: (b, h, 0)),
            pl.BlockSpec((None, None, 1), lambda b, h, x: (b, h, 0)), pool, pool,
            pl.BlockSpec((None, None, M * P), lambda b, h, x: (b, h, 0))]


def paged_block_attention_gpu(q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights=None,
                              score: str = "attn", *, block_q: int | None = None, interpret=False,
                              num_warps: int | None = None, num_stages: int = 2):
    """Same contract as ``reference.paged_block_attention_with_scores``, as Pallas Triton kernels. block_q:
    a power of two ≥ 16 (capped at T rounded up so); the key tile is one page."""
    check_score(score)
    B, T, H, Hk, M, P, K = check_paged_shapes(q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos,
                                              query_weights)
    G = H // Hk
    check_supported(K, P)
    bq = min(max(MIN_DOT, next_pow2(block_q or DEFAULT_BLOCK_Q)), max(MIN_DOT, next_pow2(T)))
    Tp = round_up(T, bq)
    nq = Tp // bq
    scale = math.sqrt(K)
    params = plgpu.CompilerParams(num_warps=num_warps or (4 if K <= 64 else 8), num_stages=num_stages)

    rows = pad_axis(jnp.transpose(q.reshape(B, T, Hk, G, K), (0, 2, 3, 1, 4)), 3, Tp)  # [B, Hk, G, Tp, K]
    qpos = pad_axis(query_pos.astype(jnp.int32), 1, Tp, -1)
    paged = [page_table.astype(jnp.int32), n_pages.astype(jnp.int32)[..., None], k_pages, v_pages,
             slot_pos.astype(jnp.int32)]
    paged_specs = _paged_specs(k_pages.shape[1], M, P, K)

    tile_rows = pl.BlockSpec((None, None, None, bq, K), lambda b, h, x: (b, h, x // nq, x % nq, 0))
    tile_vec = pl.BlockSpec((None, None, None, bq), lambda b, h, x: (b, h, x // nq, x % nq))
    o, m, l = pl.pallas_call(
        functools.partial(_stats_kernel, page_size=P, n_table=M, scale=scale),
        grid=(B, Hk, G * nq),
        in_specs=paged_specs[:2] + [tile_rows] + paged_specs[2:]
        + [pl.BlockSpec((None, bq), lambda b, h, x: (b, x % nq))],
        out_specs=[tile_rows, tile_vec, tile_vec],
        out_shape=[jax.ShapeDtypeStruct((B, Hk, G, Tp, K), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, G, Tp), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, G, Tp), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="paged_block_attention_stats",
    )(*paged[:2], rows, *paged[2:], qpos)

    out = jnp.transpose(o[:, :, :, :T], (0, 3, 1, 2, 4)).reshape(B, T, H, K).astype(q.dtype)
    lse = jnp.transpose(m[..., :T] + jnp.log(l[..., :T]), (0, 3, 1, 2)).reshape(B, T, H)
    if query_weights is None:
        return out, lse, None

    w = pad_axis(query_weights.astype(jnp.float32), 1, Tp)
    all_rows = pl.BlockSpec((None, None, None, Tp, K), lambda b, h, x: (b, h, x // M, 0, 0))
    all_vec = pl.BlockSpec((None, None, None, Tp), lambda b, h, x: (b, h, x // M, 0))
    per_query = pl.BlockSpec((None, Tp), lambda b, h, x: (b, 0))
    col = pl.pallas_call(
        functools.partial(_block_scores_kernel, page_size=P, n_table=M, score=score, n_queries=T, block_q=bq,
                          scale=scale),
        grid=(B, Hk, G * M),
        in_specs=paged_specs[:2] + [all_rows] + paged_specs[2:] + [per_query, per_query, all_rows, all_vec, all_vec],
        out_specs=pl.BlockSpec((None, None, None, P), lambda b, h, x: (b, h, x // M, x % M)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, G, M * P), jnp.float32),  # a page's column per program
        compiler_params=params,
        interpret=interpret,
        name="paged_block_attention_scores",
    )(*paged[:2], rows, *paged[2:], qpos, w, o, m, l)
    return out, lse, fill_unused_pages(col, n_pages, P, score, m[..., :T], l[..., :T], query_weights)


def paged_decode_attention_gpu(q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights=None,
                               score: str = "attn", *, splits: int | None = None, interpret=False,
                               num_warps: int | None = None, num_stages: int = 2):
    """(o [B, 1, H, K] float32 — uncorrected —, lse [B, 1, H], col [B, Hk, G, M·P] or None), as
    ``reference.paged_decode_attention_with_scores`` without moments. splits (default: up to 8, at most
    M): the softmax pass' runs of pages per head."""
    check_score(score)
    check_decode(q)
    B, _, H, Hk, M, P, K = check_paged_shapes(q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos,
                                              query_weights)
    G = H // Hk
    check_supported(K, P)
    gp = max(MIN_DOT, next_pow2(G))
    n_splits = min(splits or MAX_SPLITS, M)
    scale = math.sqrt(K)
    params = plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages)

    rows = pad_axis(q.reshape(B, Hk, G, K), 2, gp)
    qpos = jnp.broadcast_to(query_pos.astype(jnp.int32).reshape(B, 1), (B, gp))
    paged = [page_table.astype(jnp.int32), n_pages.astype(jnp.int32)[..., None], k_pages, v_pages,
             slot_pos.astype(jnp.int32)]
    paged_specs = _paged_specs(k_pages.shape[1], M, P, K)
    head_spec = pl.BlockSpec((None, None, gp, K), lambda b, h, x: (b, h, 0, 0))
    row_qpos = pl.BlockSpec((None, gp), lambda b, h, x: (b, 0))
    o_part, m_part, l_part = pl.pallas_call(
        functools.partial(_stats_kernel, page_size=P, n_table=M, scale=scale, split_axis=2),
        grid=(B, Hk, n_splits),
        in_specs=paged_specs[:2] + [head_spec] + paged_specs[2:] + [row_qpos],
        out_specs=[pl.BlockSpec((None, None, None, gp, K), lambda b, h, s: (b, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Hk, n_splits, gp, K), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, n_splits, gp), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, n_splits, gp), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="paged_decode_attention_partial_softmax",
    )(*paged[:2], rows, *paged[2:], qpos)

    # Merge the splits (an empty one has m = -inf, l = 0): the final max (with the unused pages' slots: finite
    # even when nothing was read) and their share of l first, then each split's l rescaled to that max.
    m, l, _ = with_unread_slots(jnp.max(m_part, axis=2), 0.0, ((M - n_pages) * P)[..., None])
    scaled = l_part * jnp.exp(m_part - m[:, :, None])
    l = l + jnp.sum(scaled, axis=2)
    o = jnp.sum(o_part * scaled[..., None], axis=2) / l[..., None]  # [B, Hk, gp, K]
    out = o[:, :, :G].reshape(B, 1, H, K)
    lse = (m[:, :, :G] + jnp.log(l[:, :, :G])).reshape(B, 1, H)
    if query_weights is None:
        return out, lse, None

    col = pl.pallas_call(
        functools.partial(_decode_scores_kernel, score=score, n_heads=G, page_size=P, scale=scale),
        grid=(B, Hk, M),
        in_specs=paged_specs[:2] + [head_spec] + paged_specs[2:]
        + [row_qpos, head_spec, pl.BlockSpec((None, None, gp), lambda b, h, j: (b, h, 0)),
           pl.BlockSpec((None, None, gp), lambda b, h, j: (b, h, 0))],
        out_specs=pl.BlockSpec((None, None, gp, P), lambda b, h, j: (b, h, 0, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, gp, M * P), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="paged_decode_attention_scores",
    )(*paged[:2], rows, *paged[2:], qpos, o, m, l)
    col = col[:, :, :G] * query_weights.astype(jnp.float32).reshape(B, 1, 1, 1)
    return out, lse, fill_unused_pages(col, n_pages, P, score, m[:, :, :G, None], l[:, :, :G, None], query_weights)
