"""Block attention with eviction scores as two Pallas Mosaic-TPU kernels.

Layout. The G query heads of a KV head are processed together: q [B, T, H, K] is rearranged in the
wrapper into the rows of each KV head, [B, Hk, rows, K] with row g·Tp + t = (query head g, query t)
(Tp = T rounded up to 16; rows padded to a multiple of the row tile ``br``, up to 512 rows, so that at
SmolLM2's and Llama-8B's G·T = 384 / 512 all the heads of a KV head share one tile). The cache is tiled
over slots (``bk``, a multiple of 128 lanes). S is not padded — padding would copy the whole cache in HBM
on every call: the last key tile may run past S, its out-of-range slots (whatever the DMA left in VMEM)
are masked by slot index (logit -inf, value row zeroed) and its out-of-range column entries are never
written back. Block shapes obey Mosaic's tiling rule (last two block dims multiples of 8 and 128, or
equal to the array's dims): q/k/v blocks are [br or bk, K] (K is the full last dim), slot positions are [B, Hk, 1, S] blocks
[1, bk], and the per-row scalars travel in one packed [rows, 128] float32 array whose lanes hold (query
position, query weight, running max m, sum l) — per-row vectors broadcast over lanes, as in
``jax.experimental.pallas.ops.tpu.flash_attention``, but four of them in one array.

Pass 1 (``_stats_kernel``, grid (B, Hk, row tiles, key tiles), key tiles innermost and sequential): online
softmax — running max m, sum l and the un-normalised output in VMEM scratch — writing o [.., rows, K]
float32 and the packed row vector completed with m and l. No [T, S] matrix ever reaches HBM.

Pass 2 (``_scores_kernel``, grid (B, Hk, key tiles, row tiles), row tiles innermost and sequential): the
column block [Gp, bk] of a key tile (Gp = G rounded up to 8) stays resident in VMEM while the row tiles
stream past it (with one row tile — the usual case — the row-side blocks are fetched once per KV head,
not once per key tile). Each step recomputes the logits of its [br, bk] tile, A = exp(z − m) / l with
the final statistics, and adds Σ_t w_t · score(t, s) into the rows of its query heads with a one-hot
[Gp, br] matmul. Row tiles and 8-row chunks whose weights are all zero are skipped with flags prefetched
into SMEM (``PrefetchScalarGridSpec``): most queries of a block do not score. The OBCache key terms need
‖v_s − o_t‖² and v_s·(v_s − o_t) for every (t, s); they are formed from the differences themselves, one
query row at a time ([bk, K] on the VPU), and reduced over K on the MXU with rows of ones
(``ones[8, K] · Xᵀ``), which also lays the result out along lanes like the column block. Rows are taken
from aligned 8-row chunks with a masked sublane sum (``pick_row``), not with unaligned sublane slices.

Semantics follow ``reference.py`` exactly, including a fully masked query row: invisible real slots get
the logit -1e30 (so such a row spreads its weight uniformly over the S real slots, as the reference does)
while slots past S get -inf and never count.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kvjax.kernels._shared import (
    NEG_INF,
    NN_DIMS,
    NT_DIMS,
    check_score,
    check_shapes,
    pad_axis,
    round_up,
)

LANES = 128
CHUNK = 8  # query rows per step of the difference terms (one f32 sublane tile)
ROW_ALIGN = 16  # row tiles and per-head row blocks are multiples of 16 (bf16 packs 16 rows per tile)
DEFAULT_BLOCK_K = 128
DEFAULT_BLOCK_ROWS = 512  # query rows (G heads × queries) per tile
PARALLEL = pltpu.GridDimensionSemantics.PARALLEL
ARBITRARY = pltpu.GridDimensionSemantics.ARBITRARY
POS, WEIGHT, MAX, SUM = 0, 1, 2, 3  # lanes of the packed per-row array


def supports(head_dim: int) -> bool:
    """Whether the Mosaic-TPU kernels take this head dim (≤ 128 lanes, or whole 128-lane tiles)."""
    return head_dim <= LANES or head_dim % LANES == 0


def check_head_dim(head_dim: int) -> None:
    if not supports(head_dim):
        raise ValueError(f"head dim {head_dim} must be ≤ 128 or a multiple of 128 for the TPU kernel")


def _precision(dtype):
    """float32 operands: full-precision MXU passes (Mosaic's default may use fewer); bf16: native."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _lanes(x, n: int):
    """A lane-broadcast [rows, 128] array as [rows, n] (n ≤ 128, or a multiple of 128)."""
    if n == LANES:
        return x
    if n < LANES:
        return x[:, :n]
    return jnp.tile(x, (1, n // LANES))


def lane(x, c: int):
    """Lane c of a packed [rows, 128] array as a column [rows, 1] (a masked lane sum: no lane shifts)."""
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.sum(jnp.where(ids == c, x, 0), axis=1, keepdims=True)


def pack(base, columns: dict):
    """``base`` [rows, 128] float32 with lanes c replaced by columns[c] ([rows, 1] or lane-broadcast)."""
    ids = jax.lax.broadcasted_iota(jnp.int32, base.shape, 1)
    for c, x in columns.items():
        base = jnp.where(ids == c, x, base)
    return base


def masked_logits(z, spos, qpos, first_slot: int | jax.Array, n_slots: int):
    """z [R, bk] float32 -> (logits, visible): visible slots keep z, invisible real slots get -1e30 (as the
    reference), slots past ``n_slots`` (a ragged last tile: z and spos are garbage there) get -inf.
    spos [1, bk] int32; qpos either a float32 column [R, 1] (positions exact below 2^24) or an int32 scalar."""
    real = first_slot + jax.lax.broadcasted_iota(jnp.int32, spos.shape, 1) < n_slots
    qpos = jnp.asarray(qpos)
    visible = real & (spos >= 0) & (spos.astype(qpos.dtype) <= qpos)
    return jnp.where(visible, z, jnp.where(real, jnp.float32(NEG_INF), -jnp.inf)), visible


def real_rows(x, first_slot, n_slots: int):
    """x [bk, K] with the rows of slots past ``n_slots`` zeroed (no-op unless the last tile is ragged):
    p · V must not meet garbage (0 · NaN = NaN)."""
    if n_slots % x.shape[0] == 0:
        return x
    slot = first_slot + jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
    return jnp.where(slot < n_slots, x, jnp.zeros((), x.dtype))


def _logits(q_ref, k_ref, spos_ref, qpos, *, first_slot, n_slots, scale, precision):
    q = q_ref[...]
    k = k_ref[...].astype(q.dtype)
    z = jax.lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32, precision=precision) / scale
    return masked_logits(z, spos_ref[...], qpos, first_slot, n_slots) + (z,)


def _stats_kernel(q_ref, k_ref, v_ref, spos_ref, row_ref, o_ref, row_out_ref, m_sc, l_sc, acc_sc, *,
                  n_slots: int, scale: float, precision):
    j = pl.program_id(3)  # key tile: the innermost, sequential grid axis
    bk = k_ref.shape[0]
    head_dim = acc_sc.shape[1]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    logits, _, _ = _logits(q_ref, k_ref, spos_ref, lane(row_ref[...], POS), first_slot=j * bk,
                           n_slots=n_slots, scale=scale, precision=precision)
    m_prev = m_sc[...]  # [rows, 128], lane-broadcast
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
    p = jnp.exp(logits - _lanes(m_next, bk))  # tile 0 holds slot 0 (a real slot): m_next is finite
    alpha = jnp.exp(m_prev - m_next)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_next
    v = real_rows(v_ref[...], j * bk, n_slots)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, NN_DIMS, preferred_element_type=jnp.float32,
                             precision=_precision(v.dtype))
    acc_sc[...] = _lanes(alpha, head_dim) * acc_sc[...] + pv

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = acc_sc[...] / _lanes(l_sc[...], head_dim)
        row_out_ref[...] = pack(row_ref[...], {MAX: m_sc[...], SUM: l_sc[...]})


def _row_sums(x):
    """Σ_k x[s, k] laid out along lanes: [bk, K] float32 -> [1, bk], via ones[8, K] · xᵀ on the MXU."""
    ones = jnp.ones((CHUNK, x.shape[1]), jnp.float32)
    return jax.lax.dot_general(ones, x, NT_DIMS, preferred_element_type=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST)[:1]


def pick_row(x, r: int):
    """Row r of x [R, N] as [1, N], by a masked sum over sublanes (no unaligned sublane slice needed)."""
    row = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
    return jnp.sum(jnp.where(row == r, x, 0.0), axis=0, keepdims=True)


def _scores_kernel(tile_nz, chunk_nz, *refs, score: str, n_slots: int, head_rows: int, n_row_tiles: int,
                   scale: float, precision):
    it = iter(refs)
    q_ref, k_ref, spos_ref, row_ref = (next(it) for _ in range(4))
    v_ref = next(it) if score != "attn" else None
    o_ref = next(it) if score in ("obcache-key", "obcache-joint") else None
    col_ref = next(it)  # [Gp, bk], resident across the row tiles
    scratch = list(it)
    b, j, r = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    br, bk = q_ref.shape[0], k_ref.shape[0]
    gp = col_ref.shape[0]

    @pl.when(r == 0)
    def _init():
        col_ref[...] = jnp.zeros(col_ref.shape, jnp.float32)

    @pl.when(tile_nz[b * n_row_tiles + r] != 0)
    def _tile():
        rows = row_ref[...]
        logits, visible, z = _logits(q_ref, k_ref, spos_ref, lane(rows, POS), first_slot=j * bk,
                                     n_slots=n_slots, scale=scale, precision=precision)
        a = jnp.exp(logits - lane(rows, MAX)) / lane(rows, SUM)
        wa = lane(rows, WEIGHT) * a
        # head of each row of the tile, as a one-hot [Gp, br]: rows g·Tp .. (g+1)·Tp − 1 belong to head g
        row_id = r * br + jax.lax.broadcasted_iota(jnp.int32, (gp, br), 1)
        head_start = jax.lax.broadcasted_iota(jnp.int32, (gp, br), 0) * head_rows
        one_hot = ((row_id >= head_start) & (row_id < head_start + head_rows)).astype(jnp.float32)

        def add_per_head(c):  # [br, bk] -> col rows: Σ over the rows of each head
            col_ref[...] += jax.lax.dot_general(one_hot, c, NN_DIMS, preferred_element_type=jnp.float32,
                                                precision=jax.lax.Precision.HIGHEST)

        if score == "attn":
            add_per_head(wa)
            return
        vf = real_rows(v_ref[...].astype(jnp.float32), j * bk, n_slots)
        a2 = wa * a
        if score in ("obcache-value", "obcache-joint"):
            add_per_head(a2 * _row_sums(vf * vf))
        if score == "obcache-value":
            return
        z0 = jnp.where(visible, z, 0.0)
        c_dist_sc = scratch[0]
        c_dist_sc[...] = a2 * z0 * z0
        if score == "obcache-joint":
            scratch[1][...] = 2.0 * a2 * z0
        head = jax.lax.broadcasted_iota(jnp.int32, (gp, 1), 0)

        def chunk(c, carry):
            @pl.when(chunk_nz[(b * n_row_tiles + r) * (br // CHUNK) + c] != 0)
            def _rows():
                start = pl.multiple_of(c * CHUNK, CHUNK)
                o_c = o_ref[pl.ds(start, CHUNK), :]  # [8, K] float32
                c_dist = c_dist_sc[pl.ds(start, CHUNK), :]  # [8, bk]
                c_dot = scratch[1][pl.ds(start, CHUNK), :] if score == "obcache-joint" else None
                # the chunk's head (a chunk never straddles two heads: Tp % 16 == 0); lax.div, not //: floor
                # division of signed ints lowers through sign(), whose Mosaic rule asks for the TPU generation
                g = jax.lax.div(r * br + start, head_rows)
                acc = jnp.zeros((1, bk), jnp.float32)
                for i in range(CHUNK):
                    diff = vf - pick_row(o_c, i)  # [bk, K]: v_s − o_t, formed explicitly
                    acc = acc + pick_row(c_dist, i) * _row_sums(diff * diff)
                    if c_dot is not None:
                        acc = acc + pick_row(c_dot, i) * _row_sums(vf * diff)
                col_ref[...] += jnp.where(head == g, acc, 0.0)

            return carry

        jax.lax.fori_loop(0, br // CHUNK, chunk, 0)


def block_attention_tpu(q, k, v, slot_pos, query_pos, query_weights=None, score: str = "attn", *,
                        block_k: int | None = None, block_q: int | None = None, interpret=False):
    """Same contract as ``reference.block_attention_with_scores``, as Pallas TPU kernels.

    block_k: slots per key tile, rounded up to a multiple of 128 (lanes; one tile of all S slots when S is
    not larger); block_q: query rows per tile —
    rows of all G heads together — rounded up to a multiple of 16 (default 512, capped at G·T rounded up).
    interpret: run the kernels with the Pallas interpreter (any backend, e.g. CPU); otherwise they only
    lower for TPU. Query positions travel as float32 (exact below 2^24).
    """
    check_score(score)
    B, T, H, Hk, S, K = check_shapes(q, k, v, slot_pos, query_pos, query_weights)
    G = H // Hk
    check_head_dim(K)
    bk = round_up(block_k or DEFAULT_BLOCK_K, LANES)
    bk = min(S, bk)  # one tile equal to the whole (short) slot axis is always a legal block
    Tp = round_up(T, ROW_ALIGN)
    br = min(round_up(block_q or DEFAULT_BLOCK_ROWS, ROW_ALIGN), G * Tp)
    n_rows = round_up(G * Tp, br)  # rows past G·Tp belong to no head (position -1, weight 0)
    nr, nk = n_rows // br, -(-S // bk)  # the last key tile may be ragged
    gp = round_up(G, 8)
    scale = math.sqrt(K)
    precision = _precision(q.dtype)

    per_head = pad_axis(jnp.transpose(q.reshape(B, T, Hk, G, K), (0, 2, 3, 1, 4)), 3, Tp)  # [B, Hk, G, Tp, K]
    rows = pad_axis(per_head.reshape(B, Hk, G * Tp, K), 2, n_rows)
    spos = slot_pos.astype(jnp.int32)[:, :, None, :]  # [B, Hk, 1, S]
    qpos = pad_axis(jnp.tile(pad_axis(query_pos.astype(jnp.float32), 1, Tp, -1.0), (1, G)), 1, n_rows, -1.0)
    w = jnp.zeros((B, T), jnp.float32) if query_weights is None else query_weights.astype(jnp.float32)
    w = pad_axis(jnp.tile(pad_axis(w, 1, Tp), (1, G)), 1, n_rows)  # [B, n_rows]
    ids = jnp.arange(LANES)
    row_vec = jnp.where(ids == POS, qpos[..., None], jnp.where(ids == WEIGHT, w[..., None], 0.0))  # [B, n_rows, 128]

    row_spec = pl.BlockSpec((None, None, br, K), lambda b, h, r, j: (b, h, r, 0))
    o, row_stats = pl.pallas_call(
        functools.partial(_stats_kernel, n_slots=S, scale=scale, precision=precision),
        grid=(B, Hk, nr, nk),
        in_specs=[row_spec,
                  pl.BlockSpec((None, None, bk, K), lambda b, h, r, j: (b, h, j, 0)),
                  pl.BlockSpec((None, None, bk, K), lambda b, h, r, j: (b, h, j, 0)),
                  pl.BlockSpec((None, None, 1, bk), lambda b, h, r, j: (b, h, 0, j)),
                  pl.BlockSpec((None, br, LANES), lambda b, h, r, j: (b, r, 0))],
        out_specs=[row_spec, pl.BlockSpec((None, None, br, LANES), lambda b, h, r, j: (b, h, r, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Hk, n_rows, K), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hk, n_rows, LANES), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((br, LANES), jnp.float32), pltpu.VMEM((br, LANES), jnp.float32),
                        pltpu.VMEM((br, K), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, ARBITRARY)),
        interpret=interpret,
        name="block_attention_stats",
    )(rows, k, v, spos, row_vec)

    heads = lambda x: x[:, :, :G * Tp].reshape(B, Hk, G, Tp, x.shape[-1])[:, :, :, :T]
    out = jnp.transpose(heads(o), (0, 3, 1, 2, 4)).reshape(B, T, H, K).astype(q.dtype)
    stats = heads(row_stats)
    lse = jnp.transpose(stats[..., MAX] + jnp.log(stats[..., SUM]), (0, 3, 1, 2)).reshape(B, T, H)
    if query_weights is None:
        return out, lse, None

    tile_nz = jnp.any(w.reshape(B * nr, br) != 0, axis=1).astype(jnp.int32)
    chunk_nz = jnp.any(w.reshape(B * n_rows // CHUNK, CHUNK) != 0, axis=1).astype(jnp.int32)
    # grid (b, h, j, r): the K/V tile and the column block stay in VMEM while the row tiles stream past.
    row_spec = pl.BlockSpec((None, None, br, K), lambda b, h, j, r, *_: (b, h, r, 0))
    kv_spec = pl.BlockSpec((None, None, bk, K), lambda b, h, j, r, *_: (b, h, j, 0))
    in_specs = [row_spec, kv_spec, pl.BlockSpec((None, None, 1, bk), lambda b, h, j, r, *_: (b, h, 0, j)),
                pl.BlockSpec((None, None, br, LANES), lambda b, h, j, r, *_: (b, h, r, 0))]
    args = [rows, k, spos, row_stats]
    if score != "attn":
        in_specs.append(kv_spec)
        args.append(v)
    scratch = []
    if score in ("obcache-key", "obcache-joint"):
        in_specs.append(row_spec)
        args.append(o)
        scratch = [pltpu.VMEM((br, bk), jnp.float32)] * (2 if score == "obcache-joint" else 1)
    col = pl.pallas_call(
        functools.partial(_scores_kernel, score=score, n_slots=S, head_rows=Tp, n_row_tiles=nr, scale=scale,
                          precision=precision),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, Hk, nk, nr),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, gp, bk), lambda b, h, j, r, *_: (b, h, 0, j)),
            scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct((B, Hk, gp, S), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, ARBITRARY)),
        interpret=interpret,
        name="block_attention_scores",
    )(tile_nz, chunk_nz, *args)
    return out, lse, col[:, :, :G]
