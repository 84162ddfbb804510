"""Quantized keys and values (``kvjax.kernels.quantized``) through every kernel of
``kvjax.kernels``.

* The references on ``Quantized`` inputs are, bit for bit, the references on their values in q's
  dtype (``values(k, q.dtype)``): dense block, decode (also reading a layer of a stack), paged block
  and paged decode; for int4, stored rotated (x H), the APIs attend with q H and rotate the output
  back, which equals attending over the values up to rounding (the kernels' tolerances).
* Both kernels of each operation — the Mosaic-TPU one under the Pallas interpreter (the paged ones
  under TPU interpret mode, ``STRICT`` for "attn"), the Triton one under the Pallas interpreter —
  equal the reference on the same ``Quantized`` inputs, for every kind in ``KV_DTYPES``; each kind
  meets "attn" and "obcache-joint", float32 and bfloat16 (``CASES``), with GQA (G = 3), empty slots,
  fully masked scoring queries, ragged last tiles, heads with no page and unused pages. Tolerances
  are those of tests/test_kernels.py (the same arithmetic once dequantized).
* The TPU paged kernels copy the codes and scales of used pages only, every copy awaited.
* Mixed or mismatched keys and values raise a ValueError naming them.
* ``jax.export`` lowers each quantized kernel for ``platforms=["tpu"]`` and ``["cuda"]`` at head
  dims 64 and 128; the decode kernels hand the whole stacked codes and scales to their calls (no
  ``dynamic_slice``: their layer is read in place). Quantized pools of 16-slot pages run the
  reference on TPU (8-bit codes need pages of 32 rows there) and the kernel on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_kernels as dense
import test_paged_kernels as paged
from kvjax.kernels import block_attention_with_scores, decode_attention_with_scores
from kvjax.kernels.paged_attention import (
    paged_block_attention_with_scores,
    paged_decode_attention_with_scores,
    tpu,
)
from kvjax.kernels.quantized import CODE_DTYPES, KV_DTYPES, ROTATED, Quantized, quantize, values

# (kind, score, dtype): each kind meets both scores and both dtypes.
CASES = [
    ("int8", "attn", jnp.float32),
    ("int8", "obcache-joint", jnp.bfloat16),
    ("float8_e4m3fn", "obcache-joint", jnp.float32),
    ("float8_e4m3fn", "attn", jnp.bfloat16),
    ("int4", "attn", jnp.bfloat16),
    ("int4", "obcache-joint", jnp.float32),
]
KERNELS = ("pallas_tpu", "pallas_gpu")
S, P, M = 150, 32, 7  # dense slots: 2 TPU key tiles (the last ragged), 5 of 32 on GPU; pages


def _case_id(case):
    kind, score, dtype = case
    return f"{kind}-{score}-{jnp.dtype(dtype).name}"


def quantized(args, kind: str, at=(1, 2)):
    """args with the keys and values (at ``at``) quantized as ``kind``."""
    return [quantize(x, kind) if i in at else x for i, x in enumerate(args)]


def dequantized(args, dtype, at=(1, 2)):
    return [values(x, dtype) if i in at else x for i, x in enumerate(args)]


def stack_of_three(x, seed):
    """Quantized x in the middle of a stack of three layers (the others noise of its kind)."""
    a, b = (quantize(jax.random.normal(jax.random.key(seed + i), x.shape), x.kind) for i in (0, 1))
    return dataclasses.replace(
        x, data=jnp.stack([a.data, x.data, b.data]), scale=jnp.stack([a.scale, x.scale, b.scale])
    )


@functools.cache
def dense_inputs(kind, dtype, T: int):
    """(q, k, v, slot_pos, query_pos, weights) of tests/test_kernels.py's cache, k and v quantized;
    decode: row 1's query fully masked and weighted."""
    args = dense.make_case(T + 3, T=T, G=3, S=S, K=64, dtype=dtype, weight_masked=True)
    if T == 1:
        args = (*args[:5], jnp.asarray([[1.0], [0.5]]))
    return quantized(args, kind)


