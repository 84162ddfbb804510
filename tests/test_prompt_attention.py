"""``kvjax.kernels.causal_attention`` (in ``prompt_attention.py``), the full cache's prefill
attention.

* The chunked XLA form equals a NumPy causal softmax attention (GQA; prompts shorter than a span,
  whole spans and ragged ones, spans in tiles), on CPU in the CPU's shape (short and long prompts),
  and the full cache's prefill equals XLA's attention over the whole cache under the positions' mask
  (the computation it replaced).
* Lowering from this CPU machine, with ``check_cudnn_version`` patched to say whether cuDNN is
  installed: without cuDNN the CUDA program holds the chunked form; with a cuDNN version reported,
  the CUDA program of bfloat16 inputs, and a model's full-cache prefill, hold cuDNN's flash
  attention and no other attention, while CPU, TPU and float32 keep the chunked form.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo
from kvjax.kernels import PREFILL_CHUNK, attention_with_scores, causal_attention
from kvjax.kernels.prompt_attention import CPU_SHORT, chunked_causal_attention, cpu_causal_attention

import kvjax
from kvjax.cache.full import FullCache
from kvjax.model.segment import Segment

CUDNN_CALL = "__cudnn$fmhaSoftmax"


def numpy_causal(q, k, v):
    """q [B, T, H, K], k, v [B, Hk, T, K] -> [B, T, H, K], float64."""
    B, T, H, K = q.shape
    Hk = k.shape[1]
    kh = np.repeat(np.asarray(k, np.float64), H // Hk, axis=1)  # [B, H, T, K]
    vh = np.repeat(np.asarray(v, np.float64), H // Hk, axis=1)
    z = np.einsum("bthk,bhsk->bhts", np.asarray(q, np.float64), kh) / np.sqrt(K)
    z = np.where(np.tril(np.ones((T, T), bool)), z, -np.inf)
    a = np.exp(z - z.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    return np.einsum("bhts,bhsk->bthk", a, vh)


def inputs(T, B=2, Hk=3, G=3, K=16, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (B, T, Hk * G, K), dtype)
    k, v = (jax.random.normal(key, (B, Hk, T, K), dtype) for key in keys[1:])
    return q, k, v


@pytest.mark.parametrize(
    "T,span,tile",
    [
        (7, PREFILL_CHUNK, None),  # shorter than a span
        (2 * PREFILL_CHUNK, PREFILL_CHUNK, None),  # whole spans
        (PREFILL_CHUNK + 45, PREFILL_CHUNK, None),  # a ragged last span
        (300, 128, 32),  # tiles of a span in a lax.map, a ragged last span and tile
        (256, 256, 64),  # one span of whole tiles
    ],
)
def test_chunked_form_equals_a_numpy_causal_attention(T, span, tile):
    q, k, v = inputs(T)
    got = chunked_causal_attention(q, k, v, span=span, tile=tile)
    np.testing.assert_allclose(np.asarray(got), numpy_causal(q, k, v), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("T", [300, CPU_SHORT + 52])  # CPU's two shapes
def test_on_cpu_the_default_is_the_cpu_shape_of_the_chunked_form(T):
    q, k, v = inputs(T, B=1, Hk=1, G=2, K=8)
    got = causal_attention(q, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(cpu_causal_attention(q, k, v)))
    np.testing.assert_array_equal(
        np.asarray(causal_attention(q, k, v, impl="xla")), np.asarray(got)
    )
    np.testing.assert_allclose(np.asarray(got), numpy_causal(q, k, v), atol=2e-5, rtol=2e-5)


def test_full_cache_prefill_equals_xla_attention_over_the_whole_cache():
    """A prompt into an empty full cache: the output of the causal attention equals XLA's attention
    of the prompt over every slot of the cache (room included) under the positions' mask."""
    L, B, Hk, G, K, T, S = 2, 2, 3, 3, 16, PREFILL_CHUNK + 45, 512
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=64,
        d_model=32,
        n_layers=L,
        n_heads=Hk * G,
        n_kv_heads=Hk,
        head_dim=K,
        d_ff=64,
        max_seq_len=1024,
    )
    q, k, v = inputs(T, B, Hk, G, K, seed=3)
    k_new, v_new = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B, T, Hk, K], as the model hands them over
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = FullCache.init(cfg, B, S, jnp.float32)
    out, cache = cache.attend(
        jnp.int32(1), q, k_new, v_new, Segment(positions=positions, from_start=True)
    )
    mask = (jnp.arange(S)[None, None, :] <= positions[:, :, None])[:, None]
    want, _, _ = attention_with_scores(q, cache.k[1], cache.v[1], mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.k[1, :, :, :T]), np.asarray(k))


