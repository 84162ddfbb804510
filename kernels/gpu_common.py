"""Pallas Triton pieces shared by the GPU kernels of ``block_attention``, ``decode_attention`` and
``paged_attention``: tile sizes and shape rules, masked tile loads, masked logits, the online
softmax over key tiles (and the dense softmax kernel built on it), the score pass of every score
kind, and the wrappers' query layout.

Triton programs are independent (no sequential grid axis, no VMEM scratch), so a pass loops over key
tiles inside the program, its statistics in registers. The Triton lowering has no ``slice`` of
values: rows are read from refs (``ref[t, :]``), never sliced out of a loaded tile. Every ``tl.dot``
dimension must be a power of two ≥ 16 (``MIN_DOT``).

Quantized keys and values arrive as a ``Quantized`` of refs (codes [.., S, K] — int4: [.., S, K/2]
bytes — and scales [.., S, 1]): ``load_values`` loads a tile's codes and scales alike and
dequantizes them in registers to the dtype the kernel computes in (q's).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from kvjax.kernels._shared import (
    KEY_KINDS,
    NEG_INF,
    NN_DIMS,
    NT_DIMS,
    VALUE_KINDS,
    dequantize_tile,
    next_pow2,
    pad_axis,
)
from kvjax.kernels.quantized import Quantized

DEFAULT_BLOCK_K = 64  # slots per key tile
DEFAULT_BLOCK_Q = 64  # queries per query tile
MIN_DOT = 16  # tl.dot needs every dimension ≥ 16
# Flash-decoding: the softmax pass's splits per (row, KV head), at least MIN_SPLITS and, when
# rows × KV heads are few, as many as make about SPLIT_PROGRAMS programs while each covers
# SPLIT_SLOTS slots or more (the rates that chose them: benchmarks/gpu/NOTES.md and
# docs/performance.md, "Figures that used to live in code comments").
MIN_SPLITS = 8
SPLIT_PROGRAMS = 256
SPLIT_SLOTS = 512


def supports(head_dim: int) -> bool:
    """Whether the Triton kernels take this head dim (a power of two ≥ 16: a ``tl.dot`` dim)."""
    return head_dim >= MIN_DOT and head_dim == next_pow2(head_dim)


def check_head_dim(head_dim: int) -> None:
    if not supports(head_dim):
        raise ValueError(f"head dim {head_dim} must be a power of two ≥ 16 for the Triton kernel")


def dot(a, b, dims):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def masked_logits(z, spos, qpos, slot, n_slots):
    """(logits, visible) with the reference's masking: invisible real slots -1e30, slots past
    ``n_slots`` -inf. Either z [R, bk], spos, slot [1, bk] and qpos [R, 1], or z, spos, slot [bk]
    and qpos a scalar."""
    real = slot < n_slots
    visible = real & (spos >= 0) & (spos <= qpos)
    return jnp.where(visible, z, jnp.where(real, jnp.float32(NEG_INF), -jnp.inf)), visible


def load_tile(ref, start, size: int, n_slots: int, other=0, head: tuple = ()):
    """Slots start .. start + size − 1 of a whole-head ref ([S, K] or [S]), or of the head at the
    leading indices ``head`` of a larger ref (one indexer: the Triton lowering takes no chain of
    them); slots past ``n_slots`` are not read (masked load) and come back as ``other``: the cache
    is never padded in HBM."""
    other = jnp.asarray(other, ref.dtype)  # a constant of the ref's: Triton casts no int to float8
    slot = start + jnp.arange(size, dtype=jnp.int32)
    mask = slot < n_slots
    if len(ref.shape) - len(head) == 2:
        return plgpu.load(
            ref.at[(*head, pl.ds(start, size), slice(None))], mask=mask[:, None], other=other
        )
    return plgpu.load(ref.at[(*head, pl.ds(start, size))], mask=mask, other=other)


def join_halves(low, high):
    """[bk, K/2] and [bk, K/2] -> [bk, K] (the int4 halves), as Triton takes it: stacked on a new
    last axis (``tl.join``, the only concatenation it lowers), then transposed and reshaped."""
    bk, half = low.shape
    return jnp.stack([low, high], -1).transpose(0, 2, 1).reshape(bk, 2 * half)


def load_values(ref, dtype, load: Callable):
    """Keys or values [bk, K], ``load(ref)``: of a ref as stored, or of both refs of a ``Quantized``
    (codes, scales [bk, 1]) dequantized to ``dtype``."""
    if isinstance(ref, Quantized):
        return dequantize_tile(load(ref.data), load(ref.scale), ref.kind, dtype, join_halves)
    return load(ref)


class KeyTile(NamedTuple):
    """A key tile of bk slots: keys and values as stored, or dequantized (``load_values``).

    Fields:
        k: keys [bk, K].
        spos: positions [bk].
        slot: slot indices [bk] (those ≥ n_slots are not real).
        n_slots: the number of real slots.
        v: values [bk, K] (None where the pass does not read them).
    """

    k: jax.Array
    spos: jax.Array
    slot: jax.Array
    n_slots: int | jax.Array
    v: jax.Array | None


def tile_logits(q, qpos, tile: KeyTile, scale: float):
    """(logits, visible, z) [R, bk] of the query rows q [R, K] (positions qpos [R]) on the tile."""
    z = dot(q, tile.k.astype(q.dtype), NT_DIMS) / scale
    logits, visible = masked_logits(
        z, tile.spos[None, :], qpos[:, None], tile.slot[None, :], tile.n_slots
    )
    return logits, visible, z


def online_softmax(q, qpos, tiles: Callable[[Any], KeyTile], start, stop, scale: float, store=None):
    """Online softmax of the query rows q [R, K] (positions qpos [R]) over the key tiles
    ``tiles(j)``, j = start .. stop − 1 (the first one starts with a real slot) -> (unnormalised
    output acc [R, K] float32, max m [R], sum l [R]); -inf, 0 and 0 for an empty range.
    ``store(j, tile, logits)``, if given, receives each tile and its masked logits [R, bk]."""

    def body(j, carry):
        acc, m, l = carry
        tile = tiles(j)
        logits, _, _ = tile_logits(q, qpos, tile, scale)
        if store is not None:
            store(j, tile, logits)
        m_next = jnp.maximum(m, jnp.max(logits, axis=1))  # finite from the first tile on
        p = jnp.exp(logits - m_next[:, None])
        alpha = jnp.exp(m - m_next)
        pv = dot(p.astype(tile.v.dtype), tile.v, NN_DIMS)
        return alpha[:, None] * acc + pv, m_next, alpha * l + jnp.sum(p, axis=1)

    bq, head_dim = q.shape
    init = (
        jnp.zeros((bq, head_dim), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    return jax.lax.fori_loop(start, stop, body, init)


def dense_tile(
    k_ref, v_ref, spos_ref, start, size: int, n_slots: int, dtype, head: tuple = ()
) -> KeyTile:
    """The ``KeyTile`` of slots start .. start + size − 1 of whole-head refs k_ref, v_ref [S, K] (or
    ``Quantized`` of refs, dequantized to ``dtype``; no V when v_ref is None; with ``head``, the
    head at those leading indices of k_ref and v_ref) and spos_ref [S], by masked loads
    (``load_tile``)."""

    def load(ref):
        return load_tile(ref, start, size, n_slots, head=head)

    k = load_values(k_ref, dtype, load)
    spos = load_tile(spos_ref, start, size, n_slots, -1)
    v = None if v_ref is None else load_values(v_ref, dtype, load)
    return KeyTile(k, spos, start + jnp.arange(size, dtype=jnp.int32), n_slots, v)


def softmax_kernel(
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
    n_slots: int,
    block_k: int,
    n_tiles: int,
    scale: float,
    split_axis: int | None = None,
    head: tuple = (),
    z_rows: int = 0,
    after_tile: Callable[[Any, KeyTile], None] | None = None,
    o_rows: int | None = None,
):
    """Online softmax of a tile of query rows over ``n_tiles`` key tiles of the whole-head refs
    k_ref, v_ref [S, K] (or ``Quantized`` of refs; or their head at the leading indices ``head``)
    and spos_ref [S]: from slot 0, or — with split_axis — from the split chosen by that grid axis
    (n_tiles tiles per split; every split starts with a real slot). Writes the normalised o and m,
    l, and, given z_ref [R, ≥ S], the masked logits of the first ``z_rows`` rows at each tile's
    slots; ``after_tile(start, tile)``, if given, receives each tile and its first slot. With
    ``o_rows``, o's rows from that one on are not written (padding rows that nothing reads)."""
    offset = 0 if split_axis is None else pl.program_id(split_axis) * (n_tiles * block_k)

    def tile(j):
        start = offset + j * block_k
        return dense_tile(k_ref, v_ref, spos_ref, start, block_k, n_slots, q_ref.dtype, head)

    def store(j, tile, logits):
        start = offset + j * block_k
        if z_ref is not None:
            rows = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 0) < z_rows
            plgpu.store(z_ref.at[:, pl.ds(start, block_k)], logits, mask=rows)
        if after_tile is not None:
            after_tile(start, tile)

    acc, m, l = online_softmax(
        q_ref[...],
        qpos_ref[...],
        tile,
        0,
        n_tiles,
        scale,
        None if z_ref is None and after_tile is None else store,
    )
    o = acc / l[:, None]
    if o_rows is None:
        o_ref[...] = o
    else:
        plgpu.store(o_ref, o, mask=jax.lax.broadcasted_iota(jnp.int32, o.shape, 0) < o_rows)
    m_ref[...] = m
    l_ref[...] = l


