"""``kvjax.kernels.expected_logits`` (Expected Attention's expected logit of every slot, its scoring
at every eviction point):

* the XLA reference against a float64 NumPy oracle of the expected logit (Devoto et al. 2025),
  with and without the covariance;
* the TPU and Triton kernels under the Pallas interpreter against the reference: ragged key
  tiles, groups of 3 and 4 query heads, float32 and bfloat16, int8 and float8 codes (int4, stored
  rotated, runs the reference);
* ``jax.export`` lowers the kernels for TPU and CUDA, and Expected Attention's decoding loop to
  them, reading the stacked cache (no slice of a layer);
* queries kept aside (``pending``) give the logits of the sums that hold their outer products, in
  the reference and both kernels;
* bad shapes name the argument;
* a decoding that evicts keeps its queries aside, settling a full buffer, and the sums it then
  holds are the direct ones.
"""

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvjax.kernels import expected_logits, quantize
from kvjax.kernels.expected_logits import gpu, reference, tpu
from kvjax.kernels.quantized import values
from test_kernels import GPU_EXPORT_CHECKS, TRITON_CALL
from test_moment_residuals import decoding_module, kernel_calls_in_decoding

from kvjax.eviction import expected_attention
from kvjax.eviction.expected_attention import ExpectedAttention, mean_rotation, rotation_matrix
from kvjax.runtime.decoding import decode_steps, feed_budget
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling


def oracle(k, rotation, mean, qq_sum, count):
    """z [B, Hk, G, S] in float64 as the paper writes it, one (row, KV head, query head) at a
    time: μ̃ = R̄μ, Σ̃ = R̄ΣR̄ᵀ with Σ = Q/n − μμᵀ."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    k, rotation, mean = f64(k), f64(rotation), f64(mean)
    K = k.shape[-1]
    B, Hk, G = mean.shape[:3]
    out = np.zeros((B, Hk, G, k.shape[2]))
    for b in range(B):
        r = rotation[b]
        for h in range(Hk):
            for g in range(G):
                x, mu = k[b, h], mean[b, h, g]
                z = x @ (r @ mu) / np.sqrt(K)
                if qq_sum is not None:
                    cov = r @ (f64(qq_sum[b, h, g]) / float(count[b]) - np.outer(mu, mu)) @ r.T
                    z = z + np.einsum("si,im,sm->s", x, cov, x) / (2 * K)
                out[b, h, g] = z
    return out


def case(seed=0, B=2, Hk=3, G=4, S=150, K=64, dtype=jnp.float32):
    """Keys, and the statistics of 7 queries per head in row 0 and of 1 in row 1 (Σ = 0), rotated
    to the 512 positions after 300 and 40."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 2)
    k = jax.random.normal(ks[0], (B, Hk, S, K)).astype(dtype)
    q = jax.random.normal(ks[1], (B, Hk, G, 7, K)) + 0.5
    q = q * (jnp.arange(7) < jnp.array([7, 1])[:, None, None, None])[..., None]
    count = jnp.array([7.0, 1.0])
    inv_freq = 10000.0 ** (-jnp.arange(0, K, 2) / K)
    rotation = rotation_matrix(*mean_rotation(inv_freq, jnp.array([300, 40]), 512))
    stats = (q.sum(3) / count[:, None, None, None], jnp.einsum("bhgti,bhgtj->bhgij", q, q), count)
    return k, rotation, stats


def linear(stats):
    return stats[0], None, None


def with_pending(stats, k, n=3):
    """The statistics of ``case`` with its queries' last ``n`` outer products kept aside: the sums
    of the others, and the queries themselves ([B, Hk, G, n, K]; zero in row 1, whose one query
    is in the sums)."""
    mean, _, count = stats
    ks = jax.random.split(jax.random.PRNGKey(7), 2)
    q = jax.random.normal(ks[0], mean.shape[:3] + (7, mean.shape[-1])) + 0.5
    q = q * (jnp.arange(7) < jnp.array([7, 1])[:, None, None, None])[..., None]
    held, pending = q[:, :, :, : 7 - n], q[:, :, :, 7 - n :]
    qq = jnp.einsum("bhgti,bhgtj->bhgij", held, held)
    full = (mean, jnp.einsum("bhgti,bhgtj->bhgij", q, q), count)
    return (mean, qq, count, pending), full


def test_pending_queries_count_as_their_outer_products():
    """Logits from the sums of 4 queries' outer products and 3 queries aside equal those of the
    sums of all 7 (and the float64 oracle's)."""
    k, rot, stats = case()
    split, full = with_pending(stats, k)
    got = reference.expected_logits(k, rot, *split)
    np.testing.assert_allclose(got, reference.expected_logits(k, rot, *full), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, oracle(k, rot, *full), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, reference.expected_logits(k, rot, *split[:3]), atol=1e-3)


