"""``causal_attention``: a prompt attending to itself (the full cache's prefill), without scores.

impl=None: cuDNN's flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) on
CUDA GPUs, chosen per platform by ``jax.lax.platform_dependent``; XLA's computation in query chunks
(``chunked_causal_attention``) on CPU, TPU and wherever cuDNN does not take the inputs. cuDNN's
function checks for cuDNN as it is traced, so it is only traced where it can run, and only for
inputs its flash attention takes (bfloat16 or float16, a head dim of at most 128 and a multiple of
8): otherwise the program holds the chunked form alone. Any other impl runs the chunked form (there
is no Pallas kernel for this).

The chunked form's shape is per platform too. On CPU (``cpu_causal_attention``) a query's logits
should stay in the CPU's cache: up to 2048 tokens, one product per 128 queries; longer, spans of 512
queries in tiles of 64 (a ``lax.map``: fewer products for XLA to compile, though the unrolled ones
run side by side on the cores). Elsewhere, one product per 256 queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from kvjax.kernels._shared import check_impl
from kvjax.kernels.block_attention.reference import attention_with_scores

PREFILL_CHUNK = 256  # queries per product: no [T, T] logits at once
CPU_SHORT, CPU_SHORT_SPAN = 2048, 128  # on CPU, prompts up to CPU_SHORT tokens: queries per product
CPU_SPAN, CPU_TILE = 512, 64  # on CPU, longer prompts: queries per static key length, per product


def chunked_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, span: int = PREFILL_CHUNK, tile: int | None = None
) -> jax.Array:
    """The XLA form: the queries in spans [s, e) of ``span``, each attending to keys 0 … e−1 under
    a causal mask, ``tile`` queries at a time (a ``lax.map`` over a span's tiles; None: the whole
    span in one product).

    Args:
        q: [B, T, H, K].
        k, v: [B, Hk, T, K] (query t sees keys 0 … t).

    Returns out [B, T, H, K] in q's dtype.
    """
    B, T, H, K = q.shape
    tile = tile or span
    outs = []
    for start in range(0, T, span):
        end = min(start + span, T)
        n = -(-(end - start) // tile)  # tiles; the last one padded with queries that see every key
        qs = jnp.pad(q[:, start:end], [(0, 0), (0, n * tile - (end - start)), (0, 0), (0, 0)])
        qs = qs.reshape(B, n, tile, H, K).swapaxes(0, 1)
        positions = start + jnp.arange(n * tile).reshape(n, tile)

        def attend(args, end=end):
            q_tile, pos = args
            causal = jnp.arange(end)[None, :] <= pos[:, None]
            out, _, _ = attention_with_scores(
                q_tile, k[:, :, :end], v[:, :, :end], causal[None, None]
            )
            return out

        out = attend((qs[0], positions[0])) if n == 1 else jax.lax.map(attend, (qs, positions))
        outs.append(out.reshape(n, B, tile, H, K).swapaxes(0, 1).reshape(B, n * tile, H, K))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out[:, :T]


def cpu_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``chunked_causal_attention`` in the CPU's shape (module docstring)."""
    if q.shape[1] <= CPU_SHORT:
        return chunked_causal_attention(q, k, v, span=CPU_SHORT_SPAN)
    return chunked_causal_attention(q, k, v, span=CPU_SPAN, tile=CPU_TILE)


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    as_q = lambda x: x.swapaxes(1, 2).astype(q.dtype)  # noqa: E731  [B, T, Hk, K]
    return jax.nn.dot_product_attention(q, as_q(k), as_q(v), is_causal=True, implementation="cudnn")


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str | None = None):
    """Causal grouped-query attention of T tokens over themselves.

    Args:
        q: [B, T, H, K] (H a multiple of Hk).
        k, v: [B, Hk, T, K].
        impl: None (cuDNN on CUDA where it takes the inputs, else XLA), or any other of
            ``IMPLS`` (XLA's chunked form, in CPU or other tiles by platform).

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
    xla = dict(cpu=cpu_causal_attention, default=chunked_causal_attention)
    if impl is None and q.dtype in (jnp.bfloat16, jnp.float16) and K % 8 == 0 and K <= 128:
        try:  # traces cuDNN's function, which raises where cuDNN is missing
            return jax.lax.platform_dependent(q, k, v, cuda=_cudnn, **xla)
        except (RuntimeError, ValueError, NotImplementedError):
            pass
    return jax.lax.platform_dependent(q, k, v, **xla)
