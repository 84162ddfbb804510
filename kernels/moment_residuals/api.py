"""``moment_residual_norms``: the implementation picked per platform, as the attention APIs
(``block_attention.api.by_platform``: the XLA reference on CPU, the Mosaic-TPU kernel on TPU, the
Triton kernel on CUDA; impl overrides). Keys and values stored rotated (``kv_dtype="int4"``) run the
reference on every platform."""

from __future__ import annotations

import functools

from kvjax.kernels._shared import check_impl
from kvjax.kernels.block_attention.api import by_platform
from kvjax.kernels.moment_residuals import gpu, reference, tpu
from kvjax.kernels.moment_residuals.tiles import check_inputs, stats_read
from kvjax.kernels.quantized import ROTATED, Quantized, values


def _reference(k, v, count, k_sum, v_sum, vk_sum, layer, *, zeroth: bool):
    if layer is not None:
        k, v = k[layer], v[layer]
    return reference.residual_norms(values(k), values(v), count, k_sum, v_sum, vk_sum, zeroth)


def moment_residual_norms(
    k,
    v,
    moments,
    zeroth: bool = False,
    *,
    layer=None,
    impl: str | None = None,
    interpret=False,
    block_k: int | None = None,
):
    """MomentKV's residual norm ‖r_j‖ of every slot (``reference`` has the formula).

    Args:
        k, v: [B, Hk, S, K], or with ``layer`` the stacked [L, B, Hk, S, K] of every layer; arrays
            or ``Quantized`` of one kind, read as their values in the model's dtype, then float32.
        moments: one layer's statistics (count [B, Hk], k_sum, v_sum [B, Hk, K], vk_sum
            [B, Hk, K, K], float32), e.g. ``kvjax.eviction.moments.Moments``.
        zeroth: the zeroth-order residual v_j − v̄ (vk_sum is not read: it may be of any shape).
        layer: an int32 scalar, the layer of stacked k, v; the kernels read it in place.
        impl / interpret / block_k: as ``block_attention_with_scores``.

    Returns [B, Hk, S] float32.
    """
    check_impl(impl)
    stats = stats_read(moments, zeroth)
    check_inputs(k, v, *stats, layer, zeroth)  # the shapes, before any branch traces
    args = (k, v, *stats, layer)
    xla = functools.partial(_reference, zeroth=zeroth)
    if isinstance(k, Quantized) and k.kind in ROTATED:
        return xla(*args)

    def kernel(fn, **options):
        return lambda k, v, *rest: fn(k, v, *rest[:-1], zeroth, layer=rest[-1], **options)

    tiles = {"block_k": block_k}
    return by_platform(
        args,
        impl,
        k.shape[-1],
        xla=xla,
        tpu_kernel=kernel(tpu.moment_residual_norms_tpu, interpret=interpret, **tiles),
        gpu_kernel=kernel(gpu.moment_residual_norms_gpu, interpret=interpret, **tiles),
        interpreted=kernel(tpu.moment_residual_norms_tpu, interpret=True, **tiles),
    )
