"""Pallas Mosaic-TPU pieces shared by the TPU kernels of ``block_attention``, ``decode_attention``
and ``paged_attention``: tile sizes and shape rules, the packed per-row array, masked logits, the
online softmax, the score pass of every score kind, and the wrappers' layout of query rows.

Per-row vectors travel lane-broadcast ([rows, 128] float32, as in
``jax.experimental.pallas.ops.tpu.flash_attention``); the block kernels pack four of them into one
array whose lanes hold (query position, query weight, running max m, sum l): ``POS``, ``WEIGHT``,
``MAX``, ``SUM``. Slots past the real ones (a ragged last tile, pages not copied) hold garbage:
their logits are -inf and their value rows are zeroed (``masked_logits``, ``real_rows``).

Quantized keys and values arrive as a ``Quantized`` of refs (codes [bk, K] — int4: [bk, K/2] bytes —
and scales [bk, 1], tiled like the keys): ``load`` dequantizes a tile in VMEM right after it is
read, to the dtype the kernel computes in (q's).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kvjax.kernels._shared import (
    KEY_KINDS,
    NEG_INF,
    NN_DIMS,
    NT_DIMS,
    VALUE_KINDS,
    dequantize_tile,
    pad_axis,
    round_up,
)
from kvjax.kernels.quantized import Quantized

LANES = 128
CHUNK = 8  # query rows per step of the difference terms (one f32 sublane tile)
ROW_ALIGN = 16  # row tiles and per-head row blocks are multiples of 16 (bf16: 16 rows per tile)
DEFAULT_BLOCK_K = 128  # slots per key tile (a multiple of LANES)
DEFAULT_BLOCK_ROWS = 512  # query rows (G heads × queries) per tile: one tile at G·T = 384 or 512
POS, WEIGHT, MAX, SUM = 0, 1, 2, 3  # lanes of the packed per-row array


def supports(head_dim: int) -> bool:
    """Whether the Mosaic-TPU kernels take this head dim (≤ 128 lanes, or whole 128-lane tiles)."""
    return head_dim <= LANES or head_dim % LANES == 0


def check_head_dim(head_dim: int) -> None:
    if not supports(head_dim):
        raise ValueError(
            f"head dim {head_dim} must be ≤ 128 or a multiple of 128 for the TPU kernel"
        )


def mxu_precision(dtype):
    """float32 operands: full-precision MXU passes (Mosaic's default may use fewer); bf16 native."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def full_dot(a, b):
    """a · bᵀ of float32 operands on the MXU at full float32 precision."""
    precision = jax.lax.Precision.HIGHEST
    return jax.lax.dot_general(
        a, b, NT_DIMS, preferred_element_type=jnp.float32, precision=precision
    )


def lane_broadcast(x, n: int):
    """A lane-broadcast [rows, 128] array as [rows, n] (n ≤ 128, or a multiple of 128)."""
    if n == LANES:
        return x
    if n < LANES:
        return x[:, :n]
    return jnp.tile(x, (1, n // LANES))


def lane(x, c: int):
    """Lane c of a packed [rows, 128] array as a column [rows, 1] (a masked lane sum: no shifts)."""
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.sum(jnp.where(ids == c, x, 0), axis=1, keepdims=True)


def pack(base, columns: dict):
    """``base`` [rows, 128] float32 with lanes c replaced by columns[c] ([rows, 1] or broadcast)."""
    ids = jax.lax.broadcasted_iota(jnp.int32, base.shape, 1)
    for c, x in columns.items():
        base = jnp.where(ids == c, x, base)
    return base


def row_sums(x):
    """Σ_k x[s, k] along lanes: [bk, K] float32 -> [1, bk], as ones[8, K] · xᵀ on the MXU."""
    ones = jnp.ones((CHUNK, x.shape[1]), jnp.float32)
    return jax.lax.dot_general(
        ones, x, NT_DIMS, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )[:1]


def pick_row(x, r: int):
    """Row r of x [R, N] as [1, N], by a masked sum over sublanes (no unaligned sublane slice)."""
    row = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
    return jnp.sum(jnp.where(row == r, x, 0.0), axis=0, keepdims=True)


def masked_logits(z, spos, qpos, first_slot: int | jax.Array, n_slots: int | jax.Array):
    """z [R, bk] float32 -> (logits, visible): visible slots keep z, invisible real slots get -1e30
    (as the reference), slots past ``n_slots`` (garbage in z and spos) get -inf.

    Args:
        spos: [1, bk] int32.
        qpos: a float32 column [R, 1] (positions exact below 2^24) or an int32 scalar.
    """
    real = first_slot + jax.lax.broadcasted_iota(jnp.int32, spos.shape, 1) < n_slots
    qpos = jnp.asarray(qpos)
    visible = real & (spos >= 0) & (spos.astype(qpos.dtype) <= qpos)
    return jnp.where(visible, z, jnp.where(real, jnp.float32(NEG_INF), -jnp.inf)), visible


def real_rows(x, first_slot, n_slots: int | jax.Array):
    """x [bk, K] with the rows of slots ≥ ``n_slots`` zeroed (for a static n_slots, a no-op unless
    the tile is ragged): p · V must not meet garbage (0 · NaN = NaN)."""
    if isinstance(n_slots, int) and n_slots % x.shape[0] == 0:
        return x
    slot = first_slot + jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
    return jnp.where(slot < n_slots, x, jnp.zeros((), x.dtype))


def concat_lanes(low, high):
    """[bk, K/2] and [bk, K/2] -> [bk, K] (the int4 halves)."""
    return jnp.concatenate([low, high], axis=1)


def load(ref, dtype):
    """The keys or values [bk, K] of a ref as stored, or of a ``Quantized`` of refs dequantized to
    ``dtype``."""
    if isinstance(ref, Quantized):
        return dequantize_tile(ref.data[...], ref.scale[...], ref.kind, dtype, concat_lanes)
    return ref[...]


class KeyTile(NamedTuple):
    """A key tile of bk slots against R query rows.

    Fields:
        logits, visible, z: [R, bk] (``masked_logits``; z = q·k / scale unmasked).
        v_ref: the value ref [bk, K] from slot first_slot on (or a ``Quantized`` of refs).
        first_slot: the tile's first slot.
        n_slots: the slots ≥ n_slots are not real.
        dtype: the dtype quantized values are read in (q's).
    """

    logits: jax.Array
    visible: jax.Array
    z: jax.Array
    v_ref: Any
    first_slot: int | jax.Array
    n_slots: int | jax.Array
    dtype: Any

    def values(self, dtype=None):
        """The values [bk, K] (cast to ``dtype`` if given), the rows of slots not real zeroed."""
        v = load(self.v_ref, self.dtype)
        return real_rows(v if dtype is None else v.astype(dtype), self.first_slot, self.n_slots)


def key_tile(
    q_ref, k_ref, v_ref, spos_ref, qpos, *, first_slot, n_slots, scale: float, precision
) -> KeyTile:
    """The ``KeyTile`` of the query rows q_ref [R, K] (positions qpos, as ``masked_logits``) against
    k_ref, v_ref [bk, K] (refs, or ``Quantized`` of refs) with slot positions spos_ref [1, bk];
    precision: of the q·k matmul."""
    q = q_ref[...]
    k = load(k_ref, q.dtype).astype(q.dtype)
    z = (
        jax.lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32, precision=precision)
        / scale
    )
    logits, visible = masked_logits(z, spos_ref[...], qpos, first_slot, n_slots)
    return KeyTile(logits, visible, z, v_ref, first_slot, n_slots, q.dtype)


def reset_softmax(m_sc, l_sc, acc_sc):
    """Start an online softmax: running max -inf, sum and output accumulator zero."""
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def online_softmax(logits, v, m_sc, l_sc, acc_sc):
    """One key tile of the online softmax.

    Args:
        logits: [rows, bk] float32.
        v: [bk, K].
        m_sc, l_sc: m, l [rows, 128] lane-broadcast, in VMEM scratch.
        acc_sc: the unnormalised output [rows, K] in VMEM scratch.
    """
    m_prev = m_sc[...]
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
    p = jnp.exp(logits - lane_broadcast(m_next, logits.shape[1]))  # finite: tile 0 has a real slot
    alpha = jnp.exp(m_prev - m_next)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_next
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        NN_DIMS,
        preferred_element_type=jnp.float32,
        precision=mxu_precision(v.dtype),
    )
    acc_sc[...] = lane_broadcast(alpha, acc_sc.shape[1]) * acc_sc[...] + pv


def compiler_params(n_parallel: int):
    """Mosaic parameters of a 4-axis grid: n_parallel ``PARALLEL`` axes (split over megacore), then
    ``ARBITRARY`` (sequential) ones."""
    kinds = pltpu.GridDimensionSemantics
    semantics = (kinds.PARALLEL,) * n_parallel + (kinds.ARBITRARY,) * (4 - n_parallel)
    return pltpu.CompilerParams(dimension_semantics=semantics)


def softmax_scratch(n_rows: int, head_dim: int):
    """VMEM scratch of an online softmax over n_rows rows: m, l [rows, 128] and output [rows, K]."""
    return [
        pltpu.VMEM((n_rows, LANES), jnp.float32),
        pltpu.VMEM((n_rows, LANES), jnp.float32),
        pltpu.VMEM((n_rows, head_dim), jnp.float32),
    ]


class RowTile(NamedTuple):
    """A tile of the query rows of one KV head (rows g·head_rows .. (g+1)·head_rows − 1 belong to
    query head g).

    Fields:
        rows: the packed per-row array [br, 128].
        first_row: the index of its first row.
        head_rows: the rows of each query head.
        o_ref: the pass-1 outputs [br, K] (read by the ``KEY_KINDS``).
        chunk_scored: chunk_scored(c): whether the 8-row chunk c holds a weight.
    """

    rows: jax.Array
    first_row: int | jax.Array
    head_rows: int
    o_ref: Any
    chunk_scored: Callable[[jax.Array], jax.Array]


def add_row_scores(score: str, tile: KeyTile, row_tile: RowTile, col_ref, scratch):
    """Add Σ_t w_t · score(t, s) over the rows t of each query head g to row g of col_ref [Gp, bk].

    A = exp(z − m) / l with the final statistics; attn and obcache-value sum the rows of each head
    with a one-hot [Gp, br] matmul. The key terms need ‖v_s − o_t‖² and v_s·(v_s − o_t) for every
    (t, s): formed from the differences themselves, one query row at a time ([bk, K] on the VPU,
    reduced by ``row_sums``), over the 8-row chunks that score. scratch: [br, bk] float32 refs for
    their coefficients (one for obcache-key, two for obcache-joint).
    """
    rows, first_row, head_rows = row_tile.rows, row_tile.first_row, row_tile.head_rows
    (gp, bk), br = col_ref.shape, rows.shape[0]
    a = jnp.exp(tile.logits - lane(rows, MAX)) / lane(rows, SUM)
    wa = lane(rows, WEIGHT) * a
    # head of each row of the tile as a one-hot [Gp, br]: rows g·Tp .. (g+1)·Tp − 1 are head g's
    row_id = first_row + jax.lax.broadcasted_iota(jnp.int32, (gp, br), 1)
    head_start = jax.lax.broadcasted_iota(jnp.int32, (gp, br), 0) * head_rows
    one_hot = ((row_id >= head_start) & (row_id < head_start + head_rows)).astype(jnp.float32)

    def add_per_head(c):  # [br, bk] -> col rows: Σ over the rows of each head
        col_ref[...] += jax.lax.dot_general(
            one_hot,
            c,
            NN_DIMS,
            preferred_element_type=jnp.float32,
            precision=jax.lax.Precision.HIGHEST,
        )

    if score == "attn":
        add_per_head(wa)
        return
    vf = tile.values(jnp.float32)
    a2 = wa * a
    if score in VALUE_KINDS:
        add_per_head(a2 * row_sums(vf * vf))
    if score == "obcache-value":
        return
    z0 = jnp.where(tile.visible, tile.z, 0.0)
    c_dist_sc = scratch[0]
    c_dist_sc[...] = a2 * z0 * z0
    if score == "obcache-joint":
        scratch[1][...] = 2.0 * a2 * z0
    head = jax.lax.broadcasted_iota(jnp.int32, (gp, 1), 0)

    def chunk(c, carry):
        @pl.when(row_tile.chunk_scored(c))
        def _rows():
            start = pl.multiple_of(c * CHUNK, CHUNK)
            o_c = row_tile.o_ref[pl.ds(start, CHUNK), :]  # [8, K] float32
            c_dist = c_dist_sc[pl.ds(start, CHUNK), :]  # [8, bk]
            c_dot = scratch[1][pl.ds(start, CHUNK), :] if score == "obcache-joint" else None
            # the chunk's head (a chunk never straddles two heads: Tp % 16 == 0); lax.div, not //:
            # floor division of signed ints lowers through sign(), whose Mosaic rule asks for the
            # TPU generation
            g = jax.lax.div(first_row + start, head_rows)
            acc = jnp.zeros((1, bk), jnp.float32)
            for i in range(CHUNK):
                diff = vf - pick_row(o_c, i)  # [bk, K]: v_s − o_t, formed explicitly
                acc = acc + pick_row(c_dist, i) * row_sums(diff * diff)
                if c_dot is not None:
                    acc = acc + pick_row(c_dot, i) * row_sums(vf * diff)
            col_ref[...] += jnp.where(head == g, acc, 0.0)

        return carry

    jax.lax.fori_loop(0, br // CHUNK, chunk, 0)


def head_scores(score: str, tile: KeyTile, m_sc, l_sc, o_sc, n_heads: int):
    """Unweighted score(g, s) [Gp, bk] of one query per head g (rows ≥ n_heads are padding) from the
    final statistics m_sc, l_sc [Gp, 128] (lane-broadcast) and normalised outputs o_sc [Gp, K]; the
    key terms from the differences v_s − o_g themselves, one head row at a time."""
    bk = tile.logits.shape[1]
    a = jnp.exp(tile.logits - lane_broadcast(m_sc[...], bk)) / lane_broadcast(l_sc[...], bk)
    if score == "attn":
        return a
    vf = tile.values(jnp.float32)
    a2 = a * a
    total = jnp.zeros(a.shape, jnp.float32)
    if score in VALUE_KINDS:
        total = a2 * row_sums(vf * vf)
    if score in KEY_KINDS:
        z0 = jnp.where(tile.visible, tile.z, 0.0)
        o = o_sc[...]
        row = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
        dist = jnp.zeros(a.shape, jnp.float32)
        dots = jnp.zeros(a.shape, jnp.float32)
        for g in range(n_heads):
            diff = vf - pick_row(o, g)  # v_s − o_g, formed explicitly
            dist = jnp.where(row == g, row_sums(diff * diff), dist)
            if score == "obcache-joint":
                dots = jnp.where(row == g, row_sums(vf * diff), dots)
        total = total + a2 * z0 * z0 * dist
        if score == "obcache-joint":
            total = total + 2.0 * a2 * z0 * dots
    return total


# --- the wrappers' layout of query rows ---------------------------------------------------------


def row_tiles(T: int, G: int, block_q: int | None) -> tuple[int, int, int]:
    """(Tp, br, n_rows) of the block kernels: T rounded up to 16, the row tile (block_q rounded up
    to 16, default 512, at most G·Tp) and the rows of a KV head rounded up to whole tiles."""
    Tp = round_up(T, ROW_ALIGN)
    br = min(round_up(block_q or DEFAULT_BLOCK_ROWS, ROW_ALIGN), G * Tp)
    return Tp, br, round_up(G * Tp, br)  # rows past G·Tp belong to no head (position -1, weight 0)


def query_rows(q, query_pos, query_weights, n_kv_heads: int, Tp: int, n_rows: int):
    """(rows [B, Hk, n_rows, K], weights w [B, n_rows], packed per-row array [B, n_rows, 128] of
    positions and weights) of the block kernels: row g·Tp + t = (query head g, query t)."""
    B, T, H, K = q.shape
    G = H // n_kv_heads
    per_head = pad_axis(jnp.transpose(q.reshape(B, T, n_kv_heads, G, K), (0, 2, 3, 1, 4)), 3, Tp)
    rows = pad_axis(per_head.reshape(B, n_kv_heads, G * Tp, K), 2, n_rows)
    qpos = pad_axis(query_pos.astype(jnp.float32), 1, Tp, -1.0)
    qpos = pad_axis(jnp.tile(qpos, (1, G)), 1, n_rows, -1.0)
    w = (
        jnp.zeros((B, T), jnp.float32)
        if query_weights is None
        else query_weights.astype(jnp.float32)
    )
    w = pad_axis(jnp.tile(pad_axis(w, 1, Tp), (1, G)), 1, n_rows)
    ids = jnp.arange(LANES)
    row_vec = jnp.where(ids == POS, qpos[..., None], jnp.where(ids == WEIGHT, w[..., None], 0.0))
    return rows, w, row_vec


def from_rows(o, row_stats, T: int, G: int, dtype):
    """(out [B, T, H, K] in ``dtype``, lse [B, T, H], row statistics [B, Hk, G, T, 128]) from the
    block kernels' o [B, Hk, n_rows, K] and packed row statistics [B, Hk, n_rows, 128]."""
    B, Hk, _, K = o.shape
    Tp = round_up(T, ROW_ALIGN)

    def heads(x):  # [B, Hk, n_rows, N] -> [B, Hk, G, T, N]
        return x[:, :, : G * Tp].reshape(B, Hk, G, Tp, x.shape[-1])[:, :, :, :T]

    out = jnp.transpose(heads(o), (0, 3, 1, 2, 4)).reshape(B, T, Hk * G, K).astype(dtype)
    stats = heads(row_stats)
    lse = jnp.transpose(stats[..., MAX] + jnp.log(stats[..., SUM]), (0, 3, 1, 2))
    return out, lse.reshape(B, T, Hk * G), stats


def scored_rows(w, br: int):
    """(tile_nz, chunk_nz) int32, flattened over (row, tile) / (row, chunk) for scalar prefetch:
    whether each row tile of br rows / each 8-row chunk of w [B, n_rows] has a nonzero weight."""
    B, n_rows = w.shape
    tile_nz = jnp.any(w.reshape(B * (n_rows // br), br) != 0, axis=1).astype(jnp.int32)
    chunk_nz = jnp.any(w.reshape(B * n_rows // CHUNK, CHUNK) != 0, axis=1).astype(jnp.int32)
    return tile_nz, chunk_nz


def decode_rows(q, n_kv_heads: int):
    """(rows [B, Hk, Gp, K], Gp) of the decode kernels: T = 1, so the rows of a KV head are its G
    query heads, padded to a sublane tile (8 rows for float32, 16 for bfloat16)."""
    B, _, H, K = q.shape
    G = H // n_kv_heads
    gp = round_up(G, 8 if jnp.dtype(q.dtype).itemsize == 4 else 16)
    return pad_axis(q.reshape(B, n_kv_heads, G, K), 2, gp), gp


def decode_outputs(o, stats, G: int):
    """(out [B, 1, H, K], lse [B, 1, H], m, l [B, Hk, G]) from the decode kernels' o [B, Hk, Gp, K]
    and packed statistics [B, Hk, Gp, 128]."""
    B, Hk, _, K = o.shape
    out = o[:, :, :G].reshape(B, 1, Hk * G, K)
    m, l = stats[:, :, :G, MAX], stats[:, :, :G, SUM]
    return out, (m + jnp.log(l)).reshape(B, 1, Hk * G), m, l