@pytest.mark.parametrize("with_cov", [True, False])
def test_the_reference_is_the_expected_logit(with_cov):
    k, rot, stats = case()
    stats = stats if with_cov else linear(stats)
    np.testing.assert_allclose(
        reference.expected_logits(k, rot, *stats), oracle(k, rot, *stats), rtol=1e-5, atol=1e-5
    )


KERNELS = {"tpu": tpu.expected_logits_tpu, "gpu": gpu.expected_logits_gpu}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("G", "terms"), [(4, "cov"), (3, "cov"), (3, "linear"), (4, "pending"), (3, "pending")]
)
def test_kernels_equal_the_reference(kernel, dtype, G, terms):
    """Ragged tiles (150 slots: 128 + 22 on TPU, 64 + 64 + 22 on GPU); 3 pending queries, which
    the kernels pad to their tiles."""
    k, rot, stats = case(G=G, dtype=dtype)
    stats = {"cov": stats, "linear": linear(stats), "pending": with_pending(stats, k)[0]}[terms]
    want = reference.expected_logits(k, rot, *stats)
    got = KERNELS[kernel](k, rot, *stats, interpret=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gpu_kernel_in_128_slot_tiles():
    """The tiles the GPU script also times (128 + 22 slots)."""
    k, rot, stats = case(G=3)
    want = reference.expected_logits(k, rot, *stats)
    got = gpu.expected_logits_gpu(k, rot, *stats, block_k=128, interpret=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "float8_e4m3fn", "int4"])
def test_quantized_keys_are_read_as_their_values(kind):
    """Codes and scales dequantized in the kernel as ``quantized.values`` does (in the model's
    dtype, then float32); int4 is stored rotated and runs the reference (exactly)."""
    k, rot, stats = case(dtype=jnp.bfloat16)
    kq = quantize(k, kind)
    want = reference.expected_logits(values(kq), rot, *stats)
    for impl in ("pallas", "xla"):
        got = expected_logits(kq, rot, *stats, impl=impl)
        if kind == "int4" or impl == "xla":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=4e-3, atol=4e-3)
    if kind != "int4":
        got = KERNELS["gpu"](kq, rot, *stats, interpret=True)
        np.testing.assert_allclose(got, want, rtol=4e-3, atol=4e-3)


LOWERINGS = [("tpu", "pallas_tpu", "tpu_custom_call"), ("cuda", "pallas_gpu", TRITON_CALL)]


