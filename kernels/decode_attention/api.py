"""``decode_attention_with_scores``: the implementation picked per platform, as
``block_attention.api`` (``jax.lax.platform_dependent``: XLA reference on CPU, Mosaic-TPU kernel on
TPU, Triton kernels on CUDA; impl overrides).

Where MomentKV's correction lives: its terms per query head (log n + q·k̄/√d and the estimate v̄ +
S̃ q/(n√d); ``reference.correction_terms``) are formed in the kernel, from the statistics it reads
(the head's [K, K] sums, which the residual norms read too; in every layer's moments, at the layer,
in place), and mixed into the kernel's float32 output in XLA (``reference.mixed_attention``: a few
elementwise operations per query head). Formed in XLA, the correction read a layer's sums as S̃ and
again in a product, beside the kernel's read and the eviction's update (docs/performance.md). Keys
stored rotated attend with a rotated query: there the correction stays in XLA, after the output is
rotated back. The correction mixes in float32 and rounds to the activation dtype once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from kvjax.kernels._shared import check_impl, check_score, check_shapes, every_layer, one_layer
from kvjax.kernels.block_attention.api import by_platform
from kvjax.kernels.decode_attention import gpu, reference, tpu
from kvjax.kernels.decode_attention.reference import (
    correctable,
    corrected_attention,
    fusable,
    mixed_attention,
)
from kvjax.kernels.moment_residuals import moment_residual_norms
from kvjax.kernels.moment_residuals.tiles import stats_read
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
    shared: bool,
):
    residuals = _residuals(moments if shared else residual_moments, residual_zeroth)
    norms = () if residuals is None else (_norms(k, v, residuals, layer, "xla"),)
    if layer is not None:
        k, v, moments = k[layer], v[layer], _at(moments, layer)
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


def _same(a, b) -> bool:
    """Whether two pytrees hold the very same arrays."""
    return all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _at(moments, layer):
    """One layer's statistics: every layer's at ``layer``, or ``moments`` if one layer's."""
    if moments is None or not every_layer(moments.count):
        return moments
    return jax.tree.map(lambda x: x[layer], moments)


def _norms(k, v, residuals, layer, impl, interpret=False):
    """MomentKV's residual norms in their own pass (``moment_residual_norms``, which takes one
    layer's statistics)."""
    moments, zeroth = residuals
    return moment_residual_norms(
        k, v, _at(moments, layer), zeroth, layer=layer, impl=impl, interpret=interpret
    )


def _check_moments(name: str, moments, layer_shape, n_layers, zeroth: bool) -> None:
    """Statistics with [B, Hk] counts (one layer's), or with ``layer`` also [L, B, Hk] (every
    layer's), and Σ v kᵀ of the keys' head dim unless only the zeroth order reads them."""
    if moments is None:
        return
    K = layer_shape.shape[-1]
    if not zeroth and moments.vk_sum.shape[-2:] != (K, K):
        raise ValueError(
            f"{name}: the first order reads Σ v kᵀ, vk_sum [..., {K}, {K}]; got "
            f"{list(moments.vk_sum.shape)} (a zeroth-order cache keeps none)"
        )
    one = tuple(layer_shape.shape[:2])
    allowed = [one] + ([(n_layers, *one)] if n_layers else [])
    if moments.count.shape not in allowed:
        raise ValueError(
            f"{name}: the statistics' count must be "
            + " or ".join(str(list(a)) for a in allowed)
            + f" (one layer's{', or every layer' if n_layers else ''}, as k and v); "
            f"got {list(moments.count.shape)}"
        )


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
    shared: bool,
    impl: str,
    interpret: bool,
):
    residuals = _residuals(moments if shared else residual_moments, residual_zeroth)
    fused = residuals is not None and fusable(q, k)
    in_kernel = moments is not None and correctable(k)
    stats = {}
    if fused:  # Σ v kᵀ unless every reader of these statistics is of the zeroth order
        m, stats["zeroth"] = residuals
        stats["residual_stats"] = stats_read(m, stats["zeroth"] and (zeroth or not shared))
    if in_kernel:  # the residual norms' statistics (passed once) when they are the same
        stats["correction_stats"] = (
            stats["residual_stats"] if fused and shared else stats_read(moments, zeroth)
        )
        stats["correction_zeroth"] = zeroth
    out, lse, col, *extra = kernel(
        rotate(q, k), k, v, slot_pos, query_pos, query_weights, layer=layer, **stats
    )
    norms = extra[:1] if fused else []
    if residuals is not None and not fused:  # their own pass (rotated keys: the reference)
        norms = [_norms(k, v, residuals, layer, impl, interpret)]
    out = rotate(out, k)  # back from k's stored domain
    if in_kernel:
        out = mixed_attention(out, lse, *extra[-2:])
    elif moments is not None:
        out = corrected_attention(out, lse, q, _at(moments, layer), zeroth)
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
        moments: MomentKV's ``Moments`` (count [B, Hk], k_sum, v_sum [B, Hk, K], vk_sum
            [B, Hk, K, K]; with ``layer``, also every layer's [L, ...], read at ``layer``) or
            None. The kernels read them in place and form the correction's terms
            (``reference.correction_terms``), unless the keys are stored rotated.
        zeroth: the zeroth-order correction (estimate v̄ only; vk_sum is not read, and may be of
            any shape: a zeroth-order cache keeps none).
        layer: an int32 scalar, the layer of stacked k, v (and of stacked moments) to attend
            over. The kernels read it in place (codes and scales alike); the XLA reference slices
            it out.
        residuals: (moments, zeroth) of MomentKV's moment-informed eviction, or None: then a
            fourth output, the residual norm of every slot under those statistics, as
            ``moment_residual_norms`` gives it; the moments as ``moments``. The kernels form the
            norms from the key and value tiles their softmax pass reads (the stored keys and
            values are read once for both); keys stored rotated, or read in another dtype than
            q's, run ``moment_residual_norms``.
        impl / interpret / block_k: as ``block_attention_with_scores``.

    Returns (out [B, 1, H, K] in q's dtype, lse [B, 1, H] float32 of the kept slots,
    col [B, Hk, G, S] float32 or None), then with ``residuals`` the norms [B, Hk, S] float32.
    """
    check_score(score)
    check_impl(impl)
    reference.check_decode(q)
    layer_shape = one_layer(k, v, layer)
    check_shapes(q, layer_shape, layer_shape, slot_pos, query_pos, query_weights)
    n_layers = None if layer is None else k.shape[0]
    _check_moments("moments", moments, layer_shape, n_layers, zeroth)
    _check_moments(
        "residuals",
        residuals and residuals[0],
        layer_shape,
        n_layers,
        bool(residuals and residuals[1]),
    )
    r_moments, r_zeroth = residuals or (None, False)
    # the same statistics for the residual norms and the correction: passed once
    shared = r_moments is not None and moments is not None and _same(r_moments, moments)
    r_moments = None if shared else r_moments
    flags = dict(zeroth=zeroth, residual_zeroth=r_zeroth, shared=shared)
    kernel = functools.partial(_corrected, **flags, impl=impl, interpret=interpret)
    tiles = {"score": score, "block_k": block_k}
    return by_platform(
        (q, k, v, slot_pos, query_pos, query_weights, moments, layer, r_moments),
        impl,
        q.shape[-1],
        xla=functools.partial(_reference, score=score, **flags),
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
