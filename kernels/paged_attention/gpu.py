"""Paged attention with eviction scores as Pallas Triton kernels: the passes of
``block_attention.gpu`` and ``decode_attention.gpu`` with the cache read through per-head page
tables.

A page is a key tile: Triton tiles must be powers of two (each ``tl.dot`` dimension ≥ 16), so P must
be a power of two ≥ 16 and each loop step loads one page, ``k_pages[b, page_table[b, h, j]]``
[P, K], through the table row of its (row, KV head) (loaded as scalars; the row's pool is passed
whole, a pointer, and only the pages named by used entries are loaded). Its slot positions are the
contiguous logical slice slot_pos[j·P : (j+1)·P]. Every slot of a used page is real, so no slot mask
is needed.

* block, pass 1, grid (B, Hk, G·query tiles): the online softmax loops over the head's n_pages pages
  (a ``fori_loop`` with the traced bound n_pages) and the unused pages' slots join the statistics at
  the end without being read (``reference.with_unread_slots``);
* block, pass 2, grid (B, Hk, G·M): one page's column of one query head per program, as
  ``block_attention.gpu``'s scores kernel (``gpu_common.column_scores``) with the page as key tile;
  a program whose page is unused reads nothing and writes zeros;
* decode, pass 1, grid (B, Hk, splits): flash-decoding over pages — split s takes the s-th run of
  ⌈n_pages / splits⌉ used pages (so a head's work is spread by its own page count), the partials are
  merged in XLA, unused slots added there;
* decode, pass 2, grid (B, Hk, M): one page's scores for the G query heads (rows padded to 16;
  ``gpu_common.head_scores``); not for "attn": pass 1 writes the G real rows' logits of the pages
  it reads and XLA forms exp(z − m) / l from them, so the keys are read once.

The wrapper sets the score columns of unused pages (``reference.fill_unused_pages``). Quantized
pools are loaded a page of codes and scales at a time and dequantized in registers
(``gpu_common.load_values``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels import gpu_common as common
from kvjax.kernels._shared import check_score, kv_spec, next_pow2, pad_axis, round_up
from kvjax.kernels.decode_attention.reference import check_decode
from kvjax.kernels.paged_attention.reference import (
    check_paged_shapes,
    fill_unused_pages,
    with_unread_slots,
)


def supports(head_dim: int, page_size: int) -> bool:
    """Whether the Triton paged kernels take this head dim and page size (both powers of two
    ≥ 16)."""
    pow2 = page_size >= common.MIN_DOT and page_size == next_pow2(page_size)
    return common.supports(head_dim) and pow2


def check_supported(head_dim: int, page_size: int) -> None:
    common.check_head_dim(head_dim)
    if not supports(head_dim, page_size):
        raise ValueError(f"page size {page_size} must be a power of two ≥ 16 for the Triton kernel")


def page_tile(table_ref, j, k_ref, v_ref, spos_ref, slot, page_size: int, dtype) -> common.KeyTile:
    """The ``KeyTile`` of the head's page j (every slot real; slot = arange(P)): its K, V [P, K]
    from the row's pool [N, P, K] (or ``Quantized`` pools, dequantized to ``dtype``; no V when v_ref
    is None), its positions [P] from the head's slot_pos [M·P]."""
    page = table_ref[j]

    def load(ref):
        return plgpu.load(ref.at[page])

    k = common.load_values(k_ref, dtype, load)
    spos = plgpu.load(spos_ref.at[pl.ds(j * page_size, page_size)])
    v = None if v_ref is None else common.load_values(v_ref, dtype, load)
    return common.KeyTile(k, spos, slot, page_size, v)