def _calls(fn, platform, *structs):
    checks = [jax.export.DisabledSafetyCheck.custom_call(CUDNN_CALL)] if platform == "cuda" else []
    text = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
        *structs
    ).mlir_module()
    return re.findall(r"custom_call @([\w$.]+)", text), text


def _structs(T, Hk, G, K, dtype):
    return (
        jax.ShapeDtypeStruct((1, T, Hk * G, K), dtype),
        jax.ShapeDtypeStruct((1, Hk, T, K), dtype),
        jax.ShapeDtypeStruct((1, Hk, T, K), dtype),
    )


def test_without_cudnn_the_cuda_program_is_the_chunked_form(monkeypatch):
    def missing():
        raise RuntimeError("cuDNN is not detected.")  # what jax says on a machine without it

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", missing)
    calls, text = _calls(causal_attention, "cuda", *_structs(512, 3, 3, 64, jnp.bfloat16))
    assert CUDNN_CALL not in calls and "dot_general" in text


@pytest.fixture
def cudnn_reported(monkeypatch):
    """A cuDNN version where none is installed: cuDNN's function then traces and lowers on this
    machine."""
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


@pytest.mark.parametrize("heads", [(3, 3, 64), (8, 4, 128)])  # SmolLM2's and Llama-3.1-8B's
def test_with_cudnn_the_cuda_program_of_bfloat16_is_cudnn_flash_attention(cudnn_reported, heads):
    structs = _structs(4096, *heads, jnp.bfloat16)
    calls, text = _calls(causal_attention, "cuda", *structs)
    assert calls == [CUDNN_CALL] and "dot_general" not in text, calls
    assert "\\22mask_type\\22: \\22CAUSAL\\22" in text
    for platform in ("cpu", "tpu"):
        calls, text = _calls(causal_attention, platform, *structs)
        assert CUDNN_CALL not in calls and "dot_general" in text, platform
    calls, text = _calls(lambda *a: causal_attention(*a, impl="xla"), "cuda", *structs)
    assert CUDNN_CALL not in calls and "dot_general" in text
    calls, text = _calls(causal_attention, "cuda", *_structs(512, *heads, jnp.float32))
    assert CUDNN_CALL not in calls and "dot_general" in text  # cuDNN takes no float32


def test_with_cudnn_a_models_full_cache_prefill_runs_cudnn_on_cuda(cudnn_reported):
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=64,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=64,
        max_seq_len=1024,
    )
    params = jax.eval_shape(lambda: kvjax.init_params(cfg, jax.random.key(0), jnp.bfloat16))

    def prefill(params, tokens):
        cache = FullCache.init(cfg, 1, 640, jnp.bfloat16)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        hidden, _ = kvjax.model.decoder.decode_hidden(
            params, tokens, cache, Segment(positions=positions, from_start=True)
        )
        return hidden

    tokens = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    calls, _ = _calls(prefill, "cuda", params, tokens)
    assert calls == [CUDNN_CALL], calls  # once, in the layer scan's body
    calls, _ = _calls(prefill, "cpu", params, tokens)
    assert CUDNN_CALL not in calls
