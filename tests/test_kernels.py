"""Pallas kernels of ``kvjax.kernels`` against their jnp references, and their lowering for TPU and
GPU.

* The references are ``kvjax.kernels.attention_with_scores`` (mask from positions) and
  ``kvjax.kernels.corrected_attention``: what kvjax runs with XLA.
* Every kernel — the Mosaic-TPU one and the Triton one, both run by the Pallas interpreter on CPU
  (jax 0.10.2 interprets Triton kernels too) — equals its reference over a grid of head dims (64,
  128), GQA groups (1, 3, 4, 8), score kinds, with and without query weights, float32 and bfloat16,
  on caches whose slot count is not a multiple of the tile, with empty slots in the middle and at
  the end, slots in shuffled position order, fully masked query rows (finite, and equal to the
  reference's values) and query counts that need padding. Each factor value meets each kernel; the
  full product would take too long under the interpreter.
* The OBCache key term stays accurate when one slot takes all the attention (o ≈ v): float64 check.
* ``jax.export`` lowers every kernel from this CPU machine at SmolLM2 and Llama-3.1-8B geometry, for
  ``platforms=["tpu"]`` (a ``tpu_custom_call``) and ``platforms=["cuda"]`` (a
  ``__gpu$xla.gpu.triton`` custom call); and the default ``impl=None`` picks the kernel of the
  platform it is lowered for.

Tolerances (|kernel − reference| ≤ atol + rtol·|reference| per element, atol = a·max|reference| for
out and col, absolute for lse):

    dtype     out (a / rtol)  lse (atol / rtol)  col (a / rtol)
    float32   1e-5 / 1e-5     1e-5 / 1e-5        1e-5 / 1e-5
    bfloat16  3e-2 / 3e-2     3e-2 / 1e-2        3e-2 / 5e-2

bfloat16 is loose because the kernels form the logits in float32 while the reference (as
kvjax.kernels.attention_with_scores, and as XLA would) rounds the bf16 × bf16 product to bf16 before
the softmax, and rounds the output to bf16 before the OBCache differences; float32 differs only by
summation order.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvjax.kernels import block_attention_with_scores, decode_attention_with_scores
from kvjax.kernels.block_attention import gpu as block_gpu
from kvjax.kernels.block_attention import reference as block_ref
from kvjax.kernels.block_attention import tpu as block_tpu
from kvjax.kernels.decode_attention import reference as decode_ref
from kvjax.kernels.gpu_common import decode_splits

import kvjax
from kvjax.cache.full import FullCache
from kvjax.eviction.moments import Moments
from kvjax.model.segment import Segment

SCORES = ("attn", "obcache-value", "obcache-key", "obcache-joint")
# dtype -> output -> (atol, rtol); atol is a fraction of max |reference| except for lse
TOLERANCE = {
    "float32": {"out": (1e-5, 1e-5), "lse": (1e-5, 1e-5), "col": (1e-5, 1e-5)},
    "bfloat16": {"out": (3e-2, 3e-2), "lse": (3e-2, 1e-2), "col": (3e-2, 5e-2)},
}
TRITON_CALL = (
    "__gpu$xla.gpu.triton"  # jaxlib 0.10.2's Triton custom call (Triton IR, compiled by XLA)
)
GPU_EXPORT_CHECKS = [
    jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)
]  # no stability guarantee


def make_case(
    seed, B=2, T=20, Hk=2, G=3, S=300, K=64, dtype=jnp.float32, weighted=True, weight_masked=False
):
    """A cache as the engine leaves it: kept context positions and the block's own T positions in
    shuffled slots, empty slots (-1) in the middle and at the end, different per row and KV head.
    Query 0 of row 1 has position -1 (fully masked); so has query 1 of row 0. The weights score the
    last few queries (and the fully masked row 1, query 0 when ``weight_masked``)."""
    r = np.random.default_rng(seed)
    n_empty_end, n_empty_mid = 7, 5
    n_kept = S - T - n_empty_end - n_empty_mid
    context = T + n_kept + 40  # positions of the block: context .. context + T − 1
    slot_pos = np.full((B, Hk, S), -1, np.int32)
    for b in range(B):
        for h in range(Hk):
            kept = np.sort(r.choice(context, n_kept, replace=False))
            live = np.concatenate([kept, context + np.arange(T)])
            r.shuffle(live)
            mid = r.choice(np.arange(1, S - n_empty_end - 1), n_empty_mid, replace=False)
            slots = np.setdiff1d(np.arange(S - n_empty_end), mid)
            slot_pos[b, h, slots] = live
    query_pos = np.broadcast_to(context + np.arange(T, dtype=np.int32), (B, T)).copy()
    query_pos[1, 0] = -1
    if T > 1:
        query_pos[0, 1] = -1
    q = jnp.asarray(r.normal(size=(B, T, Hk * G, K)) * 1.5, dtype)
    k = jnp.asarray(r.normal(size=(B, Hk, S, K)) * 1.5, dtype)
    v = jnp.asarray(r.normal(size=(B, Hk, S, K)), dtype)
    weights = None
    if weighted:
        w = np.zeros((B, T), np.float32)
        w[:, -min(4, T) :] = r.uniform(0.5, 1.5, size=(B, min(4, T)))
        w[0, T // 2] = 0.7  # a scoring query in the middle of the block
        if weight_masked:
            w[1, 0] = 0.3
        weights = jnp.asarray(w)
    return q, k, v, jnp.asarray(slot_pos), jnp.asarray(query_pos), weights


def make_moments(seed, B, Hk, K, zeroth=False):
    """Statistics of some evicted tokens, with nothing evicted for row 0, KV head 0 (count 0);
    ``zeroth``: as a zeroth-order cache keeps them (no Σ v kᵀ)."""
    r = np.random.default_rng(seed + 100)
    count = r.integers(1, 20, size=(B, Hk)).astype(np.float32)
    count[0, 0] = 0.0
    ks = r.normal(size=(B, Hk, 20, K)) * 1.5
    vs = r.normal(size=(B, Hk, 20, K))
    take = (np.arange(20)[None, None] < count[..., None]).astype(np.float64)
    return Moments(
        count=jnp.asarray(count),
        k_sum=jnp.asarray(np.einsum("bhe,bhek->bhk", take, ks), jnp.float32),
        v_sum=jnp.asarray(np.einsum("bhe,bhek->bhk", take, vs), jnp.float32),
        vk_sum=jnp.zeros((B, Hk, 0, 0), jnp.float32)
        if zeroth
        else jnp.asarray(np.einsum("bhe,bhei,bhej->bhij", take, vs, ks), jnp.float32),
    )


def assert_close(got, want, dtype, name):
    atol_frac, rtol = TOLERANCE[jnp.dtype(dtype).name][name]
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    # lse: absolute atol (a fully masked row's lse is about -1e30, which must not set the scale)
    atol = atol_frac if name == "lse" else atol_frac * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


def assert_outputs_close(got, want, dtype):
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype == jnp.float32
    for name, g, w in zip(("out", "lse", "col"), got, want):
        if w is None:
            assert g is None, name
        else:
            assert g.dtype == w.dtype, name
            assert_close(g, w, dtype, name)


# --- kernels against the references (Pallas interpreter on CPU)
# --------------------------------------------

# (head dim, G, score, weighted, dtype): every value of every factor, with both kernels.
BLOCK_GRID = [
    (64, 1, "attn", True, jnp.float32),
    (64, 3, "obcache-value", True, jnp.bfloat16),
    (64, 4, "obcache-key", True, jnp.float32),
    (64, 8, "obcache-joint", True, jnp.bfloat16),
    (128, 1, "obcache-joint", True, jnp.float32),
    (128, 3, "obcache-key", True, jnp.bfloat16),
    (128, 4, "attn", True, jnp.bfloat16),
    (128, 8, "obcache-value", True, jnp.float32),
    (64, 3, "attn", False, jnp.float32),
    (128, 4, "obcache-joint", False, jnp.bfloat16),
]
KERNELS = {
    # block_k 128 (TPU lanes) / 64 (GPU): S = 300 needs 3 / 5 key tiles, the last one partly
    # padding.
    # TPU: T = 20 is padded to 32 rows per head; row tiles of 48 rows (all heads together) straddle
    # heads.
    # GPU: query tiles of 16: T = 20 needs 2 per head, the last one mostly padding.
    "tpu": lambda *a, **kw: block_tpu.block_attention_tpu(
        *a, **kw, block_k=128, block_q=48, interpret=True
    ),
    "gpu": lambda *a, **kw: block_gpu.block_attention_gpu(
        *a, **kw, block_k=64, block_q=16, interpret=True
    ),
}


def _case_id(case):
    K, G, score, weighted, dtype = case
    return f"K{K}-G{G}-{score}-{'w' if weighted else 'now'}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", BLOCK_GRID, ids=_case_id)
def test_block_kernel_equals_reference(case, kernel):
    K, G, score, weighted, dtype = case
    q, k, v, slot_pos, query_pos, w = make_case(
        G * K, G=G, K=K, dtype=dtype, weighted=weighted, weight_masked=(G == 3)
    )
    want = block_ref.block_attention_with_scores(q, k, v, slot_pos, query_pos, w, score)
    got = KERNELS[kernel](q, k, v, slot_pos, query_pos, w, score)
    assert_outputs_close(got, want, dtype)


DECODE_GRID = [  # (head dim, G, score, weighted, dtype, moments: None / "first" / "zeroth")
    (64, 1, "obcache-key", True, jnp.float32, "first"),
    (64, 3, "obcache-joint", True, jnp.bfloat16, "zeroth"),
    (64, 4, "attn", False, jnp.float32, "first"),
    (128, 4, "obcache-value", True, jnp.bfloat16, None),
    (128, 8, "attn", True, jnp.float32, "zeroth"),
    (128, 3, "obcache-joint", True, jnp.float32, None),
]
DECODE_KERNELS = {
    "tpu": {"impl": "pallas_tpu", "block_k": 128},
    "gpu": {
        "impl": "pallas_gpu",
        "block_k": 32,
    },  # 10 key tiles over S = 300: 5 softmax splits of 2 tiles
}


@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
@pytest.mark.parametrize("case", DECODE_GRID, ids=lambda c: _case_id(c[:5]) + f"-{c[5]}")
def test_decode_kernel_equals_reference(case, kernel):
    K, G, score, weighted, dtype, correction = case
    q, k, v, slot_pos, query_pos, w = make_case(
        G * K + 1, T=1, G=G, K=K, dtype=dtype, weighted=weighted
    )
    # row 1's query is fully masked (position -1) and still weighted: finite reference values
    if weighted:
        w = jnp.asarray([[1.0], [0.5]])
    zeroth = correction == "zeroth"
    moments = None if correction is None else make_moments(G, 2, 2, K, zeroth)
    want = decode_ref.decode_attention_with_scores(
        q, k, v, slot_pos, query_pos, w, score, moments, zeroth
    )
    got = decode_attention_with_scores(
        q,
        k,
        v,
        slot_pos,
        query_pos,
        w,
        score,
        moments,
        zeroth,
        interpret=True,
        **DECODE_KERNELS[kernel],
    )
    assert_outputs_close(got, want, dtype)
    # The same layer in the middle of a stack of three (the cache's layout), read in place at a
    # traced index, its moments too.
    other = jax.random.normal(jax.random.key(G), (2, *k.shape), dtype)
    k3, v3 = jnp.stack([other[0], k, other[1]]), jnp.stack([other[1], v, other[0]])
    if moments is not None:
        around = make_moments(G + 1, 2, 2, K, zeroth)
        moments = jax.tree.map(lambda a, o: jnp.stack([o, a, o * 2]), moments, around)
    stacked = jax.jit(
        lambda k3, v3, layer: decode_attention_with_scores(
            q,
            k3,
            v3,
            slot_pos,
            query_pos,
            w,
            score,
            moments,
            zeroth,
            layer=layer,
            interpret=True,
            **DECODE_KERNELS[kernel],
        )
    )
    assert_outputs_close(stacked(k3, v3, jnp.int32(1)), want, dtype)


def test_decode_splits_grow_for_few_heads_over_a_long_cache():
    """Flash-decoding's default splits per (row, KV head): 8, more when rows × KV heads are few and
    the cache long (about 256 programs, each over at least 512 slots)."""
    assert decode_splits(8, 4160) == 8  # the 8B at batch 1 over 4K: as before
    assert decode_splits(8, 32832) == 32  # ... over 32K: 256 programs
    assert decode_splits(64, 32832) == 8  # batch 8
    assert decode_splits(3, 8192) == 16  # SmolLM2 at batch 1 over 8K: 512 slots per split
    assert decode_splits(1, 1024) == 8 and decode_splits(8, 32832, splits=5) == 5


@pytest.mark.parametrize("score", ["attn", "obcache-joint"])
def test_gpu_decode_kernel_over_many_splits_equals_reference(score):
    """Two rows of one KV head over 5,200 slots, slots 1,300 … 3,899 empty: the default makes 10
    splits of 9 key tiles (576 slots), of which splits 3, 4 and 5 hold no token (partials m = -inf,
    l = 0)."""
    S = 5200
    q, k, v, slot_pos, query_pos, w = make_case(11, B=2, T=1, Hk=1, G=4, S=S)
    slot_pos = jnp.where((jnp.arange(S) < 1300) | (jnp.arange(S) >= 3900), slot_pos, -1)
    assert decode_splits(2, S) == 10
    want = decode_ref.decode_attention_with_scores(q, k, v, slot_pos, query_pos, w, score)
    got = decode_attention_with_scores(
        q, k, v, slot_pos, query_pos, w, score, impl="pallas_gpu", interpret=True
    )
    assert_outputs_close(got, want, jnp.float32)


@pytest.mark.parametrize("kernel", ["pallas_tpu", "pallas_gpu"])
def test_key_score_survives_a_slot_taking_all_the_attention(kernel):
    """Slot 5 takes 99.9% of the attention of every query (o ≈ v_5) and ‖v‖² is large: ‖v_5 − o‖² ≈
    1e-4 must come from the difference itself. The expansion ‖v‖² − 2 v·o + ‖o‖² in float32 is off
    by about ‖v‖²·1e-7 ≈ 1e-2 there (checked below), a hundred times the value."""
    B, T, Hk, G, S, K = 1, 4, 1, 1, 40, 64
    r = np.random.default_rng(7)
    k = r.normal(size=(B, Hk, S, K))
    v = r.normal(size=(B, Hk, S, K)) + 30.0  # ‖v‖² ≈ 6e4
    q = np.repeat(k[:, :, 5][:, None], T, axis=1) * 1.6 + r.normal(size=(B, T, Hk * G, K)) * 0.05
    slot_pos = np.broadcast_to(np.arange(S, dtype=np.int32), (B, Hk, S))
    query_pos = np.full((B, T), S, np.int32)
    w = np.ones((B, T), np.float32)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [
        jnp.asarray(slot_pos),
        jnp.asarray(query_pos),
        jnp.asarray(w),
    ]
    _, _, col = block_attention_with_scores(*args, "obcache-key", impl=kernel, interpret=True)
    # float64 ground truth
    z = np.einsum("bthk,bhsk->bhts", q, k) / np.sqrt(K)
    a = np.exp(z - z.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("bhts,bhsk->bhtk", a, v)
    dist = np.sum((v[:, :, None] - o[:, :, :, None]) ** 2, -1)  # [B, Hk, T, S]
    want = np.sum((a * z) ** 2 * dist, axis=2)[:, :, None]  # [B, Hk, G=1, S]
    assert (a[0, 0, :, 5] > 0.998).all() and (dist[0, 0, :, 5] < 1e-3).all()
    np.testing.assert_allclose(np.asarray(col), want, rtol=1e-2, atol=1e-6 * np.abs(want).max())
    # the expansion would not pass: its float32 rounding alone exceeds the value at slot 5
    v32, o32 = v.astype(np.float32)[0, 0, 5], o.astype(np.float32)[0, 0]
    expanded = (v32 @ v32) - 2 * (o32 @ v32) + np.sum(o32 * o32, -1)
    assert np.abs(expanded - dist[0, 0, :, 5]).max() > 10 * dist[0, 0, :, 5].max()


def test_api_default_is_the_reference_on_cpu_and_pallas_is_the_interpreted_tpu_kernel():
    q, k, v, slot_pos, query_pos, w = make_case(3, T=6, S=40, G=3)
    args = (q, k, v, slot_pos, query_pos, w, "obcache-joint")
    ref = jax.jit(lambda *a: block_ref.block_attention_with_scores(*a, "obcache-joint"))(*args[:6])
    default = jax.jit(lambda *a: block_attention_with_scores(*a, "obcache-joint"))(*args[:6])
    for got, want in zip(default, ref):  # the same program
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    pallas = jax.jit(lambda *a: block_attention_with_scores(*a, "obcache-joint", impl="pallas"))(
        *args[:6]
    )
    assert_outputs_close(
        pallas, ref, jnp.float32
    )  # the TPU kernel, interpreted (no cpu kernel otherwise)
    jaxpr = str(
        jax.make_jaxpr(lambda *a: block_attention_with_scores(*a, "obcache-joint", impl="pallas"))(
            *args[:6]
        )
    )
    assert (
        "platform_index" in jaxpr and jaxpr.count("pallas_call") == 2 * 3
    )  # cpu / tpu / cuda branches
    assert (
        jax.eval_shape(lambda *a: block_attention_with_scores(*a, impl="pallas"), *args[:5])[2]
        is None
    )
    with pytest.raises(ValueError, match="score"):
        block_attention_with_scores(*args[:6], "attention")
    with pytest.raises(ValueError, match="impl"):
        block_attention_with_scores(*args, impl="triton")


# --- lowering for TPU and GPU from this CPU machine
# -------------------------------------------------------

GEOMETRIES = {  # name -> (Hk, G, K, S): budget 512 + 1 spare slot (decode) or + a 128-token block
    "smollm2-513": (3, 3, 64, 513),
    "smollm2-640": (3, 3, 64, 640),
    "llama3-8b": (8, 4, 128, 1024 + 128),
}


def _structs(kind, Hk, G, K, S, dtype=jnp.bfloat16, B=1):
    T = 128 if kind == "block" else 1
    f32, i32 = jnp.float32, jnp.int32
    return [
        jax.ShapeDtypeStruct((B, T, Hk * G, K), dtype),
        jax.ShapeDtypeStruct((B, Hk, S, K), dtype),
        jax.ShapeDtypeStruct((B, Hk, S, K), dtype),
        jax.ShapeDtypeStruct((B, Hk, S), i32),
        jax.ShapeDtypeStruct((B, T), i32),
        jax.ShapeDtypeStruct((B, T), f32),
    ]


def _moment_structs(Hk, K, B=1):
    f32 = jnp.float32
    return (
        jax.ShapeDtypeStruct((B, Hk), f32),
        jax.ShapeDtypeStruct((B, Hk, K), f32),
        jax.ShapeDtypeStruct((B, Hk, K), f32),
        jax.ShapeDtypeStruct((B, Hk, K, K), f32),
    )


def _custom_calls(fn, platform, *structs):
    checks = GPU_EXPORT_CHECKS if platform == "cuda" else []
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
        *structs
    )
    return re.findall(r"custom_call @([\w$.]+)", exported.mlir_module())


# (platform, impl, the custom call its kernels lower to)
LOWERINGS = [("tpu", "pallas_tpu", "tpu_custom_call"), ("cuda", "pallas_gpu", TRITON_CALL)]


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("platform,impl,call", LOWERINGS)
def test_block_kernels_lower_at_model_shapes(geometry, platform, impl, call):
    Hk, G, K, S = GEOMETRIES[geometry]
    structs = _structs("block", Hk, G, K, S)
    for score in SCORES:
        calls = _custom_calls(
            lambda *a, s=score: block_attention_with_scores(*a, s, impl=impl), platform, *structs
        )
        assert calls == [call, call], (score, calls)  # the softmax pass and the scores pass
    calls = _custom_calls(
        lambda *a: block_attention_with_scores(*a[:5], impl=impl), platform, *structs
    )
    assert calls == [call], calls  # no weights: the softmax pass only


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("platform,impl,call", LOWERINGS)
def test_decode_kernels_lower_at_model_shapes(geometry, platform, impl, call):
    Hk, G, K, S = GEOMETRIES[geometry]
    structs = _structs("decode", Hk, G, K, S)
    for score in SCORES:
        # TPU: one call, both phases; GPU: split softmax + scores, "attn" from the softmax's logits
        passes = 1 if platform == "tpu" or score == "attn" else 2

        def fn(*a, score=score):
            return decode_attention_with_scores(*a[:6], score, Moments(*a[6:]), impl=impl)

        calls = _custom_calls(fn, platform, *structs, *_moment_structs(Hk, K))
        assert calls == [call] * passes, (score, calls)


@pytest.mark.parametrize("platform,impl,call", LOWERINGS)
def test_decode_kernels_read_their_layer_of_the_stacked_cache_in_place(platform, impl, call):
    """With ``layer``, every kernel call takes the whole [L, B, Hk, S, K] keys and values (no slice
    of them is made to hand it a layer), and the XLA reference on the same arguments equals the
    stack's layer."""
    Hk, G, K, S = GEOMETRIES["smollm2-513"]
    q, k, v, *rest = _structs("decode", Hk, G, K, S)
    stack = jax.ShapeDtypeStruct((30, *k.shape), k.dtype)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    checks = GPU_EXPORT_CHECKS if platform == "cuda" else []
    fn = jax.jit(
        lambda q, k, v, sp, qp, w, layer: decode_attention_with_scores(
            q, k, v, sp, qp, w, "obcache-joint", layer=layer, impl=impl
        )
    )
    text = jax.export.export(fn, platforms=[platform], disabled_checks=checks)(
        q, stack, stack, *rest, layer
    )
    text = text.mlir_module()
    calls = [line for line in text.splitlines() if f"custom_call @{call}" in line]
    whole = "x".join(map(str, stack.shape)) + "xbf16"
    assert calls and all(line.count(whole) == 2 for line in calls), calls
    assert "dynamic_slice" not in text
    case = make_case(5, T=1, G=G, K=K, S=40, Hk=Hk)
    k3 = jnp.stack([case[1] * 2, case[1], -case[1]])
    v3 = jnp.stack([-case[2], case[2], case[2] * 3])
    got = decode_attention_with_scores(case[0], k3, v3, *case[3:], layer=jnp.int32(1), impl="xla")
    assert_outputs_close(got, decode_ref.decode_attention_with_scores(*case), jnp.float32)


