"""``decode_attention_with_scores``: the implementation picked per platform, as
``block_attention.api`` (``jax.lax.platform_dependent``: XLA reference on CPU, Mosaic-TPU kernel on
TPU, Triton kernels on CUDA; impl overrides).

Where MomentKV's correction lives: after the kernel, in XLA (``reference.corrected_attention``),
applied to the kernel's float32 output and lse. It is O(B·H·K²) work on O(B·Hk·K²) data (S̃ is
[K, K] per KV head), independent of the cache length, so fusing it into the kernel would save no HBM
traffic that matters — the kernel would have to read the same [K, K] sums — while the matrix-vector
product and the clamp of S̃ are what XLA fuses well on TPU and GPU alike. It also keeps one kernel
per platform for every scorer, and the correction is the very code the reference runs. The kernel's
output is float32, so the correction mixes in float32 and rounds to the activation dtype once.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from kvjax.kernels._shared import check_impl, check_score, check_shapes, one_layer
from kvjax.kernels.block_attention.api import by_platform
from kvjax.kernels.decode_attention import gpu, reference, tpu
from kvjax.kernels.decode_attention.reference import corrected_attention, fusable
from kvjax.kernels.moment_residuals import moment_residual_norms
from kvjax.kernels.quantized import rotate


def _reference(
    q,
    k,
    v,
    slot_pos,
    query_pos,
    query_weights,
    moments,
    layer,
    residual_moments,
    *,
    score: str,
    zeroth: bool,
    residual_zeroth: bool,
):
    residuals = _residuals(residual_moments, residual_zeroth)
    norms = () if residuals is None else (_norms(k, v, residuals, layer, "xla"),)
    if layer is not None:
        k, v = k[layer], v[layer]
    if rotate(q, k) is q:
        return *reference.decode_attention_with_scores(
            q, k, v, slot_pos, query_pos, query_weights, score, moments, zeroth
        ), *norms
    # rotated keys and values: attend in their stored domain, correct in the values' own
    out, lse, col = reference.decode_attention_with_scores(
        rotate(q, k), k, v, slot_pos, query_pos, query_weights, score
    )
    out = rotate(out.astype(jnp.float32), k)
    if moments is not None:
        out = corrected_attention(out, lse, q, moments, zeroth)
    return out.astype(q.dtype), lse, col, *norms


def _residuals(moments, zeroth: bool) -> tuple | None:
    """The ``residuals`` argument from its traced and static parts."""
    return None if moments is None else (moments, zeroth)


def _norms(k, v, residuals, layer, impl, interpret=False):
    """MomentKV's residual norms in their own pass (``moment_residual_norms``)."""
    moments, zeroth = residuals
    return moment_residual_norms(k, v, moments, zeroth, layer=layer, impl=impl, interpret=interpret)


def _corrected(
    kernel,
    q,
    k,
    v,
    slot_pos,
    query_pos,
    query_weights,
    moments,
    layer,
    residual_moments,
    *,
    zeroth: bool,
    residual_zeroth: bool,
    impl: str,
    interpret: bool,
):
    residuals = _residuals(residual_moments, residual_zeroth)
    fused = residuals is not None and fusable(q, k)
    stats = {}
    if fused:
        m, stats["zeroth"] = residuals
        stats["residual_stats"] = (m.count, m.k_sum, m.v_sum, m.vk_sum)
    out, lse, col, *norms = kernel(
        rotate(q, k), k, v, slot_pos, query_pos, query_weights, layer=layer, **stats
    )
    if residuals is not None and not fused:  # their own pass (rotated keys: the reference)
        norms = [_norms(k, v, residuals, layer, impl, interpret)]
    out = rotate(out, k)  # back from k's stored domain
    if moments is not None:
        out = corrected_attention(out, lse, q, moments, zeroth)
    return out.astype(q.dtype), lse, col, *norms


def decode_attention_with_scores(
    q,
    k,
    v,
    slot_pos,
    query_pos,
    query_weights=None,
    score: str = "attn",
    moments=None,
    zeroth: bool = False,
    *,
    layer=None,
    residuals: tuple | None = None,
    impl: str | None = None,
    interpret=False,
    block_k: int | None = None,
):
    """Attention of one query per sequence (T = 1) over cache slots, with eviction scores and, when
    ``moments`` is given, MomentKV's normalization-corrected output.

    Args:
        q: [B, 1, H, K].
        k, v: [B, Hk, S, K], or with ``layer`` the stacked [L, B, Hk, S, K] of every layer; arrays
            or ``Quantized`` of one kind, as ``block_attention_with_scores``.
        slot_pos: [B, Hk, S] int32 (-1 = empty).
        query_pos: [B, 1] int32.
        query_weights: [B, 1] float32 or None.
        score: as ``block_attention_with_scores``.
        moments: one layer's ``kvjax.cache.dense.Moments`` (count [B, Hk], k_sum, v_sum [B, Hk, K],
            vk_sum [B, Hk, K, K]) or None.
        zeroth: the zeroth-order correction (estimate v̄ only).
        layer: an int32 scalar, the layer of stacked k, v to attend over. The kernels read it in
            place (codes and scales alike); the XLA reference slices it out.
        residuals: (moments, zeroth) of MomentKV's moment-informed eviction, or None: then a
            fourth output, the residual norm of every slot under those statistics, as
            ``moment_residual_norms`` gives it. The kernels form it from the key and value tiles
            their softmax pass reads (the stored keys and values are read once for both); keys
            stored rotated, or read in another dtype than q's, run ``moment_residual_norms``.
        impl / interpret / block_k: as ``block_attention_with_scores``.

    Returns (out [B, 1, H, K] in q's dtype, lse [B, 1, H] float32 of the kept slots,
    col [B, Hk, G, S] float32 or None), then with ``residuals`` the norms [B, Hk, S] float32.
    """
    check_score(score)
    check_impl(impl)
    reference.check_decode(q)
    layer_shape = one_layer(k, v, layer)
    check_shapes(q, layer_shape, layer_shape, slot_pos, query_pos, query_weights)
    r_moments, r_zeroth = residuals or (None, False)
    kernel = functools.partial(
        _corrected, zeroth=zeroth, residual_zeroth=r_zeroth, impl=impl, interpret=interpret
    )
    tiles = {"score": score, "block_k": block_k}
    return by_platform(
        (q, k, v, slot_pos, query_pos, query_weights, moments, layer, r_moments),
        impl,
        q.shape[-1],
        xla=functools.partial(_reference, score=score, zeroth=zeroth, residual_zeroth=r_zeroth),
        tpu_kernel=functools.partial(
            kernel, functools.partial(tpu.decode_attention_tpu, interpret=interpret, **tiles)
        ),
        gpu_kernel=functools.partial(
            kernel, functools.partial(gpu.decode_attention_gpu, interpret=interpret, **tiles)
        ),
        interpreted=functools.partial(
            kernel, functools.partial(tpu.decode_attention_tpu, interpret=True, **tiles)
        ),
    )
