"""``block_attention_with_scores``: the implementation picked per platform.

impl=None (default): ``jax.lax.platform_dependent`` — the XLA reference on CPU (and any other
platform), the Mosaic-TPU kernels on TPU, the Triton kernels on CUDA GPUs. The choice is made when
the program is lowered for its platform, never from ``jax.default_backend()`` at trace time, so one
traced function serves every platform (``jax.export`` for ``platforms=["tpu"]`` keeps only the TPU
kernels). All branches are traced, so the Pallas branches must (and do) trace on a CPU-only machine;
only the chosen branch is lowered. A platform whose kernel does not take the head dim
(``tpu_common.supports`` / ``gpu_common.supports``) runs the reference there. One limitation of jax
0.10.2: exporting one module for several platforms at once (``platforms=["cpu", "tpu", "cuda"]``)
fails, because each ``pallas_call`` inside a branch is still lowered for every platform of the
module and Pallas has no CPU lowering outside interpret mode; export one platform at a time.

impl="xla": the reference everywhere. impl="pallas": the Pallas kernel of the platform — on CPU the
TPU-style kernels under the Pallas interpreter (slow; for checking). impl="pallas_tpu" /
"pallas_gpu": that kernel on whatever platform (pass interpret=True to run it on CPU).
"""

from __future__ import annotations

import functools

import jax
from kvjax.kernels import gpu_common, tpu_common
from kvjax.kernels._shared import check_impl, check_score, check_shapes
from kvjax.kernels.block_attention import gpu, reference, tpu
from kvjax.kernels.quantized import rotate


def by_platform(args, impl: str | None, head_dim: int, xla, tpu_kernel, gpu_kernel, interpreted):
    """Run ``impl``'s choice on ``args``: xla / tpu_kernel / gpu_kernel are functions of ``args``;
    ``interpreted`` is the TPU kernel under the interpreter (impl="pallas" on CPU). Shared by the
    decode API."""
    if impl == "xla":
        return xla(*args)
    if impl == "pallas_tpu":
        return tpu_kernel(*args)
    if impl == "pallas_gpu":
        return gpu_kernel(*args)
    on_tpu = tpu_kernel if tpu_common.supports(head_dim) else xla
    on_gpu = gpu_kernel if gpu_common.supports(head_dim) else xla
    on_cpu = interpreted if impl == "pallas" and tpu_common.supports(head_dim) else xla
    return jax.lax.platform_dependent(*args, cpu=on_cpu, tpu=on_tpu, cuda=on_gpu, default=on_cpu)


def block_attention_with_scores(
    q,
    k,
    v,
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
    """Grouped-query attention of a block of queries over cache slots, its log-sum-exp and per-slot
    eviction scores.

    Args:
        q: [B, T, H, K] (float32 or bfloat16).
        k, v: [B, Hk, S, K]: arrays, or ``Quantized`` of one kind (``kvjax.kernels.quantized``),
            attended as their values in q's dtype; the kernels dequantize each tile after loading
            it.
        slot_pos: [B, Hk, S] int32 original positions (-1 = empty slot).
        query_pos: [B, T] int32; slot s is visible to query t iff 0 ≤ slot_pos ≤ query_pos.
        query_weights: [B, T] float32 (the scoring queries) or None.
        score: in "attn", "obcache-value", "obcache-key", "obcache-joint".
        block_k / block_q: tile sizes of the Pallas kernels (each kernel rounds them to its
            hardware's rule: multiples of 128 slots / 16 rows on TPU, powers of two ≥ 16 on GPU);
            None picks the defaults.

    Returns (out [B, T, H, K] in q's dtype, lse [B, T, H] float32, col [B, Hk, G, S] float32 or
    None) — the formulas are in ``reference.attention_with_scores``.
    """
    check_score(score)
    check_impl(impl)
    check_shapes(q, k, v, slot_pos, query_pos, query_weights)
    tiles = {"score": score, "block_k": block_k, "block_q": block_q}
    out, lse, col = by_platform(
        (rotate(q, k), k, v, slot_pos, query_pos, query_weights),  # q in k's stored domain
        impl,
        q.shape[-1],
        xla=functools.partial(reference.block_attention_with_scores, score=score),
        tpu_kernel=functools.partial(tpu.block_attention_tpu, interpret=interpret, **tiles),
        gpu_kernel=functools.partial(gpu.block_attention_gpu, interpret=interpret, **tiles),
        interpreted=functools.partial(tpu.block_attention_tpu, interpret=True, **tiles),
    )
    return rotate(out, k), lse, col