@functools.cache
def paged_inputs(kind, dtype, T: int):
    """The paged cache of tests/test_paged_kernels.py (row 0's head 0 without a page, unused table
    entries, empty slots in used pages), its pools quantized."""
    args = paged.make_case(T + 5, B=3 if T == 1 else 2, T=T, G=3, K=64, P=P, M=M, dtype=dtype)
    return quantized(args, kind)


def block(*args, score, **kw):
    return block_attention_with_scores(*args, score=score, **kw)


def decode(*args, score, **kw):
    return decode_attention_with_scores(*args, score=score, **kw)


def paged_block(*args, score, **kw):
    return paged_block_attention_with_scores(*args, score=score, **kw)


def paged_decode(*args, score, **kw):
    return paged_decode_attention_with_scores(*args, score=score, **kw)


# op -> (function, inputs, T, tiles per kernel)
OPS = {
    "block": (block, dense_inputs, 6, {"pallas_tpu": {"block_k": 128, "block_q": 48}}),
    "decode": (decode, dense_inputs, 1, {"pallas_gpu": {"block_k": 32}}),
    "paged_block": (paged_block, paged_inputs, 6, {"pallas_tpu": {"block_q": 48}}),
    "paged_decode": (paged_decode, paged_inputs, 1, {}),
}


def interpret(op: str, kernel: str, score: str):
    """The TPU paged kernels under TPU interpret mode (STRICT; its race detection is slow on the key
    terms' per-row loop, so those run under the plain interpreter, as tests/test_paged_kernels.py
    does); everything else under the Pallas interpreter."""
    strict = kernel == "pallas_tpu" and op.startswith("paged") and score == "attn"
    return paged.STRICT if strict else True


# --- the references: dequantize, then the arrays' computation
# -----------------------------------------


@pytest.mark.parametrize("kind", KV_DTYPES)
def test_reference_on_quantized_is_the_reference_on_their_values(kind):
    for dtype in (jnp.float32, jnp.bfloat16):
        for op, (fn, inputs, T, _) in OPS.items():
            args = inputs(kind, dtype, T)
            for score in ("attn", "obcache-joint"):
                got = fn(*args, score=score, impl="xla")
                want = fn(*dequantized(args, dtype), score=score, impl="xla")
                if kind in ROTATED:  # q H over the stored domain, rotated back: rounding apart
                    dense.assert_outputs_close(got, want, dtype)
                    continue
                for g, w in zip(got, want, strict=True):
                    assert g.dtype == w.dtype, (op, score)
                    np.testing.assert_array_equal(
                        np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=op
                    )
    # a layer of the stack: the same as that layer alone
    args = dense_inputs(kind, jnp.bfloat16, 1)
    k3, v3 = stack_of_three(args[1], 1), stack_of_three(args[2], 2)
    got = decode(args[0], k3, v3, *args[3:], score="obcache-key", layer=jnp.int32(1), impl="xla")
    want = decode(*args, score="obcache-key", impl="xla")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# --- the kernels against the reference (interpreted)
# -----------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_on_quantized_equals_reference(case, op, kernel):
    kind, score, dtype = case
    fn, inputs, T, tiles = OPS[op]
    args = inputs(kind, dtype, T)
    want = paged.run(lambda *a: fn(*a, score=score, impl="xla"), *args)
    options = {"impl": kernel, "interpret": interpret(op, kernel, score), **tiles.get(kernel, {})}
    got = paged.run(lambda *a: fn(*a, score=score, **options), *args)
    dense.assert_outputs_close(got, want, dtype)
    if op == "decode":  # the same layer in the middle of a stack, read in place at a traced index
        k3, v3 = stack_of_three(args[1], 3), stack_of_three(args[2], 4)
        stacked = paged.run(
            lambda q, k, v, *rest: fn(q, k, v, *rest[:-1], score=score, layer=rest[-1], **options),
            *(args[0], k3, v3, *args[3:], jnp.int32(1)),
        )
        dense.assert_outputs_close(stacked, want, dtype)