def _stats_kernel(
    table_ref,
    n_ref,
    q_ref,
    k_ref,
    v_ref,
    spos_ref,
    qpos_ref,
    o_ref,
    m_ref,
    l_ref,
    z_ref=None,
    *,
    page_size: int,
    n_table: int,
    scale: float,
    split_axis: int | None = None,
    z_rows: int = 0,
):
    """Online softmax of a tile of query rows over the head's used pages, then the unused pages'
    slots (o normalised, final m, l). With split_axis: over that grid axis' run of used pages only,
    writing the partial (o, m, l) — o = 0 and l = 0 for an empty run. Given z_ref [R, M·P], the
    masked logits of the first ``z_rows`` rows at each used page's slots (unused pages' left
    unwritten)."""
    n = n_ref[0]
    start, stop = 0, n
    if split_axis is not None:
        per_split = jax.lax.div(n + pl.num_programs(split_axis) - 1, pl.num_programs(split_axis))
        start = jnp.minimum(n, pl.program_id(split_axis) * per_split)
        stop = jnp.minimum(n, start + per_split)
    slot = jnp.arange(page_size, dtype=jnp.int32)

    def tiles(j):
        return page_tile(table_ref, j, k_ref, v_ref, spos_ref, slot, page_size, q_ref.dtype)

    def store(j, tile, logits):
        rows = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 0) < z_rows
        plgpu.store(z_ref.at[:, pl.ds(j * page_size, page_size)], logits, mask=rows)

    acc, m, l = common.online_softmax(
        q_ref[...], qpos_ref[...], tiles, start, stop, scale, None if z_ref is None else store
    )
    if split_axis is None:
        m, l, alpha = with_unread_slots(m, l, (n_table - n) * page_size)
        o_ref[...] = acc * (alpha / l)[:, None]
    else:
        o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]
    m_ref[...] = m
    l_ref[...] = l


def _block_scores_kernel(
    table_ref,
    n_ref,
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
    page_size: int,
    n_table: int,
    n_queries: int,
    block_q: int,
    scale: float,
):
    """The column of page j = program_id(2) mod M for one query head (``gpu_common.column_scores``,
    the page as key tile); zeros for an unused page, which is not read."""
    j = pl.program_id(2) % n_table
    used = j < n_ref[0]

    @pl.when(used)
    def _page():
        tile = page_tile(
            table_ref,
            j,
            k_ref,
            None if score == "attn" else v_ref,
            spos_ref,
            jnp.arange(page_size, dtype=jnp.int32),
            page_size,
            q_ref.dtype,
        )
        rows = common.QueryRefs(q_ref, qpos_ref, w_ref, o_ref, m_ref, l_ref)
        col_ref[...] = common.column_scores(
            score, tile, rows, n_queries=n_queries, block_q=block_q, scale=scale
        )

    @pl.when(~used)
    def _unused():
        col_ref[...] = jnp.zeros(col_ref.shape, jnp.float32)


def _decode_scores_kernel(
    table_ref,
    n_ref,
    q_ref,
    k_ref,
    v_ref,
    spos_ref,
    qpos_ref,
    o_ref,
    m_ref,
    l_ref,
    col_ref,
    *,
    score: str,
    n_heads: int,
    page_size: int,
    scale: float,
):
    """Unweighted scores of page j = program_id(2) for the Gp rows (query heads) of a KV head
    (``gpu_common.head_scores``); zeros for an unused page, which is not read."""
    j = pl.program_id(2)
    used = j < n_ref[0]

    @pl.when(used)
    def _page():
        tile = page_tile(
            table_ref,
            j,
            k_ref,
            None if score == "attn" else v_ref,
            spos_ref,
            jnp.arange(page_size, dtype=jnp.int32),
            page_size,
            q_ref.dtype,
        )
        rows = common.QueryRefs(q_ref, qpos_ref, None, o_ref, m_ref, l_ref)
        col_ref[...] = common.head_scores(score, tile, rows, n_heads=n_heads, scale=scale)

    @pl.when(~used)
    def _unused():
        col_ref[...] = jnp.zeros(col_ref.shape, jnp.float32)


def _paged_specs(k_pages, v_pages, M):
    """BlockSpecs of (table row [M], n_pages [1], K pool, V pool [N, P, K] — or ``Quantized`` ones
    —, slot positions [M·P]) of the program's (row, KV head), for a 3-axis grid."""
    _, N, P, K = k_pages.shape

    def pool(pages):
        return kv_spec(pages, (None, N, P, K), lambda b, h, x: (b, 0, 0, 0))

    return [
        pl.BlockSpec((None, None, M), lambda b, h, x: (b, h, 0)),
        pl.BlockSpec((None, None, 1), lambda b, h, x: (b, h, 0)),
        pool(k_pages),
        pool(v_pages),
        pl.BlockSpec((None, None, M * P), lambda b, h, x: (b, h, 0)),
    ]