@pytest.mark.parametrize("platform,call", [(p, c) for p, _, c in LOWERINGS])
def test_full_cache_decode_lowers_to_the_decode_kernel_over_the_whole_stack(platform, call):
    """The full cache's decode step (T = 1) is the platform's decode kernel, handed the whole
    stacked cache; with impl="xla" (``FullCache.impl``) it is XLA's attention, no kernel."""
    L, B, Hk, G, K, S = 4, 2, 3, 3, 64, 320
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=256,
        d_model=128,
        n_layers=L,
        n_heads=Hk * G,
        n_kv_heads=Hk,
        head_dim=K,
        d_ff=256,
        max_seq_len=1024,
    )
    q = jax.ShapeDtypeStruct((B, 1, Hk * G, K), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, 1, Hk, K), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((B, 1), jnp.int32)

    def step(cache, q, k, v, pos, layer):
        return cache.attend(layer, q, k, v, Segment(positions=pos, from_start=False))

    def lowered(impl):
        cache = jax.eval_shape(lambda: FullCache.init(cfg, B, S, jnp.bfloat16, impl))
        checks = GPU_EXPORT_CHECKS if platform == "cuda" else []
        return jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=checks)(
            cache, q, kv, kv, pos, jax.ShapeDtypeStruct((), jnp.int32)
        ).mlir_module()

    calls = [line for line in lowered(None).splitlines() if f"custom_call @{call}" in line]
    assert calls and all(f"{L}x{B}x{Hk}x{S}x{K}xbf16" in line for line in calls), calls
    assert f"custom_call @{call}" not in lowered("xla")


