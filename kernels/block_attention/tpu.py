"""Block attention with eviction scores as two Pallas Mosaic-TPU kernels.

Layout. The G query heads of a KV head are processed together: q [B, T, H, K] is rearranged in the
wrapper into the rows of each KV head, [B, Hk, rows, K] with row g·Tp + t = (query head g, query t)
(Tp = T rounded up to 16; rows padded to a multiple of the row tile ``br``, up to 512 rows, so that
at SmolLM2's and Llama-8B's G·T = 384 / 512 all the heads of a KV head share one tile). The cache is
tiled over slots (``bk``, a multiple of 128 lanes). S is not padded — padding would copy the whole
cache in HBM on every call: the last key tile may run past S, its out-of-range slots (whatever the
DMA left in VMEM) are masked by slot index (logit -inf, value row zeroed) and its out-of-range
column entries are never written back. Block shapes obey Mosaic's tiling rule (last two block dims
multiples of 8 and 128, or equal to the array's dims): q/k/v blocks are [br or bk, K] (K is the full
last dim), slot positions are [B, Hk, 1, S] blocks [1, bk], and the per-row scalars travel in one
packed [rows, 128] float32 array (``tpu_common``: query position, query weight, running max m, sum
l).

Pass 1 (``_stats_kernel``, grid (B, Hk, row tiles, key tiles), key tiles innermost and sequential):
online softmax (``tpu_common.online_softmax``) — running max m, sum l and the un-normalised output
in VMEM scratch — writing o [.., rows, K] float32 and the packed row vector completed with m and l.
No [T, S] matrix ever reaches HBM.

Pass 2 (``_scores_kernel``, grid (B, Hk, key tiles, row tiles), row tiles innermost and sequential):
the column block [Gp, bk] of a key tile (Gp = G rounded up to 8) stays resident in VMEM while the
row tiles stream past it (with one row tile — the usual case — the row-side blocks are fetched once
per KV head, not once per key tile). Each step recomputes the logits of its [br, bk] tile, A =
exp(z − m) / l with the final statistics, and adds Σ_t w_t · score(t, s) into the rows of its query
heads (``tpu_common.add_row_scores``, shared with the paged kernels). Row tiles and 8-row chunks
whose weights are all zero are skipped with flags prefetched into SMEM (``PrefetchScalarGridSpec``):
most queries of a block do not score.

Quantized keys and values (``Quantized``: codes and per-slot scales) are tiled like the keys —
codes [bk, K] (int4: [bk, K/2] bytes) and scales [bk, 1] — and dequantized in VMEM right after the
load (``tpu_common.load``), to q's dtype; nothing dequantized is written to HBM.

Semantics follow ``reference.py`` exactly, including a fully masked query row: invisible real slots
get the logit -1e30 (so such a row spreads its weight uniformly over the S real slots, as the
reference does) while slots past S get -inf and never count.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kvjax.kernels import tpu_common as common
from kvjax.kernels._shared import KEY_KINDS, check_score, check_shapes, kv_spec, round_up

# the tiling constants, also read as block_attention.tpu's by benchmarks/kernels.py
from kvjax.kernels.tpu_common import DEFAULT_BLOCK_K, DEFAULT_BLOCK_ROWS, ROW_ALIGN  # noqa: F401


def _stats_kernel(
    q_ref,
    k_ref,
    v_ref,
    spos_ref,
    row_ref,
    o_ref,
    row_out_ref,
    m_sc,
    l_sc,
    acc_sc,
    *,
    n_slots: int,
    scale: float,
    precision,
):
    j = pl.program_id(3)  # key tile: the innermost, sequential grid axis
    bk = k_ref.shape[0]
    pl.when(j == 0)(functools.partial(common.reset_softmax, m_sc, l_sc, acc_sc))
    qpos = common.lane(row_ref[...], common.POS)
    tile = common.key_tile(
        q_ref,
        k_ref,
        v_ref,
        spos_ref,
        qpos,
        first_slot=j * bk,
        n_slots=n_slots,
        scale=scale,
        precision=precision,
    )
    common.online_softmax(tile.logits, tile.values(), m_sc, l_sc, acc_sc)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = acc_sc[...] / common.lane_broadcast(l_sc[...], acc_sc.shape[1])
        row_out_ref[...] = common.pack(row_ref[...], {common.MAX: m_sc[...], common.SUM: l_sc[...]})


def _scores_kernel(
    tile_nz,
    chunk_nz,
    *refs,
    score: str,
    n_slots: int,
    head_rows: int,
    n_row_tiles: int,
    scale: float,
    precision,
):
    it = iter(refs)
    q_ref, k_ref, spos_ref, row_ref = (next(it) for _ in range(4))
    v_ref = next(it) if score != "attn" else None
    o_ref = next(it) if score in KEY_KINDS else None
    col_ref = next(it)  # [Gp, bk], resident across the row tiles
    scratch = list(it)
    b, j, r = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    br, bk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(r == 0)
    def _init():
        col_ref[...] = jnp.zeros(col_ref.shape, jnp.float32)

    @pl.when(tile_nz[b * n_row_tiles + r] != 0)
    def _tile():
        rows = row_ref[...]
        qpos = common.lane(rows, common.POS)
        tile = common.key_tile(
            q_ref,
            k_ref,
            v_ref,
            spos_ref,
            qpos,
            first_slot=j * bk,
            n_slots=n_slots,
            scale=scale,
            precision=precision,
        )

        def chunk_scored(c):
            return chunk_nz[(b * n_row_tiles + r) * (br // common.CHUNK) + c] != 0

        row_tile = common.RowTile(rows, r * br, head_rows, o_ref, chunk_scored)
        common.add_row_scores(score, tile, row_tile, col_ref, scratch)


def block_attention_tpu(
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
):
    """Same contract as ``reference.block_attention_with_scores``, as Pallas TPU kernels.

    Args:
        block_k: slots per key tile, rounded up to a multiple of 128 (lanes; one tile of all S
            slots when S is not larger).
        block_q: query rows per tile — rows of all G heads together — rounded up to a multiple of
            16 (default 512, capped at G·T rounded up).
        interpret: run the kernels with the Pallas interpreter (any backend, e.g. CPU); otherwise
            they only lower for TPU.

    Query positions travel as float32 (exact below 2^24).
    """
    check_score(score)
    B, T, H, Hk, S, K = check_shapes(q, k, v, slot_pos, query_pos, query_weights)
    G = H // Hk
    common.check_head_dim(K)
    bk = round_up(block_k or DEFAULT_BLOCK_K, common.LANES)
    bk = min(S, bk)  # one tile equal to the whole (short) slot axis is always a legal block
    Tp, br, n_rows = common.row_tiles(T, G, block_q)
    nr, nk = n_rows // br, -(-S // bk)  # the last key tile may be ragged
    gp = round_up(G, 8)
    scale = math.sqrt(K)
    precision = common.mxu_precision(q.dtype)
    spos = slot_pos.astype(jnp.int32)[:, :, None, :]  # [B, Hk, 1, S]
    rows, w, row_vec = common.query_rows(q, query_pos, query_weights, Hk, Tp, n_rows)

    row_spec = pl.BlockSpec((None, None, br, K), lambda b, h, r, j: (b, h, r, 0))
    o, row_stats = pl.pallas_call(
        functools.partial(_stats_kernel, n_slots=S, scale=scale, precision=precision),
        grid=(B, Hk, nr, nk),
        in_specs=[
            row_spec,
            kv_spec(k, (None, None, bk, K), lambda b, h, r, j: (b, h, j, 0)),
            kv_spec(v, (None, None, bk, K), lambda b, h, r, j: (b, h, j, 0)),
            pl.BlockSpec((None, None, 1, bk), lambda b, h, r, j: (b, h, 0, j)),
            pl.BlockSpec((None, br, common.LANES), lambda b, h, r, j: (b, r, 0)),
        ],
        out_specs=[
            row_spec,
            pl.BlockSpec((None, None, br, common.LANES), lambda b, h, r, j: (b, h, r, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hk, n_rows, K), jnp.float32),
            jax.ShapeDtypeStruct((B, Hk, n_rows, common.LANES), jnp.float32),
        ],
        scratch_shapes=common.softmax_scratch(br, K),
        compiler_params=common.compiler_params(3),
        interpret=interpret,
        name="block_attention_stats",
    )(rows, k, v, spos, row_vec)

    out, lse, _ = common.from_rows(o, row_stats, T, G, q.dtype)
    if query_weights is None:
        return out, lse, None

    tile_nz, chunk_nz = common.scored_rows(w, br)
    # grid (b, h, j, r): the K/V tile and the column block stay in VMEM while the row tiles stream
    # past.
    row_spec = pl.BlockSpec((None, None, br, K), lambda b, h, j, r, *_: (b, h, r, 0))

    def tile_spec(x):
        return kv_spec(x, (None, None, bk, K), lambda b, h, j, r, *_: (b, h, j, 0))

    in_specs = [
        row_spec,
        tile_spec(k),
        pl.BlockSpec((None, None, 1, bk), lambda b, h, j, r, *_: (b, h, 0, j)),
        pl.BlockSpec((None, None, br, common.LANES), lambda b, h, j, r, *_: (b, h, r, 0)),
    ]
    args = [rows, k, spos, row_stats]
    if score != "attn":
        in_specs.append(tile_spec(v))
        args.append(v)
    scratch = []
    if score in KEY_KINDS:
        in_specs.append(row_spec)
        args.append(o)
        scratch = [pltpu.VMEM((br, bk), jnp.float32)] * (2 if score == "obcache-joint" else 1)
    col = pl.pallas_call(
        functools.partial(
            _scores_kernel,
            score=score,
            n_slots=S,
            head_rows=Tp,
            n_row_tiles=nr,
            scale=scale,
            precision=precision,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, Hk, nk, nr),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, gp, bk), lambda b, h, j, r, *_: (b, h, 0, j)),
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((B, Hk, gp, S), jnp.float32),
        compiler_params=common.compiler_params(3),
        interpret=interpret,
        name="block_attention_scores",
    )(tile_nz, chunk_nz, *args)
    return out, lse, col[:, :, :G]