@pytest.mark.parametrize("op", ["paged_block", "paged_decode"])
def test_tpu_paged_kernels_copy_codes_and_scales_of_used_pages_only(op, capfd):
    """tests/test_paged_kernels.py's copy check with quantized pools (two copies a page and pool on
    one semaphore): unused table entries point past the pool and copies land when started (EAGER);
    TPU interpret mode reports no read outside the pool, and no semaphore left non-zero."""
    fn, _, T, tiles = OPS[op]
    args = paged_inputs("int4", jnp.float32, T)
    N, M = args[1].shape[1], args[3].shape[-1]
    outside = jnp.where(jnp.arange(M) < args[4][..., None], args[3], N)
    want = paged.run(lambda *a: fn(*a, score="obcache-value", impl="xla"), *args)
    options = {"impl": "pallas_tpu", "interpret": paged.EAGER, **tiles.get("pallas_tpu", {})}
    got = paged.run(
        lambda *a: fn(*a, score="obcache-value", **options), *args[:3], outside, *args[4:]
    )
    dense.assert_outputs_close(got, want, jnp.float32)
    assert "non-zero count" not in capfd.readouterr().out


def test_keys_and_values_must_be_alike():
    args = dense_inputs("int8", jnp.float32, 1)
    plain = dequantized(args, jnp.float32)
    int4 = quantize(plain[2], "int4")
    for fn in (block, decode):
        with pytest.raises(ValueError, match="k, v must both be arrays or both Quantized"):
            fn(args[0], args[1], plain[2], *args[3:], score="attn")
        with pytest.raises(ValueError, match="Quantized 'int8' and Quantized 'int4'"):
            fn(args[0], args[1], int4, *args[3:], score="attn")
    stacked = jax.tree.map(lambda x: x[None], args[1])
    with pytest.raises(ValueError, match="k, v must both be arrays"):
        decode(args[0], stacked, plain[2][None], *args[3:], score="attn", layer=0)
    pages = paged_inputs("int8", jnp.float32, 1)
    for fn in (paged_block, paged_decode):
        with pytest.raises(ValueError, match="k_pages, v_pages must both be arrays"):
            fn(*pages[:2], values(pages[2]), *pages[3:], score="attn")
    bad = Quantized(args[1].data, args[1].scale[..., 0], "int8")
    with pytest.raises(ValueError, match=r"scales .* must be \[\.\.\., 1\]"):
        block(args[0], bad, bad, *args[3:], score="attn")


# --- lowering for TPU and GPU from this CPU machine
# ------------------------------------------------

TYPES = {"int8": "i8", "float8_e4m3fn": "f8E4M3FN", "int4": "ui8"}  # the codes in MLIR
GEOMETRIES = {64: (3, 3), 128: (8, 4)}  # head dim -> (Hk, G): SmolLM2's and Llama-3-8B's


def quantized_struct(shape, kind):
    width = shape[-1] // 2 if kind == "int4" else shape[-1]
    return Quantized(
        jax.ShapeDtypeStruct((*shape[:-1], width), CODE_DTYPES[kind]),
        jax.ShapeDtypeStruct((*shape[:-1], 1), jnp.bfloat16),
        kind,
    )


def lowered(fn, platform, *structs) -> str:
    checks = dense.GPU_EXPORT_CHECKS if platform == "cuda" else []
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)
    return exported(*structs).mlir_module()


def calls(text: str, call: str) -> list[str]:
    return [line for line in text.splitlines() if f"custom_call @{call}" in line]


