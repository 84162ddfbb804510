"""Pallas kernels, each beside its pure-jnp reference (imported as ``kvjax.kernels``).

One folder per operation, in the style of JAX's ``pallas/ops`` and openxla/tokamax: ``reference.py``
(the semantics: kvjax's XLA computation), ``tpu.py`` (Pallas Mosaic TPU), ``gpu.py``
(Pallas Triton), ``api.py`` (the public function, choosing the implementation per platform with
``jax.lax.platform_dependent``). The kernels of a platform share their Pallas pieces (masked logits,
online softmax, the score pass of every score kind, tile sizes): ``tpu_common``, ``gpu_common``.

* ``block_attention_with_scores`` — a block of queries over the cache slots: attention output, lse
  and the per-slot eviction scores (attention column or OBCache saliency); the formulas are in
  ``block_attention.reference.attention_with_scores``.
* ``decode_attention_with_scores`` — one query per sequence, plus MomentKV's normalization
  correction.
* ``moment_residual_norms`` — MomentKV's residual norm of every slot under one layer's statistics
  of the evicted tokens (a decoding step's moment-informed eviction), read in place from the stacked
  cache.
* ``expected_logits`` — Expected Attention's expected logit of every slot under each query head's
  Gaussian of future queries (its scoring at every eviction point), read in place from the cache.
* ``causal_attention`` — a prompt over itself without scores (the full cache's prefill): cuDNN's
  flash attention on CUDA, XLA's computation in query chunks elsewhere.
* ``lowest_place`` — a decoding step's one eviction per (row, KV head) in the dense cache: the
  place, by position, of the lowest key (the base's aggregate of its state, pooled along
  positions); a Triton kernel on CUDA, the reference elsewhere.
* ``lowest_places`` — the same keys' few lowest per (row, KV head), with the counts a shared
  allocation reads: a decoding step's evictions in the paged cache (AdaKV), where the only pass over
  every slot is the kernel's.

What runs where, tiling rules and what has (not) been checked on hardware: ``docs/kernels.md``.

Every kernel takes keys and values as arrays or as ``Quantized`` codes and scales (``quantize``,
``kvjax.kernels.quantized``): the references dequantize them to q's dtype first, the kernels each
tile after loading it.

The package stands alone: it imports nothing of kvjax outside ``kvjax.kernels``. Besides the
per-platform functions it exports the XLA forms kvjax also calls directly: ``attention_with_scores``
(dense mask; the full cache) and ``corrected_attention`` (MomentKV's correction), with the score
kinds ``SCORE_KINDS`` and ``NEG_INF``, the logit of a masked slot.
"""

from kvjax.kernels._shared import IMPLS, NEG_INF, SCORE_KINDS
from kvjax.kernels.block_attention import block_attention_with_scores
from kvjax.kernels.block_attention.reference import attention_with_scores
from kvjax.kernels.decode_attention import decode_attention_with_scores
from kvjax.kernels.decode_attention.reference import corrected_attention
from kvjax.kernels.eviction_place import lowest_place, lowest_places
from kvjax.kernels.expected_logits import expected_logits
from kvjax.kernels.moment_residuals import moment_residual_norms
from kvjax.kernels.prompt_attention import PREFILL_CHUNK, causal_attention
from kvjax.kernels.quantized import KV_DTYPES, Quantized, quantize

__all__ = [
    "IMPLS",
    "KV_DTYPES",
    "NEG_INF",
    "PREFILL_CHUNK",
    "SCORE_KINDS",
    "Quantized",
    "attention_with_scores",
    "block_attention_with_scores",
    "causal_attention",
    "corrected_attention",
    "decode_attention_with_scores",
    "expected_logits",
    "lowest_place",
    "lowest_places",
    "moment_residual_norms",
    "quantize",
]