class QueryRefs(NamedTuple):
    """The query side of a scores kernel.

    Fields:
        q: [R, K].
        qpos: positions [R].
        w: weights [R] (None for decode).
        o: the pass-1 outputs [R, K].
        m, l: the pass-1 statistics [R].
    """

    q: Any
    qpos: Any
    w: Any
    o: Any
    m: Any
    l: Any


def column_scores(
    score: str, tile: KeyTile, rows: QueryRefs, *, n_queries: int, block_q: int, scale: float
):
    """Σ_t w_t · score(t, s) [bk] over the queries t of one query head: attn and obcache-value from
    [block_q, bk] weight tiles (tiles without weight skipped with a ``cond``); the key terms one
    scoring query at a time, from the differences v_s − o_t themselves ([bk, K] per query)."""
    bk = tile.k.shape[0]
    vf = None if tile.v is None else tile.v.astype(jnp.float32)
    v_sq = jnp.sum(vf * vf, axis=1) if score in VALUE_KINDS else None

    if score in ("attn", "obcache-value"):

        def q_tile(i, col):
            start = pl.multiple_of(i * block_q, block_q)
            w = rows.w[pl.ds(start, block_q)]

            def compute():
                part = pl.ds(start, block_q)
                logits, _, _ = tile_logits(rows.q[part, :], rows.qpos[part], tile, scale)
                a = jnp.exp(logits - rows.m[part][:, None]) / rows.l[part][:, None]
                wa = w[:, None] * a
                if score == "attn":
                    return col + jnp.sum(wa, axis=0)
                return col + jnp.sum(wa * a, axis=0) * v_sq

            return jax.lax.cond(jnp.max(jnp.abs(w)) > 0, compute, lambda: col)

        n_tiles = rows.q.shape[0] // block_q
        return jax.lax.fori_loop(0, n_tiles, q_tile, jnp.zeros((bk,), jnp.float32))

    kf = tile.k.astype(jnp.float32)

    def row(t, col):
        w_t = rows.w[t]

        def compute():
            z = jnp.sum(rows.q[t, :].astype(jnp.float32)[None, :] * kf, axis=1) / scale  # [bk]
            logits, visible = masked_logits(z, tile.spos, rows.qpos[t], tile.slot, tile.n_slots)
            a = jnp.exp(logits - rows.m[t]) / rows.l[t]
            z0 = jnp.where(visible, z, 0.0)
            a2 = w_t * a * a
            diff = vf - rows.o[t, :][None, :]  # v_s − o_t, formed explicitly
            total = a2 * z0 * z0 * jnp.sum(diff * diff, axis=1)
            if score == "obcache-joint":
                total = total + a2 * v_sq + 2.0 * a2 * z0 * jnp.sum(vf * diff, axis=1)
            return col + total

        return jax.lax.cond(w_t != 0, compute, lambda: col)

    return jax.lax.fori_loop(0, n_queries, row, jnp.zeros((bk,), jnp.float32))