def paged_block_attention_gpu(
    q,
    k_pages,
    v_pages,
    page_table,
    n_pages,
    slot_pos,
    query_pos,
    query_weights=None,
    score: str = "attn",
    *,
    block_q: int | None = None,
    interpret=False,
    num_warps: int | None = None,
    num_stages: int = 2,
):
    """Same contract as ``reference.paged_block_attention_with_scores``, as Pallas Triton kernels.
    block_q: a power of two ≥ 16 (capped at T rounded up so); the key tile is one page."""
    check_score(score)
    B, T, H, Hk, M, P, K = check_paged_shapes(
        q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights
    )
    G = H // Hk
    check_supported(K, P)
    bq = common.query_tile(T, block_q)
    Tp = round_up(T, bq)
    nq = Tp // bq
    scale = math.sqrt(K)
    params = plgpu.CompilerParams(
        num_warps=num_warps or (4 if K <= 64 else 8), num_stages=num_stages
    )

    rows, qpos = common.block_queries(q, query_pos, Hk, Tp)
    paged = [
        page_table.astype(jnp.int32),
        n_pages.astype(jnp.int32)[..., None],
        k_pages,
        v_pages,
        slot_pos.astype(jnp.int32),
    ]
    paged_specs = _paged_specs(k_pages, v_pages, M)

    tile_rows = pl.BlockSpec((None, None, None, bq, K), lambda b, h, x: (b, h, x // nq, x % nq, 0))
    tile_vec = pl.BlockSpec((None, None, None, bq), lambda b, h, x: (b, h, x // nq, x % nq))
    o, m, l = pl.pallas_call(
        functools.partial(_stats_kernel, page_size=P, n_table=M, scale=scale),
        grid=(B, Hk, G * nq),
        in_specs=paged_specs[:2]
        + [tile_rows]
        + paged_specs[2:]
        + [pl.BlockSpec((None, bq), lambda b, h, x: (b, x % nq))],
        out_specs=[tile_rows, tile_vec, tile_vec],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hk, G, Tp, K), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, G, Tp), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, G, Tp), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="paged_block_attention_stats",
    )(*paged[:2], rows, *paged[2:], qpos)

    out, lse = common.block_outputs(o, m, l, T, q.dtype)
    if query_weights is None:
        return out, lse, None

    w = pad_axis(query_weights.astype(jnp.float32), 1, Tp)
    all_rows = pl.BlockSpec((None, None, None, Tp, K), lambda b, h, x: (b, h, x // M, 0, 0))
    all_vec = pl.BlockSpec((None, None, None, Tp), lambda b, h, x: (b, h, x // M, 0))
    per_query = pl.BlockSpec((None, Tp), lambda b, h, x: (b, 0))
    col = pl.pallas_call(
        functools.partial(
            _block_scores_kernel,
            page_size=P,
            n_table=M,
            score=score,
            n_queries=T,
            block_q=bq,
            scale=scale,
        ),
        grid=(B, Hk, G * M),
        in_specs=paged_specs[:2]
        + [all_rows]
        + paged_specs[2:]
        + [per_query, per_query, all_rows, all_vec, all_vec],
        out_specs=pl.BlockSpec((None, None, None, P), lambda b, h, x: (b, h, x // M, x % M)),
        # a page's column per program
        out_shape=jax.ShapeDtypeStruct((B, Hk, G, M * P), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="paged_block_attention_scores",
    )(*paged[:2], rows, *paged[2:], qpos, w, o, m, l)
    return (
        out,
        lse,
        fill_unused_pages(col, n_pages, P, score, m[..., :T], l[..., :T], query_weights),
    )


def paged_decode_attention_gpu(
    q,
    k_pages,
    v_pages,
    page_table,
    n_pages,
    slot_pos,
    query_pos,
    query_weights=None,
    score: str = "attn",
    *,
    splits: int | None = None,
    interpret=False,
    num_warps: int | None = None,
    num_stages: int = 2,
):
    """(o [B, 1, H, K] float32 — uncorrected —, lse [B, 1, H], col [B, Hk, G, M·P] or None), as
    ``reference.paged_decode_attention_with_scores`` without moments. splits (default
    ``gpu_common.decode_splits`` over a head's M·P slots, at most M): the softmax pass' runs of
    pages per head."""
    check_score(score)
    check_decode(q)
    B, _, H, Hk, M, P, K = check_paged_shapes(
        q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights
    )
    G = H // Hk
    check_supported(K, P)
    rows, qpos, gp = common.decode_queries(q, query_pos, Hk)
    n_splits = min(common.decode_splits(B * Hk, M * P, splits), M)
    scale = math.sqrt(K)
    params = plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages)

    paged = [
        page_table.astype(jnp.int32),
        n_pages.astype(jnp.int32)[..., None],
        k_pages,
        v_pages,
        slot_pos.astype(jnp.int32),
    ]
    paged_specs = _paged_specs(k_pages, v_pages, M)
    head_spec = pl.BlockSpec((None, None, gp, K), lambda b, h, x: (b, h, 0, 0))
    row_qpos = pl.BlockSpec((None, gp), lambda b, h, x: (b, 0))
    # "attn" scores from the softmax pass's logits: no second read of the keys
    logits_out = query_weights is not None and score == "attn"
    z_spec = [pl.BlockSpec((None, None, gp, M * P), lambda b, h, s: (b, h, 0, 0))]
    z_shape = [jax.ShapeDtypeStruct((B, Hk, gp, M * P), jnp.float32)]
    o_part, m_part, l_part, *z = pl.pallas_call(
        functools.partial(
            _stats_kernel, page_size=P, n_table=M, scale=scale, split_axis=2, z_rows=G
        ),
        grid=(B, Hk, n_splits),
        in_specs=paged_specs[:2] + [head_spec] + paged_specs[2:] + [row_qpos],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, K), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
            *(z_spec if logits_out else []),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hk, n_splits, gp, K), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, n_splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, n_splits, gp), jnp.float32),
            *(z_shape if logits_out else []),
        ],
        compiler_params=params,
        interpret=interpret,
        name="paged_decode_attention_partial_softmax",
    )(*paged[:2], rows, *paged[2:], qpos)

    # Merge the splits (an empty one has m = -inf, l = 0): the final max (with the unused pages'
    # slots: finite even when nothing was read) and their share of l first, then each split's l
    # rescaled to that max.
    m, l, _ = with_unread_slots(jnp.max(m_part, axis=2), 0.0, ((M - n_pages) * P)[..., None])
    o, l = common.merge_splits(o_part, m_part, l_part, m, l)  # [B, Hk, gp, K], [B, Hk, gp]
    out, lse = common.decode_outputs(o, m, l, G)
    if query_weights is None:
        return out, lse, None
    weights = query_weights.astype(jnp.float32).reshape(B, 1, 1, 1)
    stats = m[:, :, :G, None], l[:, :, :G, None]
    if logits_out:  # A = exp(z − m) / l at the merged statistics; unused pages' slots filled below
        col = jnp.exp(z[0][:, :, :G] - stats[0]) / stats[1] * weights
        return out, lse, fill_unused_pages(col, n_pages, P, score, *stats, query_weights)

    col = pl.pallas_call(
        functools.partial(_decode_scores_kernel, score=score, n_heads=G, page_size=P, scale=scale),
        grid=(B, Hk, M),
        in_specs=paged_specs[:2]
        + [head_spec]
        + paged_specs[2:]
        + [
            row_qpos,
            head_spec,
            pl.BlockSpec((None, None, gp), lambda b, h, j: (b, h, 0)),
            pl.BlockSpec((None, None, gp), lambda b, h, j: (b, h, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, gp, P), lambda b, h, j: (b, h, 0, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hk, gp, M * P), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="paged_decode_attention_scores",
    )(*paged[:2], rows, *paged[2:], qpos, o, m, l)
    col = col[:, :, :G] * weights
    return out, lse, fill_unused_pages(col, n_pages, P, score, *stats, query_weights)
