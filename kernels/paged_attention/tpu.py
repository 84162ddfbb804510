"""Paged attention with eviction scores as Pallas Mosaic-TPU kernels: the passes of
``block_attention.tpu`` and the two-phase call of ``decode_attention.tpu``, with the cache read
through per-head page tables.

What is read. The page tables (flattened [B·Hk·M]) and the page counts [B·Hk] are scalar-prefetched
into SMEM; the page pools stay in HBM (``memory_space=pl.ANY``) and each kernel DMAs pages itself: a
key block of ``bk`` logical slots (``pages_per_block`` = bk / P pages; bk a multiple of 128 lanes,
or all M·P slots when fewer) is copied page by page into a VMEM buffer [bk, K] at row offset i·P,
and only the pages below n_pages are copied — a page past it is never read, whatever its table entry
names. Each pass reads each used page once per row tile (the block softmax pass: once per KV head at
SmolLM2's and Llama-8B's geometry, where all rows share one tile), the scores pass and each decode
phase read it once.

Pipelining. The buffers are doubled: the step of key block j starts the copies of block j + 1 into
the other buffer before waiting for its own, so a block's DMAs overlap the previous block's compute.
The chain runs along the sequential (``ARBITRARY``) key-block axis of one (row, KV head[, row tile])
and restarts at its first block, which is fetched on the spot; the (row, KV head) axes stay
``PARALLEL`` (megacore), so nothing is prefetched across them. Steps past the head's last used block
do nothing: their slot-position and column blocks keep the index of the last used block (index maps
clamped through the prefetched n_pages), so the pipeline issues no DMA for them, and no page copy is
started.

Masking. In a used block, the slots of pages past n_pages (the buffer rows the DMA skipped: stale
data, possibly NaN) are out of the softmax (logit -inf, value rows zeroed) exactly like the ragged
last tile of the dense kernels; their count joins the softmax statistics at the end
(``reference.with_unread_slots``: logit NEG_INF, value 0 — what the reference computes from the
gathered zeros). The score columns of unused pages are never computed here; the wrapper sets them
(``reference.fill_unused_pages``).

Quantized pools: the pages' codes and scales are DMA'd alike into buffers [2, bk, K] (int4: K/2
bytes) and [2, bk, 1] and dequantized in VMEM (``tpu_common.load``).

Page-size rule: P ∈ {16, 32, 64} or a multiple of 128. P a multiple of 16 keeps each page's rows on
whole sublane tiles of the buffer for both float32 (8 rows a tile) and bfloat16 (16) — a DMA into an
aligned slice, no relayout — and P dividing 128 (or a multiple of it) makes the key block a whole
number of pages and of 128-lane tiles. Quantized pools: P ∈ {32, 64} or a multiple of 128, by the
same rule for 8-bit codes (32 rows a tile). Head dims as the dense kernels (≤ 128 or a multiple of
128).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kvjax.kernels import tpu_common as common
from kvjax.kernels._shared import KEY_KINDS, check_score, kv_at, kv_leaves, round_up
from kvjax.kernels.decode_attention.reference import check_decode
from kvjax.kernels.paged_attention.reference import (
    check_paged_shapes,
    fill_unused_pages,
    with_unread_slots,
)
from kvjax.kernels.quantized import Quantized, kind_of

PAGE_ALIGN = 16  # rows of a bfloat16 sublane tile (float32 needs 8)
CODE_PAGE_ALIGN = 32  # rows of an 8-bit sublane tile: pages of quantized codes


def supports(head_dim: int, page_size: int, kind: str | None = None) -> bool:
    """Whether the Mosaic-TPU paged kernels take this head dim and page size, for pools of
    ``kind`` (None: arrays; see the module docstring)."""
    lanes = common.LANES
    align = PAGE_ALIGN if kind is None else CODE_PAGE_ALIGN
    fits = page_size % align == 0 and (lanes % page_size == 0 or page_size % lanes == 0)
    return common.supports(head_dim) and fits


def check_supported(head_dim: int, page_size: int, kind: str | None = None) -> None:
    common.check_head_dim(head_dim)
    if not supports(head_dim, page_size, kind):
        sizes = "16, 32, 64" if kind is None else f"32, 64 (pools of {kind} codes)"
        raise ValueError(
            f"page size {page_size} must be {sizes} or a multiple of 128 for the TPU kernel"
        )


def page_buffers(k_pages, v_pages, bk: int, head_dim: int) -> list:
    """VMEM scratch of the paged kernels: double buffers [2, bk, K] for K and V (for ``Quantized``
    pools, of codes [2, bk, K or K/2] and scales [2, bk, 1]) and their DMA semaphores [2]."""

    def buffer(pages):
        if isinstance(pages, Quantized):
            return dataclasses.replace(
                pages,
                data=pltpu.VMEM((2, bk, pages.data.shape[-1]), pages.data.dtype),
                scale=pltpu.VMEM((2, bk, 1), pages.scale.dtype),
            )
        return pltpu.VMEM((2, bk, head_dim), pages.dtype)

    return [buffer(k_pages), buffer(v_pages), pltpu.SemaphoreType.DMA((2,))]


def key_blocks(n_table: int, page_size: int, block_k: int | None) -> tuple[int, int, int]:
    """(bk, pages_per_block, n_blocks): block_k rounded up to whole pages and 128-lane tiles, at
    most the M·P logical slots rounded so (the last block may run past them); all M·P slots when
    fewer than 128."""
    slots, unit = n_table * page_size, max(page_size, common.LANES)
    bk = min(round_up(block_k or common.DEFAULT_BLOCK_K, unit), round_up(slots, unit))
    bk = slots if slots < common.LANES else bk
    return bk, bk // page_size, -(-slots // bk)


class HeadPages:
    """The used pages of one (row, KV head), DMA'd a key block at a time into double buffers
    [2, bk, K].

    ``pools``: (HBM pool ref [B, N, P, K], VMEM buffer, DMA semaphores [2]) per array to copy
    (K, V; a ``Quantized`` pool and buffer copy codes and scales alike). start / wait issue / await
    the copies of the pages of key block ``block`` into buffer ``slot`` (when ``when`` holds),
    skipping the pages ≥ n_pages; the copies into a buffer share its semaphore.
    """

    def __init__(
        self,
        table_ref,
        n_ref,
        b,
        h,
        *,
        n_heads: int,
        n_table: int,
        page_size: int,
        pages_per_block: int,
    ):
        head = b * n_heads + h
        self.b, self.table_ref, self.first_entry = b, table_ref, head * n_table
        self.page_size, self.pages_per_block = page_size, pages_per_block
        self.n = n_ref[head]
        self.n_slots = self.n * page_size  # logical slots of the used pages
        self.n_unread = (n_table - self.n) * page_size
        # key blocks with a used page
        self.n_blocks = jax.lax.div(self.n + pages_per_block - 1, pages_per_block)

    def _copy(self, i: int, index, slot, pools, action: str):
        """Start or wait for the copy of table entry ``index`` into rows i·P .. (i+1)·P − 1 of
        buffer ``slot``."""
        page = self.table_ref[self.first_entry + index]
        for pool, buf, sems in pools:
            for pool_leaf, buf_leaf in zip(kv_leaves(pool), kv_leaves(buf), strict=True):
                rows = buf_leaf.at[slot, pl.ds(i * self.page_size, self.page_size)]
                copy = pltpu.make_async_copy(pool_leaf.at[self.b, page], rows, sems.at[slot])
                copy.start() if action == "start" else copy.wait()

    def _copies(self, block, slot, pools, when, action: str):
        for i in range(self.pages_per_block):
            index = block * self.pages_per_block + i
            pl.when(when & (index < self.n))(
                functools.partial(self._copy, i, index, slot, pools, action)
            )

    def start(self, block, slot, pools, when=True):
        self._copies(block, slot, pools, when, "start")

    def wait(self, block, slot, pools):
        self._copies(block, slot, pools, True, "wait")

    def stream(self, block, slot, pools, *, first):
        """One step of a chain of blocks: fetch ``block`` on the spot if ``first`` (nothing
        prefetched it), start block + 1 (if used) into the other buffer, wait for ``block``."""
        self.start(block, slot, pools, when=first)
        self.start(block + 1, 1 - slot, pools, when=block + 1 < self.n_blocks)
        self.wait(block, slot, pools)


def pool_spec(pages):
    """The pool [B, N, P, K] (or both arrays of a ``Quantized`` one) stays in HBM: the kernels DMA
    its pages."""
    return jax.tree.map(lambda _: pl.BlockSpec(memory_space=pl.ANY), pages)


def block_index(pages_per_block: int, n_heads: int):
    """Index of key block j in a BlockSpec index map, clamped to the (b, h) head's last used block
    (0 if none): the steps past it keep the same block, so the pipeline fetches (or writes back)
    nothing new."""

    def index(j, b, h, n_ref):
        used = jax.lax.div(n_ref[b * n_heads + h] + pages_per_block - 1, pages_per_block)
        return jnp.minimum(j, jnp.maximum(used - 1, 0))

    return index


def _stats_kernel(
    table_ref,
    n_ref,
    q_ref,
    k_pool,
    v_pool,
    spos_ref,
    row_ref,
    o_ref,
    row_out_ref,
    k_buf,
    v_buf,
    sems,
    m_sc,
    l_sc,
    acc_sc,
    *,
    pages,
    scale: float,
    precision,
):
    # j, the key block: innermost, sequential
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    head = HeadPages(table_ref, n_ref, b, h, **pages)
    bk = k_buf.shape[1]
    pl.when(j == 0)(functools.partial(common.reset_softmax, m_sc, l_sc, acc_sc))

    @pl.when(j < head.n_blocks)
    def _block():
        slot = jax.lax.rem(j, 2)
        head.stream(j, slot, ((k_pool, k_buf, sems), (v_pool, v_buf, sems)), first=j == 0)
        qpos = common.lane(row_ref[...], common.POS)
        tile = common.key_tile(
            q_ref,
            kv_at(k_buf, slot),
            kv_at(v_buf, slot),
            spos_ref,
            qpos,
            first_slot=j * bk,
            n_slots=head.n_slots,
            scale=scale,
            precision=precision,
        )
        common.online_softmax(tile.logits, tile.values(), m_sc, l_sc, acc_sc)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        m, l, alpha = with_unread_slots(m_sc[...], l_sc[...], head.n_unread)
        o_ref[...] = acc_sc[...] * common.lane_broadcast(alpha / l, acc_sc.shape[1])
        row_out_ref[...] = common.pack(row_ref[...], {common.MAX: m, common.SUM: l})


def _scores_kernel(
    table_ref,
    n_ref,
    tile_nz,
    chunk_nz,
    *refs,
    score: str,
    pages,
    head_rows: int,
    n_row_tiles: int,
    scale: float,
    precision,
):
    it = iter(refs)
    q_ref, k_pool, spos_ref, row_ref = (next(it) for _ in range(4))
    v_pool = next(it) if score != "attn" else None
    o_ref = next(it) if score in KEY_KINDS else None
    col_ref = next(it)  # [Gp, bk], resident across the row tiles
    k_buf = next(it)
    v_buf = next(it) if score != "attn" else None
    sems = next(it)
    scratch = list(it)
    b, h, j, r = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    head = HeadPages(table_ref, n_ref, b, h, **pages)
    br, bk = q_ref.shape[0], k_buf.shape[1]
    slot = jax.lax.rem(j, 2)
    used = j < head.n_blocks
    pools = ((k_pool, k_buf, sems),) + (((v_pool, v_buf, sems),) if score != "attn" else ())

    @pl.when(used & (r == 0))
    def _fetch():  # the block stays in its buffer while the row tiles stream past
        col_ref[...] = jnp.zeros(col_ref.shape, jnp.float32)
        head.stream(j, slot, pools, first=j == 0)

    @pl.when(used & (tile_nz[b * n_row_tiles + r] != 0))
    def _tile():
        rows = row_ref[...]
        v_ref = None if v_buf is None else kv_at(v_buf, slot)
        qpos = common.lane(rows, common.POS)
        tile = common.key_tile(
            q_ref,
            kv_at(k_buf, slot),
            v_ref,
            spos_ref,
            qpos,
            first_slot=j * bk,
            n_slots=head.n_slots,
            scale=scale,
            precision=precision,
        )

        def chunk_scored(c):
            return chunk_nz[(b * n_row_tiles + r) * (br // common.CHUNK) + c] != 0

        row_tile = common.RowTile(rows, r * br, head_rows, o_ref, chunk_scored)
        common.add_row_scores(score, tile, row_tile, col_ref, scratch)


def paged_block_attention_tpu(
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
    block_k: int | None = None,
    block_q: int | None = None,
    interpret=False,
):
    """Same contract as ``reference.paged_block_attention_with_scores``, as Pallas TPU kernels.

    Args:
        block_k: logical slots per key block, rounded up to whole pages and a multiple of 128
            (default 128; all M·P slots when fewer).
        block_q: query rows per tile, as ``block_attention.tpu``.
        interpret: True or ``pltpu.InterpretParams`` to run under the Pallas interpreter (any
            backend); otherwise TPU only.
    """
    check_score(score)
    B, T, H, Hk, M, P, K = check_paged_shapes(
        q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights
    )
    G = H // Hk
    check_supported(K, P, kind_of(k_pages))
    bk, per_block, nb = key_blocks(M, P, block_k)
    pages = {"n_heads": Hk, "n_table": M, "page_size": P, "pages_per_block": per_block}
    Tp, br, n_rows = common.row_tiles(T, G, block_q)
    nr = n_rows // br
    gp = round_up(G, 8)
    scale = math.sqrt(K)
    precision = common.mxu_precision(q.dtype)
    spos = slot_pos.astype(jnp.int32)[:, :, None, :]  # [B, Hk, 1, M·P], logical order
    rows, w, row_vec = common.query_rows(q, query_pos, query_weights, Hk, Tp, n_rows)
    table = page_table.astype(jnp.int32).reshape(-1)
    n = n_pages.astype(jnp.int32).reshape(-1)
    key_block = block_index(per_block, Hk)
    buffers = page_buffers(k_pages, v_pages, bk, K)

    row_spec = pl.BlockSpec((None, None, br, K), lambda b, h, r, j, *_: (b, h, r, 0))
    o, row_stats = pl.pallas_call(
        functools.partial(_stats_kernel, pages=pages, scale=scale, precision=precision),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, Hk, nr, nb),
            in_specs=[
                row_spec,
                pool_spec(k_pages),
                pool_spec(v_pages),
                pl.BlockSpec(
                    (None, None, 1, bk), lambda b, h, r, j, t, n: (b, h, 0, key_block(j, b, h, n))
                ),
                pl.BlockSpec((None, br, common.LANES), lambda b, h, r, j, *_: (b, r, 0)),
            ],
            out_specs=[
                row_spec,
                pl.BlockSpec((None, None, br, common.LANES), lambda b, h, r, j, *_: (b, h, r, 0)),
            ],
            scratch_shapes=buffers + common.softmax_scratch(br, K),
        ),
        out_shape=[
            jax.ShapeDtypeStruct((B, Hk, n_rows, K), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, n_rows, common.LANES), jnp.float32),
        ],
        compiler_params=common.compiler_params(3),
        interpret=interpret,
        name="paged_block_attention_stats",
    )(table, n, rows, k_pages, v_pages, spos, row_vec)

    out, lse, stats = common.from_rows(o, row_stats, T, G, q.dtype)
    if query_weights is None:
        return out, lse, None

    tile_nz, chunk_nz = common.scored_rows(w, br)
    # grid (b, h, j, r): the key block and the column block stay in VMEM while the row tiles stream
    # past; j is sequential too (the next block's pages are prefetched during block j's row tiles).
    row_spec = pl.BlockSpec((None, None, br, K), lambda b, h, j, r, *_: (b, h, r, 0))
    key_spec = lambda height: pl.BlockSpec(  # noqa: E731
        (None, None, height, bk),
        lambda b, h, j, r, t, n, *_: (b, h, 0, key_block(j, b, h, n)),
    )
    in_specs = [
        row_spec,
        pool_spec(k_pages),
        key_spec(1),
        pl.BlockSpec((None, None, br, common.LANES), lambda b, h, j, r, *_: (b, h, r, 0)),
    ]
    args = [rows, k_pages, spos, row_stats]
    scratch = buffers[:1] + ([buffers[1]] if score != "attn" else []) + buffers[2:]
    if score != "attn":
        in_specs.append(pool_spec(v_pages))
        args.append(v_pages)
    if score in KEY_KINDS:
        in_specs.append(row_spec)
        args.append(o)
        scratch += [pltpu.VMEM((br, bk), jnp.float32)] * (2 if score == "obcache-joint" else 1)
    col = pl.pallas_call(
        functools.partial(
            _scores_kernel,
            score=score,
            pages=pages,
            head_rows=Tp,
            n_row_tiles=nr,
            scale=scale,
            precision=precision,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(B, Hk, nb, nr),
            in_specs=in_specs,
            out_specs=key_spec(gp),
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((B, Hk, gp, M * P), jnp.float32),
        compiler_params=common.compiler_params(2),
        interpret=interpret,
        name="paged_block_attention_scores",
    )(table, n, tile_nz, chunk_nz, *args)
    m, l = stats[..., common.MAX], stats[..., common.SUM]
    return out, lse, fill_unused_pages(col[:, :, :G], n_pages, P, score, m, l, query_weights)


def _decode_kernel(
    qpos_ref,
    table_ref,
    n_ref,
    q_ref,
    k_pool,
    v_pool,
    spos_ref,
    o_ref,
    stats_ref,
    *rest,
    score: str | None,
    n_heads: int,
    pages,
    scale: float,
    precision,
):
    col_ref = rest[0] if score is not None else None
    k_buf, v_buf, sems, m_sc, l_sc, acc_sc = rest[-6:]
    b, h, phase, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    head = HeadPages(table_ref, n_ref, b, h, **pages)
    head_dim = q_ref.shape[1]
    bk = k_buf.shape[1]
    kv = ((k_pool, k_buf, sems), (v_pool, v_buf, sems))
    phase_pools = (kv, kv[:1] if score == "attn" else kv)  # the attn scores do not read V

    pl.when((phase == 0) & (j == 0))(functools.partial(common.reset_softmax, m_sc, l_sc, acc_sc))

    def block(p) -> common.KeyTile:
        """Fetch key block j of phase p (the chain runs through both phases) -> its ``KeyTile``."""
        slot = jax.lax.rem(p * head.n_blocks + j, 2)
        head.stream(j, slot, phase_pools[p], first=(p == 0) & (j == 0))
        if p == 0 and score is not None:
            # the last softmax block prefetches the first block of the scores
            head.start(0, 1 - slot, phase_pools[1], when=j + 1 == head.n_blocks)
        return common.key_tile(
            q_ref,
            kv_at(k_buf, slot),
            kv_at(v_buf, slot),
            spos_ref,
            qpos_ref[b],
            first_slot=j * bk,
            n_slots=head.n_slots,
            scale=scale,
            precision=precision,
        )

    @pl.when((phase == 0) & (j < head.n_blocks))
    def _softmax():
        tile = block(0)
        common.online_softmax(tile.logits, tile.values(), m_sc, l_sc, acc_sc)

    @pl.when((phase == 0) & (j == pl.num_programs(3) - 1))
    def _finish():
        m, l, alpha = with_unread_slots(m_sc[...], l_sc[...], head.n_unread)
        o = acc_sc[...] * common.lane_broadcast(alpha / l, head_dim)
        m_sc[...], l_sc[...], acc_sc[...] = m, l, o  # the final statistics, for phase 1
        o_ref[...] = o
        stats = {common.MAX: m, common.SUM: l}
        stats_ref[...] = common.pack(jnp.zeros(stats_ref.shape, jnp.float32), stats)

    if score is None:
        return

    @pl.when((phase == 1) & (j < head.n_blocks))
    def _scores():
        col_ref[...] = common.head_scores(score, block(1), m_sc, l_sc, acc_sc, n_heads)


def paged_decode_attention_tpu(
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
    block_k: int | None = None,
    interpret=False,
):
    """Attention of one query per sequence over the paged cache: (o [B, 1, H, K] float32 —
    uncorrected —, lse [B, 1, H], col [B, Hk, G, M·P] or None), as
    ``reference.paged_decode_attention_with_scores`` without moments. One call, grid
    (B, Hk, phase, key block) as ``decode_attention.tpu``; block_k as
    ``paged_block_attention_tpu``."""
    check_score(score)
    check_decode(q)
    B, _, H, Hk, M, P, K = check_paged_shapes(
        q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights
    )
    G = H // Hk
    check_supported(K, P, kind_of(k_pages))
    rows, gp = common.decode_rows(q, Hk)
    bk, per_block, nb = key_blocks(M, P, block_k)
    pages = {"n_heads": Hk, "n_table": M, "page_size": P, "pages_per_block": per_block}
    scoring = query_weights is not None
    key_block = block_index(per_block, Hk)

    head_spec = pl.BlockSpec((None, None, gp, K), lambda b, h, p, j, *_: (b, h, 0, 0))
    stats_spec = pl.BlockSpec((None, None, gp, common.LANES), lambda b, h, p, j, *_: (b, h, 0, 0))
    out_specs = [head_spec, stats_spec]
    out_shape = [
        jax.ShapeDtypeStruct((B, Hk, gp, K), jnp.float32),
        jax.ShapeDtypeStruct((B, Hk, gp, common.LANES), jnp.float32),
    ]
    if scoring:  # stays on block 0 through phase 0, written back after phase 1 has filled it
        out_specs.append(
            pl.BlockSpec(
                (None, None, gp, bk),
                lambda b, h, p, j, qp, t, n: (b, h, 0, p * key_block(j, b, h, n)),
            )
        )
        out_shape.append(jax.ShapeDtypeStruct((B, Hk, gp, M * P), jnp.float32))
    results = pl.pallas_call(
        functools.partial(
            _decode_kernel,
            score=score if scoring else None,
            n_heads=G,
            pages=pages,
            scale=math.sqrt(K),
            precision=common.mxu_precision(q.dtype),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, Hk, 2 if scoring else 1, nb),
            in_specs=[
                head_spec,
                pool_spec(k_pages),
                pool_spec(v_pages),
                pl.BlockSpec(
                    (None, None, 1, bk),
                    lambda b, h, p, j, qp, t, n: (b, h, 0, key_block(j, b, h, n)),
                ),
            ],
            out_specs=out_specs,
            scratch_shapes=page_buffers(k_pages, v_pages, bk, K) + common.softmax_scratch(gp, K),
        ),
        out_shape=out_shape,
        compiler_params=common.compiler_params(2),
        interpret=interpret,
        name="paged_decode_attention_with_scores",
    )(
        query_pos.astype(jnp.int32).reshape(B),
        page_table.astype(jnp.int32).reshape(-1),
        n_pages.astype(jnp.int32).reshape(-1),
        rows,
        k_pages,
        v_pages,
        slot_pos.astype(jnp.int32)[:, :, None, :],
    )
    out, lse, m, l = common.decode_outputs(*results[:2], G)
    if not scoring:
        return out, lse, None
    col = results[2][:, :, :G] * query_weights.astype(jnp.float32).reshape(B, 1, 1, 1)
    return (
        out,
        lse,
        fill_unused_pages(col, n_pages, P, score, m[..., None], l[..., None], query_weights),
    )
