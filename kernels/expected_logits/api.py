"""``expected_logits``: the implementation picked per platform, as the attention APIs
(``block_attention.api.by_platform``: the XLA reference on CPU, the Mosaic-TPU kernel on TPU, the
Triton kernel on CUDA; impl overrides). Keys stored rotated (``kv_dtype="int4"``) run the reference
on every platform."""

from __future__ import annotations

from kvjax.kernels._shared import check_impl
from kvjax.kernels.block_attention.api import by_platform
from kvjax.kernels.expected_logits import gpu, reference, tpu
from kvjax.kernels.expected_logits.tiles import check_inputs
from kvjax.kernels.quantized import ROTATED, Quantized, values


def expected_logits(
    k,
    rotation,
    mean,
    qq_sum=None,
    count=None,
    pending=None,
    *,
    impl: str | None = None,
    interpret=False,
    block_k: int | None = None,
):
    """Expected Attention's expected logit of every slot (``reference`` has the formula).

    Args:
        k: [B, Hk, S, K], an array or ``Quantized``, read as its values in the model's dtype, then
            float32.
        rotation: [B, K, K] float32, each row's mean RoPE rotation R̄ of the future positions.
        mean: [B, Hk, G, K] float32, each query head's mean query before RoPE.
        qq_sum, count: [B, Hk, G, K, K] and [B] float32, the sum of the queries' outer products
            and their count (≥ 1), or both None (the linear term alone).
        pending: [B, Hk, G, E, K] float32 queries counted in ``count`` whose outer products
            ``qq_sum`` does not hold yet (zeros for none), or None: their products are added to
            the quadratic term without forming them.
        impl / interpret / block_k: as ``block_attention_with_scores``.

    Returns [B, Hk, G, S] float32.
    """
    check_impl(impl)
    check_inputs(k, rotation, mean, qq_sum, count, pending)  # before any branch traces

    def xla(k, *rest):
        return reference.expected_logits(values(k), *rest)

    args = (k, rotation, mean, qq_sum, count, pending)
    if isinstance(k, Quantized) and k.kind in ROTATED:
        return xla(*args)

    def kernel(fn, **options):
        return lambda *args: fn(*args, block_k=block_k, **options)

    return by_platform(
        args,
        impl,
        mean.shape[-1],
        xla=xla,
        tpu_kernel=kernel(tpu.expected_logits_tpu, interpret=interpret),
        gpu_kernel=kernel(gpu.expected_logits_gpu, interpret=interpret),
        interpreted=kernel(tpu.expected_logits_tpu, interpret=True),
    )
