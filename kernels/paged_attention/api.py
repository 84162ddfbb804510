"""``paged_block_attention_with_scores`` / ``paged_decode_attention_with_scores``: the
implementation picked per platform exactly as ``block_attention.api`` does
(``jax.lax.platform_dependent``: the XLA reference on CPU, the Mosaic-TPU kernels on TPU, the Triton
kernels on CUDA; impl="xla" / "pallas" / "pallas_tpu" / "pallas_gpu" as there). A platform whose
paged kernel does not take the head dim and page size (TPU: head dim ≤ 128 or a multiple of 128, P ∈
{16, 32, 64} or a multiple of 128 — {32, 64} or a multiple of 128 for quantized pools; GPU: both
powers of two ≥ 16) runs the reference there; asking for that kernel by name raises a ValueError
saying why.

Decode applies MomentKV's correction after the kernel, in XLA, as ``decode_attention.api`` (the
reasons are given there).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from kvjax.kernels._shared import check_impl, check_score
from kvjax.kernels.block_attention.api import by_platform
from kvjax.kernels.decode_attention.reference import check_decode, corrected_attention
from kvjax.kernels.paged_attention import gpu, reference, tpu
from kvjax.kernels.paged_attention.reference import check_paged_shapes
from kvjax.kernels.quantized import kind_of, rotate


def _by_platform(
    args, impl, head_dim: int, page_size: int, kind, xla, tpu_kernel, gpu_kernel, interpreted
):
    """``by_platform`` with the paged kernels' shape rules: a kernel that does not take (head dim,
    page size) for pools of ``kind`` gives way to the reference, unless asked for by name (it then
    raises)."""
    tpu_ok, gpu_ok = tpu.supports(head_dim, page_size, kind), gpu.supports(head_dim, page_size)
    return by_platform(
        args,
        impl,
        head_dim,
        xla,
        tpu_kernel if tpu_ok or impl == "pallas_tpu" else xla,
        gpu_kernel if gpu_ok or impl == "pallas_gpu" else xla,
        interpreted if tpu_ok else xla,
    )


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
    *,
    impl: str | None = None,
    interpret=False,
    block_k: int | None = None,
    block_q: int | None = None,
):
    """Grouped-query attention of a block of queries over a paged cache, its log-sum-exp and
    per-slot eviction scores in logical slot order.

    Args:
        q: [B, T, H, K] (float32 or bfloat16).
        k_pages, v_pages: [B, N, P, K]: each row's pool of N pages of P slots; arrays, or
            ``Quantized`` of one kind (codes and scales paged alike, dequantized to q's dtype).
        page_table: [B, Hk, M] int32 in [0, N): logical slot s of KV head h is
            k_pages[b, page_table[b, h, s // P], s % P].
        n_pages: [B, Hk] int32 in [0, M]: pages in use per head (later table entries are never
            read).
        slot_pos: [B, Hk, M·P] int32 (-1 = empty).
        query_pos: [B, T].
        query_weights: [B, T] float32 or None.
        score: as ``block_attention_with_scores``.
        block_k: logical slots per key block of the TPU kernels (rounded up to whole pages and a
            multiple of 128; the Triton kernels take one page per step).
        block_q: query tile, as the dense kernels.
        interpret: run the chosen Pallas kernel under the interpreter (True; or a
            ``pltpu.InterpretParams`` for the TPU one).

    Returns (out [B, T, H, K] in q's dtype, lse [B, T, H] float32, col [B, Hk, G, M·P] float32 or
    None) — the semantics of ``reference.paged_block_attention_with_scores``.
    """
    check_score(score)
    check_impl(impl)
    check_paged_shapes(q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights)
    tpu_tiles = {"score": score, "block_k": block_k, "block_q": block_q}
    out, lse, col = _by_platform(
        (
            rotate(q, k_pages),
            k_pages,
            v_pages,
            page_table,
            n_pages,
            slot_pos,
            query_pos,
            query_weights,
        ),
        impl,
        q.shape[-1],
        k_pages.shape[2],
        kind_of(k_pages),
        xla=functools.partial(reference.paged_block_attention_with_scores, score=score),
        tpu_kernel=functools.partial(
            tpu.paged_block_attention_tpu, interpret=interpret, **tpu_tiles
        ),
        gpu_kernel=functools.partial(
            gpu.paged_block_attention_gpu, score=score, block_q=block_q, interpret=bool(interpret)
        ),
        interpreted=functools.partial(tpu.paged_block_attention_tpu, interpret=True, **tpu_tiles),
    )
    return rotate(out, k_pages), lse, col  # back from the pages' stored domain


def _reference(*args, score: str, zeroth: bool):
    *inputs, moments = args
    q, k_pages = inputs[:2]
    if rotate(q, k_pages) is q:
        return reference.paged_decode_attention_with_scores(*inputs, score, moments, zeroth)
    # rotated keys and values: attend in their stored domain, correct in the values' own
    out, lse, col = reference.paged_decode_attention_with_scores(
        rotate(q, k_pages), *inputs[1:], score
    )
    out = rotate(out.astype(jnp.float32), k_pages)
    if moments is not None:
        out = corrected_attention(out, lse, q, moments, zeroth)
    return out.astype(q.dtype), lse, col


def _corrected(kernel, *args, zeroth: bool):
    """kernel(*args without moments, q in the pages' stored domain), then MomentKV's correction of
    its float32 output rotated back."""
    *inputs, moments = args
    q, k_pages = inputs[:2]
    out, lse, col = kernel(rotate(q, k_pages), *inputs[1:])
    out = rotate(out, k_pages)
    if moments is not None:
        out = corrected_attention(out, lse, q, moments, zeroth)
    return out.astype(q.dtype), lse, col


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
    *,
    impl: str | None = None,
    interpret=False,
    block_k: int | None = None,
):
    """Attention of one query per sequence (T = 1) over a paged cache, with eviction scores and,
    when ``moments`` is given, MomentKV's normalization-corrected output.

    Args:
        q: [B, 1, H, K].
        k_pages, v_pages, page_table, n_pages, slot_pos: the paged cache as
            ``paged_block_attention_with_scores``.
        query_pos: [B, 1].
        query_weights: [B, 1] float32 or None.
        moments: one layer's count [B, Hk], k_sum, v_sum [B, Hk, K], vk_sum [B, Hk, K, K]
            (``kvjax.cache.dense.Moments``) or None.
        zeroth: the zeroth-order correction.
        impl / interpret / block_k: as ``paged_block_attention_with_scores``.

    Returns (out [B, 1, H, K] in q's dtype, lse [B, 1, H] float32 of the kept slots,
    col [B, Hk, G, M·P] float32 or None).
    """
    check_score(score)
    check_impl(impl)
    check_decode(q)
    check_paged_shapes(q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights)
    kernel = functools.partial(_corrected, zeroth=zeroth)
    tpu_kernel = functools.partial(tpu.paged_decode_attention_tpu, score=score, block_k=block_k)
    return _by_platform(
        (q, k_pages, v_pages, page_table, n_pages, slot_pos, query_pos, query_weights, moments),
        impl,
        q.shape[-1],
        k_pages.shape[2],
        kind_of(k_pages),
        xla=functools.partial(_reference, score=score, zeroth=zeroth),
        tpu_kernel=functools.partial(kernel, functools.partial(tpu_kernel, interpret=interpret)),
        gpu_kernel=functools.partial(
            kernel,
            functools.partial(
                gpu.paged_decode_attention_gpu, score=score, interpret=bool(interpret)
            ),
        ),
        interpreted=functools.partial(kernel, functools.partial(tpu_kernel, interpret=True)),
    )
