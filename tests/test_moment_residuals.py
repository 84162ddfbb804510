"""``kvjax.kernels.moment_residual_norms`` (MomentKV's residual norm of every slot, the decoding
step's moment-informed eviction):

* the XLA reference against a float64 NumPy oracle of MomentKV's residual (Eq. 9), first and zeroth
  order, with rows that have evicted nothing;
* the TPU and Triton kernels under the Pallas interpreter against the reference: one layer and
  the middle layer of a stack, ragged key tiles, float32 and bfloat16, int8 and float8 codes (int4,
  stored rotated, runs the reference);
* the decode attention kernels give the same norms from the tiles their softmax pass reads
  (``decode_attention_with_scores(residuals=...)``), their attention unchanged;
* ``jax.export`` lowers the kernels for TPU and CUDA over the whole stack (no slice of a layer), and
  MomentKV's decoding step on the dense cache lowers to the decode kernel alone, the norms fused;
* bad shapes name the argument.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvjax.kernels import decode_attention_with_scores, moment_residual_norms, quantize
from kvjax.kernels.decode_attention import gpu as decode_gpu
from kvjax.kernels.decode_attention import tpu as decode_tpu
from kvjax.kernels.decode_attention.reference import correction_terms
from kvjax.kernels.moment_residuals import gpu, reference, tpu
from kvjax.kernels.quantized import values
from test_kernels import GPU_EXPORT_CHECKS, TRITON_CALL

import kvjax
from kvjax.eviction.moments import Moments
from kvjax.runtime.decoding import decode_steps, feed_budget
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling


def oracle(k, v, count, k_sum, v_sum, vk_sum, zeroth):
    """‖r_j‖ [B, Hk, S] in float64, one (row, head) at a time."""
    k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
    out = np.zeros(k.shape[:3])
    for b in range(k.shape[0]):
        for h in range(k.shape[1]):
            n = float(count[b, h])
            if n == 0:
                r = v[b, h]
            else:
                v_bar = np.asarray(v_sum[b, h], np.float64) / n
                r = v[b, h] - v_bar
                if not zeroth:
                    s_tilde = np.asarray(vk_sum[b, h], np.float64) - np.outer(
                        v_bar, np.asarray(k_sum[b, h], np.float64)
                    )
                    r = r - k[b, h] @ s_tilde.T / (n * np.sqrt(k.shape[-1]))
            out[b, h] = np.linalg.norm(r, axis=-1)
    return out


def case(seed=0, L=3, B=2, Hk=3, S=150, K=64, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    k = jax.random.normal(ks[0], (L, B, Hk, S, K)).astype(dtype)
    v = jax.random.normal(ks[1], (L, B, Hk, S, K)).astype(dtype)
    count = jnp.where(
        jnp.arange(B * Hk).reshape(B, Hk) == 1, 0.0, 5.0 + jnp.arange(B * Hk).reshape(B, Hk)
    )
    moments = Moments(
        count=count,
        k_sum=jax.random.normal(ks[2], (B, Hk, K)) * 3,
        v_sum=jax.random.normal(ks[3], (B, Hk, K)) * 3,
        vk_sum=jax.random.normal(ks[4], (B, Hk, K, K)) * 4,
    )
    return k, v, moments


def stats(m, zeroth=False):
    """What the kernels take: vk_sum None for the zeroth order."""
    return m.count, m.k_sum, m.v_sum, None if zeroth else m.vk_sum


def without_outer(m):
    """``m`` as a zeroth-order cache keeps it: no Σ v kᵀ ([..., 0, 0])."""
    return m.replace(vk_sum=jnp.zeros(m.count.shape + (0, 0), jnp.float32))


def stacked(m, L=3, at=1):
    """Every layer's statistics [L, ...], as the decode kernels take them with ``layer``: ``m`` at
    layer ``at``, other statistics elsewhere (a kernel that read another layer's would differ)."""
    other = case(seed=7)[2]
    return jax.tree.map(
        lambda a, o: jnp.stack([a if i == at else o * (i + 1) for i in range(L)]), m, other
    )


@pytest.mark.parametrize("zeroth", [False, True])
def test_the_reference_is_momentkv_residual_norm(zeroth):
    k, v, m = case()
    got = reference.residual_norms(k[1], v[1], *stats(m), zeroth)
    want = oracle(k[1], v[1], *map(np.asarray, stats(m)), zeroth)
    assert np.abs(got[0, 1] - np.linalg.norm(np.asarray(v[1][0, 1]), axis=-1)).max() < 1e-5  # n = 0
    np.testing.assert_allclose(got, want, rtol=2e-5)


KERNELS = {"tpu": tpu.moment_residual_norms_tpu, "gpu": gpu.moment_residual_norms_gpu}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("zeroth", [False, True])
def test_kernels_equal_the_reference(kernel, dtype, zeroth):
    """Ragged tiles (150 slots: 128 + 22 on TPU, 64 + 64 + 22 on GPU), a stack's middle layer and a
    lone layer."""
    k, v, m = case(dtype=dtype)
    want = reference.residual_norms(k[1], v[1], *stats(m), zeroth)
    fn = KERNELS[kernel]
    got = fn(k, v, *stats(m, zeroth), zeroth, layer=jnp.int32(1), interpret=True)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    got = fn(k[2], v[2], *stats(m, zeroth), zeroth, interpret=True)
    want = reference.residual_norms(k[2], v[2], *stats(m), zeroth)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_gpu_kernel_in_128_slot_tiles():
    """The tiles the GPU script also times (128 + 22 slots), a stack's middle layer."""
    k, v, m = case()
    want = reference.residual_norms(k[1], v[1], *stats(m), False)
    got = gpu.moment_residual_norms_gpu(
        k, v, *stats(m), False, layer=jnp.int32(1), block_k=128, interpret=True
    )
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "float8_e4m3fn", "int4"])
def test_quantized_keys_and_values_are_read_as_their_values(kind):
    """Codes and scales dequantized in the kernel as ``quantized.values`` does (in the model's
    dtype, then float32). Within a bfloat16 rounding of the keys: XLA may keep a dequantized key in
    float32 through the interpreted kernel's fused round trip (excess precision); int4 is stored
    rotated and runs the reference (exactly)."""
    k, v, m = case(dtype=jnp.bfloat16)
    kq, vq = quantize(k, kind), quantize(v, kind)
    want = reference.residual_norms(values(kq)[1], values(vq)[1], *stats(m), False)
    for impl in ("pallas", "xla"):
        got = moment_residual_norms(kq, vq, m, layer=jnp.int32(1), impl=impl)
        if kind == "int4" or impl == "xla":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=4e-3)
    if kind != "int4":
        got = KERNELS["gpu"](kq, vq, *stats(m), layer=jnp.int32(1), interpret=True)
        np.testing.assert_allclose(got, want, rtol=4e-3)