@pytest.mark.parametrize("head_dim", sorted(GEOMETRIES))
@pytest.mark.parametrize("platform,impl,call", dense.LOWERINGS)
def test_quantized_kernels_lower_at_model_shapes(platform, impl, call, head_dim):
    """Block (T = 128 over 640 slots), decode over the layer of a 30-layer stack of 513 slots,
    paged block and decode (pages of 32, budget 512 + T): every kind lowers to the platform's
    kernels, the decode kernels taking the whole stacked codes and scales."""
    Hk, G = GEOMETRIES[head_dim]
    f32, i32, bf16, struct = jnp.float32, jnp.int32, jnp.bfloat16, jax.ShapeDtypeStruct
    decode_passes = 1 if platform == "tpu" else 2  # TPU: one call; GPU: split softmax + scores
    for kind in KV_DTYPES:
        kv = quantized_struct((1, Hk, 640, head_dim), kind)
        text = lowered(
            lambda *a: block(*a, score="obcache-joint", impl=impl),
            platform,
            *(struct((1, 128, Hk * G, head_dim), bf16), kv, kv),
            *(struct((1, Hk, 640), i32), struct((1, 128), i32), struct((1, 128), f32)),
        )
        assert len(calls(text, call)) == 2, (kind, "block")

        stack = quantized_struct((30, 1, Hk, 513, head_dim), kind)
        text = lowered(
            lambda q, k, v, sp, qp, w, layer: decode(
                q, k, v, sp, qp, w, score="obcache-joint", layer=layer, impl=impl
            ),
            platform,
            *(struct((1, 1, Hk * G, head_dim), bf16), stack, stack, struct((1, Hk, 513), i32)),
            *(struct((1, 1), i32), struct((1, 1), f32), struct((), i32)),
        )
        lines = calls(text, call)
        width = head_dim // 2 if kind == "int4" else head_dim
        codes, scales = f"30x1x{Hk}x513x{width}x{TYPES[kind]}", f"30x1x{Hk}x513x1xbf16"
        assert len(lines) == decode_passes, (kind, "decode")
        assert all(line.count(codes) == line.count(scales) == 2 for line in lines), lines
        assert "dynamic_slice" not in text, kind

        for T, fn, passes in ((128, paged_block, 2), (1, paged_decode, decode_passes)):
            m = -(-(512 + T) // P)
            pool = quantized_struct((1, 4 * Hk * m, P, head_dim), kind)
            text = lowered(
                lambda *a, fn=fn: fn(*a, score="obcache-joint", impl=impl),
                platform,
                *(struct((1, T, Hk * G, head_dim), bf16), pool, pool, struct((1, Hk, m), i32)),
                *(struct((1, Hk), i32), struct((1, Hk, m * P), i32)),
                *(struct((1, T), i32), struct((1, T), f32)),
            )
            assert len(calls(text, call)) == passes, (kind, fn.__name__)


def test_quantized_pools_of_16_slot_pages_run_the_reference_on_tpu():
    """8-bit codes pack 32 rows a TPU sublane tile: the TPU paged kernels take quantized pools in
    pages of 32, 64 or multiples of 128 only. Pages of 16 (the default) lower to the reference on
    TPU and to the kernel on CUDA; asking for the TPU kernel says why."""
    assert (
        tpu.supports(64, 16) and not tpu.supports(64, 16, "int8") and tpu.supports(64, 32, "int4")
    )
    Hk, G, K, m = 3, 3, 64, 33
    pool = quantized_struct((1, 4 * Hk * m, 16, K), "int8")
    i32, struct = jnp.int32, jax.ShapeDtypeStruct
    structs = [struct((1, 1, Hk * G, K), jnp.bfloat16), pool, pool, struct((1, Hk, m), i32)]
    structs += [struct((1, Hk), i32), struct((1, Hk, m * 16), i32), struct((1, 1), i32)]
    assert not calls(lowered(lambda *a: paged_decode(*a, score="attn"), "tpu", *structs), "tpu")
    text = lowered(lambda *a: paged_decode(*a, score="attn"), "cuda", *structs)
    assert len(calls(text, dense.TRITON_CALL)) == 1
    with pytest.raises(ValueError, match=r"page size 16 must be 32, 64 \(pools of int8 codes\)"):
        jax.eval_shape(lambda *a: paged_decode(*a, score="attn", impl="pallas_tpu"), *structs)
