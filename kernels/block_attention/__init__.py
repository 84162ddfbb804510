"""Block attention with eviction scores: ``reference`` (jnp), ``tpu`` (Pallas Mosaic TPU), ``gpu``
(Pallas Triton) and ``api`` (the per-platform choice)."""

from kvjax.kernels.block_attention.api import block_attention_with_scores

__all__ = ["block_attention_with_scores"]