@pytest.mark.parametrize(
    "platform,call,other",
    [("tpu", "tpu_custom_call", TRITON_CALL), ("cuda", TRITON_CALL, "tpu_custom_call")],
)
def test_default_impl_lowers_to_the_kernel_of_the_platform(platform, call, other):
    """impl=None is ``platform_dependent``: exported for one platform, only that platform's kernel
    remains; exported for CPU, no kernel at all (the reference)."""
    Hk, G, K, S = GEOMETRIES["smollm2-513"]
    for kind, fn in (
        ("block", lambda *a: block_attention_with_scores(*a, "obcache-value")),
        ("decode", lambda *a: decode_attention_with_scores(*a, "attn")),
    ):
        calls = _custom_calls(fn, platform, *_structs(kind, Hk, G, K, S))
        assert call in calls and other not in calls, (kind, calls)
        assert not _custom_calls(fn, "cpu", *_structs(kind, Hk, G, K, S)), kind


def test_a_head_dim_a_kernel_does_not_take_runs_the_reference_on_that_platform():
    """Head dim 8 (the tiny test models): the TPU kernel takes it, Triton's tl.dot does not (< 16).
    impl=None lowers the reference for CUDA instead of failing; asking for the Triton kernel says
    why it cannot."""
    structs = _structs("block", 2, 2, 8, 40)
    fn = lambda *a: block_attention_with_scores(*a, "attn")  # noqa: E731
    assert _custom_calls(fn, "tpu", *structs) == ["tpu_custom_call"] * 2
    assert TRITON_CALL not in _custom_calls(fn, "cuda", *structs)
    with pytest.raises(ValueError, match="head dim 8 must be a power of two"):
        jax.eval_shape(lambda *a: block_attention_with_scores(*a, impl="pallas_gpu"), *structs)
