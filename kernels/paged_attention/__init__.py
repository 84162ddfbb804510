"""Paged attention with eviction scores: ``reference`` (gather + the dense references), ``tpu``
(Pallas Mosaic TPU), ``gpu`` (Pallas Triton) and ``api`` (the per-platform choice)."""

from kvjax.kernels.paged_attention.api import (
    paged_block_attention_with_scores,
    paged_decode_attention_with_scores,
)

__all__ = ["paged_block_attention_with_scores", "paged_decode_attention_with_scores"]