def decode_case(k, seed=1, G=2):
    """A query per row for keys k [L, B, Hk, S, K]: q [B, 1, Hk·G, K], slot positions with empty
    slots, query positions and weights."""
    _, B, Hk, S, K = k.shape
    ks = jax.random.split(jax.random.PRNGKey(seed), 2)
    q = jax.random.normal(ks[0], (B, 1, Hk * G, K)).astype(k.dtype)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, Hk, S))
    pos = jnp.where(jax.random.uniform(ks[1], pos.shape) < 0.2, -1, pos)
    return q, pos, jnp.full((B, 1), S, jnp.int32), jnp.ones((B, 1), jnp.float32)


FUSED = {"tpu": {"impl": "pallas_tpu"}, "gpu": {"impl": "pallas_gpu", "block_k": 32}}


@pytest.mark.parametrize("kernel", sorted(FUSED))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("score,weighted", [("attn", True), ("attn", False), ("obcache-key", True)])
@pytest.mark.parametrize("zeroth", [False, True])
def test_decode_kernels_give_the_norms_of_the_tiles_they_read(
    kernel, dtype, score, weighted, zeroth
):
    """A stack's middle layer, 150 slots (ragged tiles: 128 + 22 on TPU, 5 tiles of 32 on GPU), a
    row whose statistics are empty; the "attn" column from the softmax's logits or a scores pass
    (obcache-key: phase 1 on TPU). The attention's outputs are those of the same kernel asked for
    no norms, bit for bit; the norms are the residual kernel's reference's. The zeroth order's
    statistics are a zeroth-order cache's (no Σ v kᵀ)."""
    k, v, m = case(dtype=dtype)
    q, pos, qpos, w = decode_case(k)
    w = w if weighted else None
    layer = jnp.int32(1)
    run = functools.partial(
        decode_attention_with_scores, q, k, v, pos, qpos, w, score, layer=layer, interpret=True
    )
    every = without_outer(stacked(m)) if zeroth else stacked(m)
    *got, norms = run(residuals=(every, zeroth), **FUSED[kernel])
    for a, b in zip(got, run(**FUSED[kernel]), strict=True):
        np.testing.assert_array_equal(a, b)
    want = moment_residual_norms(k, v, m, zeroth, layer=layer, impl="xla")
    np.testing.assert_allclose(norms, want, rtol=2e-6, atol=1e-6)
    # the reference: the same pass apart
    *ref, ref_norms = run(residuals=(every, zeroth), impl="xla")
    np.testing.assert_array_equal(ref_norms, want)
    for a, b in zip(ref, run(impl="xla"), strict=True):
        np.testing.assert_array_equal(a, b)