@pytest.mark.parametrize("platform,impl,call", LOWERINGS)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_kernels_lower(platform, impl, call, kv_dtype):
    """SmolLM2's head geometry (3 KV heads of 3 query heads, head dim 64) at 1,040 slots, with a
    decoding's 16 pending queries."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (f32(2, 64, 64), f32(2, 3, 3, 64), f32(2, 3, 3, 64, 64), f32(2), f32(2, 3, 3, 16, 64))

    def fn(k, *rest):
        return expected_logits(quantize(k, kv_dtype) if kv_dtype else k, *rest, impl=impl)

    checks = GPU_EXPORT_CHECKS if platform == "cuda" else []
    text = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
        jax.ShapeDtypeStruct((2, 3, 1040, 64), jnp.bfloat16), *args
    ).mlir_module()
    calls = [line for line in text.splitlines() if f"custom_call @{call}" in line]
    assert len(calls) == 1, calls


def test_bad_shapes_name_the_argument():
    k, rot, (mean, qq, count) = case()
    with pytest.raises(ValueError, match=r"qq_sum must be \(2, 3, 4, 64, 64\)"):
        expected_logits(k, rot, mean, qq[..., :3], count)
    with pytest.raises(ValueError, match=r"rotation must be \(2, 64, 64\)"):
        expected_logits(k, rot[0], mean, qq, count)
    with pytest.raises(ValueError, match=r"mean must be \(B, Hk, G, K\)"):
        expected_logits(k, rot, mean[..., :3], qq, count)
    with pytest.raises(ValueError, match=r"k must be \[B, Hk, S, K\]"):
        expected_logits(k[0], rot, mean, qq, count)
    with pytest.raises(ValueError, match="qq_sum and count go together"):
        expected_logits(k, rot, mean, qq, None)
    pending = jnp.zeros((2, 3, 4, 16, 64))
    with pytest.raises(ValueError, match=r"pending must be \(B, Hk, G, E, K\)"):
        expected_logits(k, rot, mean, qq, count, pending[..., :3])
    with pytest.raises(ValueError, match="pending queries need qq_sum"):
        expected_logits(k, rot, mean, None, None, pending)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_expected_attention_decoding_lowers_to_the_kernel_over_the_stacked_cache(platform):
    """Expected Attention's decoding loop (every layer's eviction at once, after the step) calls
    the kernel on the whole stacked keys: the layers are a grid axis of one call, not slices."""
    calls = kernel_calls_in_decoding("expected-attention", platform, "expected_logits")
    assert calls and all(re.search(r"3x1x2x\d+x64xbf16", line) for line in calls), calls


def test_expected_attention_adds_to_its_statistics_in_place():
    """Each layer's queries are added to the stacked [L, B, Hk, G, K, K] sums with a scatter-add,
    and no layer's sums are sliced out of the stack and written back: on CUDA XLA copied every
    layer's slice that way (the H200 compile at the 8B's batch 64: 4.4 GB per decoding step)."""
    text = decoding_module("expected-attention", "cuda")
    scatters = re.findall(r'"stablehlo\.scatter"\((.*?)\}\) : \(tensor<([\dx]+)xf32>', text, re.S)
    assert any("stablehlo.add" in body and shape == "3x1x2x3x64x64" for body, shape in scatters)
    assert not re.search(r"dynamic_(update_)?slice.*2x3x64x64xf32", text)


def test_deferred_outer_products_equal_the_direct_sums(tiny_llama, monkeypatch):
    """With a buffer of E = 3 decoding queries (``fit_stats`` of an evicting decoding),
    ``observe`` leaves the [K, K] sums alone and keeps each query aside, settling a full buffer
    before the next; ``settle`` then gives the sums of adding every product at once: through two
    overflows, a prompt block (added directly) in between, a row without a query and the sinks'
    positions."""
    monkeypatch.setattr(expected_attention, "QUERY_BUFFER", 3)
    cfg = tiny_llama.config
    scorer, policy = ExpectedAttention(), SimpleNamespace(n_sink=2)
    B, H, K = 2, cfg.n_heads, cfg.head_dim
    direct = scorer.init_stats(cfg, B)
    deferred = scorer.fit_stats(scorer.init_stats(cfg, B), True)
    assert deferred.pending.shape == (cfg.n_layers, B, cfg.n_kv_heads, cfg.group_size, 3, K)
    keys = jax.random.split(jax.random.key(1), 9)
    feeds = [1] * 4 + [5] + [1] * 4  # decoding queries, a block of five, decoding queries
    start = 0
    for i, T in enumerate(feeds):
        q = jax.random.normal(keys[i], (B, T, H, K))
        positions = start + jnp.broadcast_to(jnp.arange(T), (B, T))
        valid = jnp.broadcast_to(jnp.array([True, i % 3 != 1])[:, None], (B, T))
        direct = scorer.observe(direct, 1, q, positions, valid, policy)
        deferred = scorer.observe(deferred, 1, q, positions, valid, policy)
        start += T
    # 4 queries: the fourth settles three; then the block; then 4 more: one settle, one left
    assert deferred.filled.tolist() == [0, 2]
    assert not np.allclose(deferred.qq_sum, direct.qq_sum)
    settled = scorer.settle(deferred)
    assert settled.filled.tolist() == [0, 0] and not np.asarray(settled.pending).any()
    for name in ("count", "q_sum", "qq_sum"):
        np.testing.assert_allclose(getattr(settled, name), getattr(direct, name), rtol=1e-5)
    assert np.asarray(direct.qq_sum[0] == 0).all()  # layer 0 saw nothing
    dropped = scorer.fit_stats(deferred, False)  # a decoding that does not evict: no buffer
    assert dropped.pending is None and dropped.filled is None
    np.testing.assert_array_equal(dropped.qq_sum, settled.qq_sum)


def test_decoding_keeps_its_queries_aside(tiny_llama):
    """A decoding that evicts at every step leaves the [K, K] sums as the prompt left them while
    its queries fill the buffer (each step's eviction reads them from there), and counts them."""
    ev = eviction_from(context=64, budget=16, scorer="expected-attention", block_size=8)
    tokens = jax.random.randint(jax.random.key(0), (2, 40), 4, 97)
    lengths = jnp.array([40, 33])
    state = feed_budget(
        tiny_llama,
        None,
        tokens,
        jnp.zeros(2, jnp.int32),
        lengths,
        jax.random.key(0),
        ev,
        8,
        ev.decode_spare(8),
    )
    before = state.cache.stats
    assert before.pending.shape[-2] == expected_attention.QUERY_BUFFER
    assert before.filled.tolist() == [0, 0]
    three = decode_steps(
        tiny_llama,
        jax.tree.map(jnp.copy, state),  # donated
        jnp.int32(8),
        jnp.int32(3),
        Sampling(),
        (),
        ev.decoding(),
    )
    np.testing.assert_array_equal(three.cache.stats.qq_sum, before.qq_sum)
    assert three.cache.stats.filled.tolist() == [3, 3]
    assert np.asarray(three.cache.stats.pending[:, :, :, :, :3]).any()
    assert (three.cache.stats.count == before.count + 3).all()
