"""Quantized keys and values (``kv_dtype``): quantization against the NumPy reference
(tests/reference_quantized.py), the bytes a kept token costs, budgets in bytes, a budget covering
the prompt equal to the full cache of the same kv_dtype in every cache kind, saved contexts. The
engine against the NumPy oracle on the round-tripped cache: tests/test_engine_vs_reference.py and
tests/test_kvzip_vs_reference.py (their kv_dtype tests); the kernels:
tests/test_quantized_kernels.py."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kvjax.kernels.quantized import (
    KV_DTYPES,
    Quantized,
    codes,
    dequantize,
    unpack_int4,
    values,
)
from kvjax.kernels.quantized import quantize as quantize_jax
from reference_quantized import QMAX, quantize, round_trip

import kvjax
from kvjax.cache.dense import BudgetCache
from kvjax.cache.full import cache_bytes
from kvjax.runtime.options import budget_for_bytes, eviction_from
from kvjax.runtime.saved_context import load_context, save_context


def sample_rows(dtype) -> np.ndarray:
    """[6, 64] rows: normal, large, tiny, a zero row, one outlier channel, and halves that sit
    exactly between two int8 codes."""
    rng = np.random.default_rng(0)
    rows = [
        rng.standard_normal(64),
        300 * rng.standard_normal(64),
        1e-3 * rng.standard_normal(64),
        np.zeros(64),
        np.r_[50.0, 0.01 * rng.standard_normal(63)],
        np.r_[127.0, np.arange(63) + 0.5],  # scale 1: x / s = k + 0.5 exactly
    ]
    return np.asarray(rows, np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KV_DTYPES)
def test_quantize_equals_the_numpy_reference(kind, dtype):
    x = sample_rows(dtype)
    q = quantize_jax(jnp.asarray(x), kind)
    want, scale = quantize(np.asarray(x, np.float32), kind)
    np.testing.assert_array_equal(np.asarray(q.scale, np.float32), scale)
    got = unpack_int4(q.data) if kind == "int4" else q.data
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    np.testing.assert_array_equal(
        np.asarray(dequantize(q), np.float32), (want * scale).astype(np.float32)
    )
    assert q.dtype == np.dtype(dtype).name and values(q).dtype == dtype
    # values: the dequantized ones, rotated back for int4 (x H H = x)
    np.testing.assert_allclose(
        np.asarray(values(q, jnp.float32)),
        round_trip(x, kind),
        rtol=1e-6,
        atol=1e-6 * np.abs(x.astype(np.float32)).max(),
    )
    assert not np.any(np.asarray(dequantize(q))[3])  # a zero row stays zero, no NaN
    assert np.all(np.abs(want) <= QMAX[kind])


def test_rounding_is_half_to_even_and_saturates():
    # x / s = k + 0.5 exactly: round half to even
    row = np.r_[127.0, np.arange(63) + 0.5].astype(np.float32)
    q = quantize_jax(jnp.asarray(row[None]), "int8")
    assert float(q.scale[0, 0]) == 1.0
    got = np.asarray(q.data[0], np.int32)
    np.testing.assert_array_equal(got[1:], np.rint(np.arange(63) + 0.5))
    assert got[1] == 0 and got[2] == 2 and got[4] == 4  # 0.5, 1.5 -> 2, 3.5 -> 4
    # the largest value lands on qmax (its scale, rounded to bfloat16, is within half a bfloat16
    # step of max|x| / qmax, so it rounds to qmax for the integer kinds) ...
    x = np.asarray([[128.49, 1.0]], np.float32)
    assert int(quantize_jax(jnp.asarray(x), "int8").data[0, 0]) == 127
    # ... and a code past qmax (float8: up to 448 × (1 + 2⁻⁸) before clipping) saturates
    big = jnp.asarray([[1000.0, -1000.0, 5.0]])
    for kind, qmax in QMAX.items():
        got = np.asarray(codes(big, jnp.ones((1, 1)), kind), np.float32)[0]
        np.testing.assert_array_equal(got, [qmax, -qmax, 5.0])


def test_int4_packs_two_codes_a_byte_low_half_first():
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    q = quantize_jax(jnp.asarray(x), "int4")
    assert q.data.shape == (3, 8) and q.data.dtype == jnp.uint8 and q.shape == (3, 16)
    want = quantize(x, "int4")[0].astype(np.int32)  # the codes of x H
    data = np.asarray(q.data).astype(np.int32)
    np.testing.assert_array_equal(data & 0xF, want[:, :8] & 0xF)  # channels 0..7: low nibbles
    np.testing.assert_array_equal(data >> 4, want[:, 8:] & 0xF)  # channels 8..15: high ones
    np.testing.assert_array_equal(np.asarray(unpack_int4(q.data)), want)
    with pytest.raises(ValueError, match="head_dim 7 is odd"):
        quantize_jax(jnp.ones((1, 7)), "int4")
    with pytest.raises(ValueError, match="head_dim 12 must be a power of two"):
        quantize_jax(jnp.ones((1, 12)), "int4")


@pytest.mark.parametrize(
    ("kind", "at_most"), [("int8", 0.53), ("float8_e4m3fn", 0.53), ("int4", 0.28)]
)
def test_a_kept_token_costs_at_most_its_share_of_bfloat16(kind, at_most):
    """Keys and values per kept token with their scales, at SmolLM2's head_dim of 64."""
    cfg = kvjax.ModelConfig(
        arch="llama", vocab_size=100, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
        head_dim=64, d_ff=1536, max_seq_len=8192,
    )  # fmt: skip

    def kv(kv_dtype):
        cache = jax.eval_shape(
            lambda: BudgetCache.init(cfg, 1, 256, jnp.bfloat16, (0, 0), 1, kv_dtype=kv_dtype)
        )
        return cache_bytes(cache, kv_only=True), cache_bytes(cache)

    (bf16, whole_bf16), (quant, whole) = kv(None), kv(kind)
    assert quant / bf16 <= at_most
    assert whole - quant == whole_bf16 - bf16  # positions, state and order are unchanged


