"""Reference of paged attention with eviction scores: each KV head's pages gathered into the dense
layout, then the dense references (``block_attention.reference``, ``decode_attention.reference``).

Layout, per batch row b: a pool of N pages of P slots, k_pages / v_pages [B, N, P, K] (every layer's
and head's pages live in it); per KV head h a page table [B, Hk, M] int32 in [0, N) and a count
n_pages [B, Hk] in [0, M]. Logical slot s (0 ≤ s < M·P) of head h is k_pages[b,
page_table[b, h, s // P], s % P] while s // P < n_pages[b, h]; the slots of the pages past n_pages
are *unused*: empty (position -1) and holding zeros, whatever their table entries name (often page
0, possibly another head's page or garbage — never read). slot_pos [B, Hk, M·P] holds the original
position of each logical slot (-1 = empty; empty slots also occur inside used pages, e.g. the tail
of the last one).

So the paged semantics are the dense ones on S = M·P slots, an unused slot being an empty slot with
zero key and value. The difference shows only for a query that sees no slot at all
(a fully masked row): as in the dense reference it spreads its weight uniformly over all M·P slots,
unused ones included — the kernels count those without reading them (``with_unread_slots``,
``fill_unused_pages``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from kvjax.kernels._shared import NEG_INF, check_kv, check_score, check_shapes, logical
from kvjax.kernels.block_attention.reference import block_attention_with_scores
from kvjax.kernels.decode_attention.reference import (
    check_decode,
    decode_attention_with_scores,
)


def check_paged_shapes(
    q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights
) -> tuple[int, int, int, int, int, int, int]:
    """(B, T, H, Hk, M, P, K) after checking that the shapes agree — the pools arrays or
    ``Quantized`` of one kind, of logical shape [B, N, P, K] —; raises ValueError otherwise."""
    check_kv(k_pages, v_pages, "k_pages, v_pages")
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"k_pages, v_pages must be [B, N, P, K]; got {k_pages.shape}, {v_pages.shape}"
        )
    if page_table.ndim != 3 or page_table.shape[0] != k_pages.shape[0]:
        raise ValueError(
            f"page_table must be [B, Hk, M]; got {page_table.shape} for pages {k_pages.shape}"
        )
    B, Hk, M = page_table.shape
    P, K = k_pages.shape[2:]
    if n_pages.shape != (B, Hk):
        raise ValueError(f"n_pages must be [B, Hk] = {(B, Hk)}; got {n_pages.shape}")
    # the dense checks on the logical layout: k, v [B, Hk, M·P, K]
    dense = logical(k_pages, (B, Hk, M * P, K))
    _, T, H, _, _, _ = check_shapes(q, dense, dense, slot_pos, query_pos, query_weights)
    return B, T, H, Hk, M, P, K


def used_slots(n_pages: jax.Array, n_table: int, page_size: int) -> jax.Array:
    """[B, Hk, M·P] bool: the logical slot lies in a used page (page index < n_pages)."""
    return jnp.arange(n_table * page_size, dtype=jnp.int32) < (n_pages * page_size)[..., None]


def gather_pages(k_pages, v_pages, page_table, n_pages, slot_pos):
    """The dense layout of the paged cache: (k, v [B, Hk, M·P, K], slot_pos [B, Hk, M·P]) with the
    slots of unused pages empty (position -1) and zero (their pages may hold anything, NaN
    included). ``Quantized`` pools give ``Quantized`` k, v (codes and scales gathered alike; zero
    codes and scales at unused slots)."""
    B, Hk, M = page_table.shape
    P = k_pages.shape[2]
    used = used_slots(n_pages, M, P)

    def gather(pages):  # pages[b, page_table[b, h]] -> [B, Hk, M·P, width]
        # a gather per row (vmapped, so that a batch split over devices gathers locally)
        dense = jax.vmap(lambda row, table: row[table])(pages, page_table)
        dense = dense.reshape(B, Hk, M * P, pages.shape[-1])
        return jnp.where(used[..., None], dense, jnp.zeros((), pages.dtype))

    k, v = jax.tree.map(gather, k_pages), jax.tree.map(gather, v_pages)
    return k, v, jnp.where(used, slot_pos, -1)


def paged_block_attention_with_scores(
    q,
    k_pages,
    v_pages,
    page_table,
    n_pages,
    slot_pos,
    query_pos,
    query_weights=None,
    score: str = "attn",
):
    """``block_attention_with_scores`` on ``gather_pages``' layout.

    Args:
        q: [B, T, H, K].
        k_pages, v_pages: [B, N, P, K], arrays or ``Quantized`` of one kind (dequantized to q's
            dtype).
        page_table: [B, Hk, M] int32.
        n_pages: [B, Hk] int32.
        slot_pos: [B, Hk, M·P] int32 (-1 = empty).
        query_pos: [B, T] int32.
        query_weights: [B, T] float32 or None.

    Returns (out [B, T, H, K] in q's dtype, lse [B, T, H] float32, col [B, Hk, G, M·P] float32 in
    logical slot order, or None).
    """
    check_score(score)
    check_paged_shapes(q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights)
    k, v, spos = gather_pages(k_pages, v_pages, page_table, n_pages, slot_pos)
    return block_attention_with_scores(q, k, v, spos, query_pos, query_weights, score)


def paged_decode_attention_with_scores(
    q,
    k_pages,
    v_pages,
    page_table,
    n_pages,
    slot_pos,
    query_pos,
    query_weights=None,
    score: str = "attn",
    moments=None,
    zeroth: bool = False,
):
    """``paged_block_attention_with_scores`` at T = 1 (q [B, 1, H, K]), then MomentKV's correction
    when ``moments`` (one layer's count [B, Hk], k_sum, v_sum [B, Hk, K], vk_sum [B, Hk, K, K]) is
    given — as ``decode_attention.reference.decode_attention_with_scores`` on ``gather_pages``'
    layout."""
    check_decode(q)
    check_paged_shapes(q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights)
    k, v, spos = gather_pages(k_pages, v_pages, page_table, n_pages, slot_pos)
    return decode_attention_with_scores(
        q, k, v, spos, query_pos, query_weights, score, moments, zeroth
    )


# --- what the kernels share: unused slots counted without being read -----------------------------


def with_unread_slots(m, l, n_unread):
    """Online-softmax statistics of the slots read — running max m and sum l, float32, any shape —
    extended by ``n_unread`` (int, broadcastable) slots of logit NEG_INF and value 0: the unused
    pages' slots. Returns (m, l, alpha), the accumulated output to be scaled by alpha. A row with
    nothing read (m = -inf) gets m = NEG_INF, l = n_unread, alpha = 0, as the reference's uniform
    weights over masked slots."""
    floor = jnp.where(n_unread > 0, jnp.float32(NEG_INF), -jnp.inf)
    m_all = jnp.maximum(m, floor)
    alpha = jnp.exp(m - m_all)
    return (
        m_all,
        alpha * l + jnp.asarray(n_unread).astype(jnp.float32) * jnp.exp(NEG_INF - m_all),
        alpha,
    )


def fill_unused_pages(col, n_pages, page_size: int, score: str, m, l, query_weights):
    """col [B, Hk, G, M·P] from a kernel (anything at the slots of unused pages) with those slots
    set to the reference's value: 0, except for "attn" with a weighted query that sees no slot at
    all, which puts A = exp(NEG_INF − m) / l on every slot.

    Args:
        m, l: [B, Hk, G, T]: the final statistics (``with_unread_slots``).
        query_weights: [B, T].
    """
    B, Hk, G, S = col.shape
    fill = jnp.zeros((B, Hk, G), jnp.float32)
    if score == "attn":
        fill = jnp.einsum(
            "bt,bhgt->bhg", query_weights.astype(jnp.float32), jnp.exp(NEG_INF - m) / l
        )
    return jnp.where(
        used_slots(n_pages, S // page_size, page_size)[:, :, None], col, fill[..., None]
    )