def test_gpu_decode_kernel_norms_where_a_split_runs_past_the_tiles():
    """10 tiles of 16 slots in 4 splits of 3: the last split runs 2 tiles past the keys, whose norms
    (of no slot) land in the buffer's spare columns, never in a real slot's."""
    k, v, m = case(S=150)
    q, pos, qpos, w = decode_case(k)
    *_, norms = decode_gpu.decode_attention_gpu(
        q,
        k,
        v,
        pos,
        qpos,
        w,
        layer=jnp.int32(2),
        residual_stats=stats(stacked(m, at=2)),
        block_k=16,
        splits=4,
        interpret=True,
    )
    want = reference.residual_norms(k[2], v[2], *stats(m), False)
    np.testing.assert_allclose(norms, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_decode_kernels_norms_of_quantized_keys_and_values(kind):
    """int8 codes dequantized in the tile the softmax reads (within a bfloat16 rounding, as the
    residual kernel); int4, stored rotated, runs ``moment_residual_norms``'s reference exactly."""
    k, v, m = case(dtype=jnp.bfloat16)
    kq, vq = quantize(k, kind), quantize(v, kind)
    q, pos, qpos, w = decode_case(k)
    want = reference.residual_norms(values(kq)[1], values(vq)[1], *stats(m), False)
    for impl in ("pallas_tpu", "pallas_gpu"):
        *_, norms = decode_attention_with_scores(
            q,
            kq,
            vq,
            pos,
            qpos,
            w,
            layer=jnp.int32(1),
            residuals=(stacked(m), False),
            impl=impl,
            interpret=True,
        )
        if kind == "int4":
            np.testing.assert_array_equal(norms, want)
        else:
            np.testing.assert_allclose(norms, want, rtol=4e-3)


def test_decode_kernels_refuse_norms_read_in_another_dtype():
    """The kernels name the mismatch; the API then runs the residuals' own pass."""
    k, v, m = case(dtype=jnp.bfloat16)
    q, pos, qpos, w = decode_case(k)
    q32 = q.astype(jnp.float32)
    with pytest.raises(ValueError, match="keys read in q's dtype float32"):
        decode_gpu.decode_attention_gpu(
            q32,
            k,
            v,
            pos,
            qpos,
            w,
            layer=jnp.int32(1),
            residual_stats=stats(stacked(m)),
            interpret=True,
        )
    *_, norms = decode_attention_with_scores(
        q32,
        k,
        v,
        pos,
        qpos,
        w,
        layer=jnp.int32(1),
        residuals=(stacked(m), False),
        impl="pallas_gpu",
        interpret=True,
    )
    want = moment_residual_norms(k, v, m, layer=jnp.int32(1), impl="xla")
    np.testing.assert_allclose(norms, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu", "xla"])
def test_decode_norms_of_one_layer_equal_the_stacks(impl):
    """One layer's keys, values and statistics give what the stacks give at that layer (the
    stacked keys and values with one layer's statistics too); statistics of another shape name
    the argument."""
    k, v, m = case()
    q, pos, qpos, w = decode_case(k)
    args = dict(impl=impl, interpret=True, block_k=32)
    *one, one_norms = decode_attention_with_scores(
        q, k[1], v[1], pos, qpos, w, residuals=(m, False), **args
    )
    *whole, norms = decode_attention_with_scores(
        q, k, v, pos, qpos, w, layer=jnp.int32(1), residuals=(stacked(m), False), **args
    )
    np.testing.assert_array_equal(one_norms, norms)
    for a, b in zip(one, whole, strict=True):
        np.testing.assert_array_equal(a, b)
    *_, layer_norms = decode_attention_with_scores(
        q, k, v, pos, qpos, w, layer=jnp.int32(1), residuals=(m, False), **args
    )
    np.testing.assert_array_equal(layer_norms, norms)
    two = jax.tree.map(lambda x: x[:2], stacked(m))
    with pytest.raises(ValueError, match=r"residuals: .* must be \[2, 3\] or \[3, 2, 3\]"):
        decode_attention_with_scores(
            q, k, v, pos, qpos, w, layer=jnp.int32(1), residuals=(two, False), **args
        )
    with pytest.raises(ValueError, match=r"moments: .* must be \[2, 3\] \(one layer's, as"):
        decode_attention_with_scores(q, k[1], v[1], pos, qpos, w, moments=stacked(m))


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
@pytest.mark.parametrize("zeroth", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_decode_kernels_form_the_correction_terms(kernel, zeroth, shared):
    """MomentKV's correction terms from the statistics the decode kernels read in place at the
    layer (a head with nothing evicted: log_mass -inf), with or without the residual norms' (the
    same statistics passed once), equal the reference's; the norms are those of the kernel asked
    for no terms."""
    k, v, m = case()
    q, pos, qpos, w = decode_case(k)
    fn = functools.partial(
        {"tpu": decode_tpu.decode_attention_tpu, "gpu": decode_gpu.decode_attention_gpu}[kernel],
        q,
        k,
        v,
        pos,
        qpos,
        w,
        layer=jnp.int32(1),
        interpret=True,
    )
    stats3 = stats(stacked(m), zeroth)
    norms = dict(residual_stats=stats3, zeroth=zeroth) if shared else {}
    *got, mass, estimate = fn(correction_stats=stats3, correction_zeroth=zeroth, **norms)
    want_mass, want_estimate = correction_terms(q, m, zeroth)
    assert np.isinf(want_mass).sum() == 2  # row 0, KV head 1: its G = 2 query heads
    np.testing.assert_array_equal(np.isinf(mass), np.isinf(want_mass))
    finite = np.isfinite(want_mass)
    np.testing.assert_allclose(mass[finite], want_mass[finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(estimate, want_estimate, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, fn(**norms), strict=True):
        np.testing.assert_array_equal(a, b)


LOWERINGS = [("tpu", "pallas_tpu", "tpu_custom_call"), ("cuda", "pallas_gpu", TRITON_CALL)]


@pytest.mark.parametrize("platform,impl,call", LOWERINGS)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_kernels_lower_over_the_whole_stack(platform, impl, call, kv_dtype):
    """SmolLM2's layer geometry (30 layers, 3 KV heads, head dim 64) at 1,040 slots: one kernel
    call, handed the whole stack, no dynamic slice of it."""
    stack = jax.ShapeDtypeStruct((30, 2, 3, 1040, 64), jnp.bfloat16)
    m = jax.eval_shape(lambda: Moments.zeros((2, 3), (64, 64)))

    def fn(k, v, m, layer):
        if kv_dtype:
            k, v = quantize(k, kv_dtype), quantize(v, kv_dtype)
        return moment_residual_norms(k, v, m, layer=layer, impl=impl)

    checks = GPU_EXPORT_CHECKS if platform == "cuda" else []
    text = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
        stack, stack, m, jax.ShapeDtypeStruct((), jnp.int32)
    ).mlir_module()
    calls = [line for line in text.splitlines() if f"custom_call @{call}" in line]
    assert len(calls) == 1, calls
    whole = "30x2x3x1040x64x" + ("i8" if kv_dtype else "bf16")
    assert whole in calls[0], calls[0]
    if not kv_dtype:
        assert "dynamic_slice" not in text


def test_bad_shapes_name_the_argument():
    k, v, m = case()
    with pytest.raises(ValueError, match=r"vk_sum must be \(2, 3, 64, 64\)"):
        moment_residual_norms(k, v, m.replace(vk_sum=m.vk_sum[..., :3]), layer=0)
    with pytest.raises(ValueError, match="with layer, k and v must be"):
        moment_residual_norms(k[0], v[0], m, layer=0)
    # a zeroth-order cache's statistics (no Σ v kᵀ) read by the first order
    with pytest.raises(ValueError, match=r"vk_sum must be \(2, 3, 64, 64\)"):
        moment_residual_norms(k, v, without_outer(m), layer=0)
    q, pos, qpos, w = decode_case(k)
    for kwargs in (dict(moments=without_outer(m)), dict(residuals=(without_outer(m), False))):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=rf"{name}: the first order reads Σ v kᵀ"):
            decode_attention_with_scores(q, k[0], v[0], pos, qpos, w, **kwargs)


def decoding_module(scorer: str, platform: str) -> str:
    """The StableHLO of the decoding loop (``decode_steps``) of a 3-layer Llama with 2 KV heads of
    head dim 64 (groups of 3), batch 1, budget 64 under ``scorer``, exported for ``platform``."""
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=256,
        d_model=128,
        n_layers=3,
        n_heads=6,
        n_kv_heads=2,
        head_dim=64,
        d_ff=256,
        max_seq_len=1024,
    )
    params = jax.eval_shape(lambda: kvjax.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    tokens, lengths = (
        jax.ShapeDtypeStruct((1, 200), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    n = jax.ShapeDtypeStruct((), jnp.int32)
    checks = GPU_EXPORT_CHECKS if platform == "cuda" else []
    ev = eviction_from(context=200, budget=64, scorer=scorer)
    feed = functools.partial(feed_budget, ev=ev, out_width=16, decode_spare=ev.decode_spare(16))
    state = jax.eval_shape(feed, params, None, tokens, lengths, lengths, jax.random.key(0))
    fn = jax.jit(lambda p, s, a, b: decode_steps(p, s, a, b, Sampling(), (), ev.decoding()))
    return jax.export.export(fn, platforms=[platform], disabled_checks=checks)(
        params, state, n, n
    ).mlir_module()


def kernel_calls_in_decoding(scorer: str, platform: str, kernel: str) -> list[str]:
    """The custom-call lines naming ``kernel`` in ``decoding_module(scorer, platform)``."""
    text = decoding_module(scorer, platform)
    return [line for line in text.splitlines() if "custom_call" in line and kernel in line]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("scorer", ["momentkv", "snapkv+momentkv-mi", "snapkv+momentkv-zeroth"])
def test_momentkv_decoding_reads_the_stacked_cache_once_per_layer(platform, scorer):
    """MomentKV's decoding loop on the dense budget cache (it evicts inside the layer scan) gets
    its residual norms from the one decode kernel that attends over the whole stacked keys and
    values: it takes the statistics once (on CUDA every layer's, read in place as the keys:
    vk_sum [3, 1, 2, 64, 64]; the zeroth order none, its cache keeping no Σ v kᵀ), gives a norm
    a slot and, with the correction (momentkv), its terms; no residual-norm kernel reads the keys
    and values again (with or without the corrected attention). SnapKV's decode kernel takes no
    statistics."""
    assert not kernel_calls_in_decoding(scorer, platform, "moment_residual_norms")
    (call,) = kernel_calls_in_decoding(scorer, platform, "decode_attention")
    assert re.search(r"3x1x2x\d+x64xbf16", call), call
    # the residual norms and the correction (momentkv) read the same statistics: passed once;
    # the carried form (CUDA) hands every layer's, the scanned one (TPU) the layer's
    sums = "<3x1x2x64x64xf32>" if platform == "cuda" else "<1x2x64x64xf32>"
    assert call.count(sums) == (0 if "zeroth" in scorer else 1), call[-600:]
    k_and_v_sums = "<3x1x2x64xf32>" if platform == "cuda" else "<1x2x1x64xf32>"
    assert call.count(k_and_v_sums) == 2, call[-600:]
    (call,) = kernel_calls_in_decoding("snapkv", platform, "decode_attention")
    assert "64x64xf32" not in call, call