def test_budget_bytes_is_a_slot_count_at_equal_memory(tiny_llama):
    cfg = tiny_llama.config  # float32
    per_slot = cfg.n_layers * cfg.n_kv_heads * 2 * cfg.head_dim * 4
    assert budget_for_bytes(tiny_llama, 64 * per_slot) == 64
    # int8: K + 2 bytes per key or value instead of 4 K
    K = cfg.head_dim
    assert budget_for_bytes(tiny_llama, 64 * per_slot, "int8") == 64 * 4 * K // (K + 2)
    ev = eviction_from(budget_bytes=64 * per_slot, kv_dtype="int4", model=tiny_llama)
    assert ev.policy.budget == 64 * 4 * K // (K // 2 + 2) and ev.kv_dtype == "int4"
    with pytest.raises(ValueError, match="give one of them"):
        eviction_from(budget=64, budget_bytes=1000)
    with pytest.raises(ValueError, match="holds no token"):
        eviction_from(budget_bytes=1, model=tiny_llama)
    with pytest.raises(ValueError, match="kv_dtype='int2' must be None"):
        eviction_from(budget=64, kv_dtype="int2")
    with pytest.raises(ValueError, match="kv_dtype='fp16' must be None"):
        kvjax.generate(tiny_llama, [5, 6, 7], 2, kv_dtype="fp16")


PROMPT = np.random.default_rng(5).integers(4, 97, 41).astype(np.int32)


@pytest.mark.parametrize("kind", KV_DTYPES)
def test_a_budget_covering_the_prompt_equals_the_full_cache_of_the_same_kv_dtype(tiny_llama, kind):
    """Dense (snapkv), paged (adakv) and the prefill protocol: nothing is evicted, so every token
    equals the full cache's with the same storage."""
    full = kvjax.generate(tiny_llama, PROMPT, 6, stop_ids=(), kv_dtype=kind)
    base = kvjax.generate(tiny_llama, PROMPT, 6, stop_ids=())
    for options in (
        dict(scorer="snapkv", block_size=16),
        dict(scorer="adakv", block_size=16),
        dict(scorer="snapkv", protocol="prefill"),
    ):
        got = kvjax.generate(
            tiny_llama, PROMPT, 6, stop_ids=(), kv_dtype=kind, budget=64, **options
        )
        np.testing.assert_array_equal(got, full, err_msg=str(options))
    assert len(full) == len(base)  # (the tokens may differ from the unquantized cache's)


def test_a_quantized_context_saves_and_decodes_the_same(tiny_llama, tmp_path):
    context = kvjax.prefill(
        tiny_llama, PROMPT, budget=24, scorer="snapkv", obs_window=4, kv_dtype="int8"
    )
    assert isinstance(context.cache.k, Quantized) and context.ev.kv_dtype == "int8"
    expected = kvjax.decode(tiny_llama, context, [7, 8], 5, stop_ids=())
    save_context(str(tmp_path / "c"), context, tiny_llama)
    loaded = load_context(str(tmp_path / "c"), tiny_llama)
    assert isinstance(loaded.cache.k, Quantized) and loaded.cache.k.kind == "int8"
    np.testing.assert_array_equal(
        kvjax.decode(tiny_llama, loaded, [7, 8], 5, stop_ids=()), expected
    )


def test_a_prefill_compresses_in_its_own_kv_dtype(tiny_llama):
    shared = kvjax.prefill_full(tiny_llama, PROMPT, kv_dtype="int4")
    with pytest.raises(ValueError, match="this prefill stored keys and values as kv_dtype='int4'"):
        shared.compress(budget=16, scorer="tova", kv_dtype="int8")
    context = shared.compress(budget=16, scorer="tova", kv_dtype="int4")
    assert context.cache.k.kind == "int4"
