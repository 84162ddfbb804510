"""Decode attention (T = 1) with eviction scores and MomentKV's correction: ``reference`` (jnp),
``tpu`` (Pallas Mosaic TPU), ``gpu`` (Pallas Triton) and ``api`` (the per-platform choice)."""

from kvjax.kernels.decode_attention.api import decode_attention_with_scores

__all__ = ["decode_attention_with_scores"]
