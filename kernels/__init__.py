"""Pallas kernels, each beside its pure-jnp reference (imported as ``kvjax.kernels``).

One folder per operation, in the style of JAX's ``pallas/ops`` and openxla/tokamax: ``reference.py``
(the semantics: kvjax's XLA computation), ``tpu.py`` (Pallas Mosaic TPU), ``gpu.py`` (Pallas Triton),
``api.py`` (the public function, choosing the implementation per platform with
``jax.lax.platform_dependent``).

* ``block_attention_with_scores`` — a block of queries over the cache slots: attention output, lse and
  the per-slot eviction scores (attention column or OBCache saliency), as ``kvjax.ops.attention_with_scores``.
* ``decode_attention_with_scores`` — one query per sequence, plus MomentKV's normalization correction.

What runs where, tiling rules and what has (not) been checked on hardware: ``docs/kernels.md``.
"""

from kvjax.kernels._shared import IMPLS
from kvjax.kernels.block_attention import block_attention_with_scores
from kvjax.kernels.decode_attention import decode_attention_with_scores

__all__ = ["IMPLS", "block_attention_with_scores", "decode_attention_with_scores"]
