"""``causal_attention``: a prompt attending to itself (the full cache's prefill), without scores.

impl=None: cuDNN's flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) on
CUDA GPUs, chosen per platform by ``jax.lax.platform_dependent``; XLA's computation in query chunks
(``chunked_causal_attention``) on CPU, TPU and wherever cuDNN does not take the inputs. cuDNN's
function checks for cuDNN, the dtype (bfloat16 or float16) and the head dim as it is traced, so it
is only traced where it can run: without cuDNN, or for float32 inputs, the program holds the
chunked form alone. Any other impl runs the chunked form (there is no Pallas kernel for this).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from kvjax.kernels._shared import check_impl
from kvjax.kernels.block_attention.reference import attention_with_scores

PREFILL_CHUNK = 256  # queries per chunk: no [T, T] logits at once


def chunked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The XLA form: query chunk [s, e) attends to keys 0 … e−1 under a causal mask.

    Args:
        q: [B, T, H, K].
        k, v: [B, Hk, T, K] (query t sees keys 0 … t).

    Returns out [B, T, H, K] in q's dtype.
    """
    T = q.shape[1]
    outs = []
    for start in range(0, T, PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, T)
        causal = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]
        out, _, _ = attention_with_scores(
            q[:, start:end], k[:, :, :end], v[:, :, :end], causal[None, None]
        )
        outs.append(out)
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    as_q = lambda x: x.swapaxes(1, 2).astype(q.dtype)  # noqa: E731  [B, T, Hk, K]
    return jax.nn.dot_product_attention(q, as_q(k), as_q(v), is_causal=True, implementation="cudnn")


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str | None = None):
    """Causal grouped-query attention of T tokens over themselves.

    Args:
        q: [B, T, H, K] (H a multiple of Hk).
        k, v: [B, Hk, T, K].
        impl: None (cuDNN on CUDA where it takes the inputs, else XLA), or any other of
            ``IMPLS`` (XLA's chunked form).

    Returns out [B, T, H, K] in q's dtype (softmax over 1/√K-scaled logits, as
    ``attention_with_scores``).
    """
    check_impl(impl)
    B, T, H, K = q.shape
    if k.shape != (B, k.shape[1], T, K) or v.shape != k.shape or H % k.shape[1]:
        raise ValueError(
            f"q must be [B, T, H, K] and k, v [B, Hk, T, K] with H a multiple of Hk; got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if impl is not None:
        return chunked_causal_attention(q, k, v)
    try:  # traces cuDNN's function, which raises where cuDNN or the inputs' dtype is missing
        return jax.lax.platform_dependent(q, k, v, cuda=_cudnn, default=chunked_causal_attention)
    except (RuntimeError, ValueError, NotImplementedError):
        return chunked_causal_attention(q, k, v)