def head_scores(score: str, tile: KeyTile, rows: QueryRefs, *, n_heads: int, scale: float):
    """Unweighted score(g, s) [Gp, bk] of one query per head g (rows ≥ n_heads are padding); the key
    terms from the differences v_s − o_g themselves, one head row at a time."""
    logits, visible, z = tile_logits(rows.q[...], rows.qpos[...], tile, scale)
    a = jnp.exp(logits - rows.m[...][:, None]) / rows.l[...][:, None]
    if score == "attn":
        return a
    vf = tile.v.astype(jnp.float32)
    a2 = a * a
    total = jnp.zeros(a.shape, jnp.float32)
    if score in VALUE_KINDS:
        total = a2 * jnp.sum(vf * vf, axis=1)[None, :]
    if score in KEY_KINDS:
        z0 = jnp.where(visible, z, 0.0)
        row = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
        dist = jnp.zeros(a.shape, jnp.float32)
        dots = jnp.zeros(a.shape, jnp.float32)
        for g in range(n_heads):
            diff = vf - rows.o[g, :][None, :]  # v_s − o_g, formed explicitly
            dist = jnp.where(row == g, jnp.sum(diff * diff, axis=1)[None, :], dist)
            if score == "obcache-joint":
                dots = jnp.where(row == g, jnp.sum(vf * diff, axis=1)[None, :], dots)
        total = total + a2 * z0 * z0 * dist
        if score == "obcache-joint":
            total = total + 2.0 * a2 * z0 * dots
    return total


# --- the wrappers' query layout ------------------------------------------------------------------


def query_tile(T: int, block_q: int | None) -> int:
    """The query tile: block_q (default 64) rounded up to a power of two ≥ 16, at most T so."""
    return min(max(MIN_DOT, next_pow2(block_q or DEFAULT_BLOCK_Q)), max(MIN_DOT, next_pow2(T)))


def block_queries(q, query_pos, n_kv_heads: int, Tp: int):
    """(rows [B, Hk, G, Tp, K], positions [B, Tp] int32, -1 past T) of the block kernels."""
    B, T, H, K = q.shape
    per_head = q.reshape(B, T, n_kv_heads, H // n_kv_heads, K)
    rows = pad_axis(jnp.transpose(per_head, (0, 2, 3, 1, 4)), 3, Tp)
    return rows, pad_axis(query_pos.astype(jnp.int32), 1, Tp, -1)


def block_outputs(o, m, l, T: int, dtype):
    """(out [B, T, H, K] in ``dtype``, lse [B, T, H]) from o [B, Hk, G, Tp, K] and m, l
    [B, Hk, G, Tp]."""
    B, Hk, G, _, K = o.shape
    out = jnp.transpose(o[:, :, :, :T], (0, 3, 1, 2, 4)).reshape(B, T, Hk * G, K).astype(dtype)
    lse = jnp.transpose(m[..., :T] + jnp.log(l[..., :T]), (0, 3, 1, 2)).reshape(B, T, Hk * G)
    return out, lse


def decode_queries(q, query_pos, n_kv_heads: int):
    """(rows [B, Hk, Gp, K], positions [B, Gp] int32, Gp) of the decode kernels: T = 1, so the rows
    of a KV head are its G query heads, padded to Gp, a power of two ≥ 16 (``tl.dot``'s minimum)."""
    B, _, H, K = q.shape
    G = H // n_kv_heads
    gp = max(MIN_DOT, next_pow2(G))
    rows = pad_axis(q.reshape(B, n_kv_heads, G, K), 2, gp)
    return rows, jnp.broadcast_to(query_pos.astype(jnp.int32).reshape(B, 1), (B, gp)), gp


def decode_splits(rows_heads: int, n_slots: int, splits: int | None = None) -> int:
    """The softmax pass's splits per (row, KV head) of a decode step over ``rows_heads`` rows × KV
    heads of ``n_slots`` slots each: ``splits`` if given, else max(MIN_SPLITS,
    min(⌈SPLIT_PROGRAMS / rows_heads⌉, n_slots // SPLIT_SLOTS)). The caller caps it at its number of
    key tiles or pages."""
    if splits:
        return splits
    return max(MIN_SPLITS, min(-(-SPLIT_PROGRAMS // rows_heads), n_slots // SPLIT_SLOTS))


def merge_splits(o_part, m_part, l_part, m, l=None):
    """Merge the flash-decoding partials o [B, Hk, splits, Gp, K], m, l [B, Hk, splits, Gp] at the
    final max m [B, Hk, Gp] (an empty split has m = -inf, l = 0): (o, l) with
    l = (``l`` if given) + Σ_s l_s e^(m_s − m) and o = Σ_s o_s l_s e^(m_s − m) / l."""
    scaled = l_part * jnp.exp(m_part - m[:, :, None])
    total = jnp.sum(scaled, axis=2)
    l = total if l is None else l + total
    return jnp.sum(o_part * scaled[..., None], axis=2) / l[..., None], l


def decode_outputs(o, m, l, G: int):
    """(out [B, 1, H, K], lse [B, 1, H]) from o [B, Hk, Gp, K] and m, l [B, Hk, Gp]."""
    B, Hk, _, K = o.shape
    lse = m[:, :, :G] + jnp.log(l[:, :, :G])
    return o[:, :, :G].reshape(B, 1, Hk * G, K), lse.reshape(B, 1, Hk * G)
