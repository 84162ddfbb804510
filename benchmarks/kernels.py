"""Pallas kernels of ``kvjax.kernels`` at SmolLM2-135M shapes: CPU time of the jnp reference and of
the kernels under the Pallas interpreter, and the bytes the kernels move versus what the reference
materialises.

    .venv/bin/python benchmarks/kernels.py                  # about 15 s on 2 (shared) cores
    .venv/bin/python benchmarks/kernels.py --repeats 5 --dtype bfloat16

What is measured here, on CPU only (no TPU or GPU was available, so neither compile success on the
device nor device timings are claimed): wall time of one jitted call, best of ``--repeats`` after
compiling, for the XLA reference (``impl="xla"``) and for the TPU-style and Triton-style kernels run
by the Pallas interpreter (``interpret=True``: a loop over the grid in XLA:CPU — it says nothing
about device speed, it only shows the kernels run end to end at real shapes); and XLA:CPU's
temporary-buffer size for the reference (``compiled.memory_analysis()``).

What is computed analytically from the shapes and the kernels' block schedules: the HBM bytes the
TPU kernels read and write per call (inputs fetched once per change of block index, as Pallas TPU
pipelining does; logical bytes, ignoring the (8, 128) tile padding of HBM layouts) and the wrapper's
copies (q transposed into per-head rows; the cache itself is never copied: the last key tile is
ragged and masked in the kernel), versus the sizes of the reference's materialised intermediates:
each [B, Hk, G, T, S] array (logits, softmax weights, score coefficients) and the [B, Hk, G, c, S,
K] differences v_s − o_t of each c-query chunk that scores (c = min(T, 8),
``kvjax.kernels.block_attention.reference.residual_sums``). XLA fuses some of the [T, S] arrays, so
that column is what the reference asks for, not what a given XLA version keeps live; the temp-buffer
column is what XLA:CPU kept.

Shapes: SmolLM2-135M (Hk = 3 KV heads, G = 3 query heads each, head dim 64), one sequence. Block
attention: T = 128 queries (a prefill block), S = 640 slots (budget 512 + one block), SnapKV-style
weights (the last 32 queries score). Decode: T = 1, S = 513 slots (budget 512 + 1), weight 1.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from kvjax.kernels import block_attention_with_scores, decode_attention_with_scores
from kvjax.kernels._shared import next_pow2, round_up
from kvjax.kernels.block_attention import tpu as block_tpu
from kvjax.kernels.block_attention.reference import RESIDUAL_CHUNK

HK, G, K = 3, 3, 64  # SmolLM2-135M
BLOCK_T, BLOCK_S, WINDOW = 128, 640, 32
DECODE_S = 513
LANES = 128


def inputs(T, S, dtype, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(1, T, HK * G, K)), dtype)
    k = jnp.asarray(r.normal(size=(1, HK, S, K)), dtype)
    v = jnp.asarray(r.normal(size=(1, HK, S, K)), dtype)
    context = S - T
    slot_pos = jnp.asarray(np.broadcast_to(np.arange(S, dtype=np.int32), (1, HK, S)))
    query_pos = jnp.asarray(context + np.arange(T, dtype=np.int32)[None])
    w = np.zeros((1, T), np.float32)
    w[:, -min(WINDOW, T) :] = 1.0
    return q, k, v, slot_pos, query_pos, jnp.asarray(w)


def best_ms(fn, args, repeats):
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times), compiled


def tpu_block_bytes(T, S, s, score):
    """(read, written, wrapper copies) bytes of ``block_tpu.block_attention_tpu``'s two
    pallas_calls, from its
    tiling: rows of all G heads in tiles of br, key tiles of bk; a block is fetched again only when
    its index changes between consecutive grid steps."""
    B, H = 1, HK * G
    bk = min(block_tpu.DEFAULT_BLOCK_K, S)
    Tp = round_up(T, block_tpu.ROW_ALIGN)
    br = min(block_tpu.DEFAULT_BLOCK_ROWS, G * Tp)
    n_rows = round_up(G * Tp, br)
    nr, nk = n_rows // br, -(-S // bk)
    kv, spos, packed = (
        B * HK * S * K * s,
        B * HK * S * 4,
        B * HK * n_rows * LANES * 4,
    )  # ragged last tile: no pad
    key_terms = score in ("obcache-key", "obcache-joint")
    # pass 1, grid (b, h, row tile, key tile): q rows and the packed row vector once, K/V/positions
    # per row tile
    read = B * HK * n_rows * K * s + packed + nr * (2 * kv + spos)
    written = B * HK * n_rows * K * 4 + packed  # o (float32), packed row vector with m, l
    # pass 2, grid (b, h, key tile, row tile): K (V) once; row-side blocks once if one row tile,
    # else per key tile
    refetch = 1 if nr == 1 else nk
    read += kv * (1 if score == "attn" else 2) + spos
    read += refetch * (
        B * HK * n_rows * K * s + packed + (B * HK * n_rows * K * 4 if key_terms else 0)
    )
    written += B * HK * round_up(G, 8) * S * 4
    copies = (
        B * T * H * K * s + B * HK * n_rows * K * s
    )  # q into per-head rows (the cache is never copied)
    return read, written, copies


def tpu_decode_bytes(S, s, score):
    """(read, written, wrapper copies) bytes of ``decode_tpu.decode_attention_tpu``: one
    pallas_call, grid (b, h, phase, key tile); phase 1 reads K (and V, except for attn) again."""
    B = 1
    gp = round_up(G, 8 if s == 4 else 16)
    kv = B * HK * S * K * s  # ragged last tile: no pad
    read = B * HK * gp * K * s + 2 * kv + (2 * kv if score != "attn" else kv) + 2 * B * HK * S * 4
    written = B * HK * gp * (K + LANES) * 4 + B * HK * gp * S * 4
    copies = B * HK * gp * K * s  # q padded to gp rows per KV head
    return read, written, copies


def reference_intermediates(T, S, s, score, scoring_queries):
    """Bytes of the [B, Hk, G, T, S] arrays the reference builds, and of its difference tensors."""
    ts = HK * G * T * S * 4
    n = 4 + (
        1 if s == 2 else 0
    )  # z, logits, exp, weights (+ weights cast to bf16, counted as f32 here)
    n += {"attn": 1, "obcache-value": 1, "obcache-key": 3, "obcache-joint": 4}[
        score
    ]  # w·A / A², z0, coefs
    c = min(
        T, RESIDUAL_CHUNK
    )  # queries per chunk of kvjax.kernels.block_attention.reference.residual_sums
    chunks = -(-scoring_queries // c) if score in ("obcache-key", "obcache-joint") else 0
    return n * ts, chunks * HK * G * c * S * K * 4


def mib(x):
    return f"{x / 2**20:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--scores", nargs="+", default=["attn", "obcache-joint"])
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    s = dtype.itemsize
    rows = []
    for op in ("block", "decode"):
        T, S = (BLOCK_T, BLOCK_S) if op == "block" else (1, DECODE_S)
        data = inputs(T, S, dtype)
        fn = block_attention_with_scores if op == "block" else decode_attention_with_scores
        for score in args.scores:
            timings, ref_temp = {}, None
            for impl in ("xla", "pallas_tpu", "pallas_gpu"):
                ms, compiled = best_ms(
                    lambda *a, fn=fn, impl=impl, score=score: fn(
                        *a, score, impl=impl, interpret=True
                    ),
                    data,
                    args.repeats,
                )
                timings[impl] = ms
                if impl == "xla":
                    ref_temp = compiled.memory_analysis().temp_size_in_bytes
            if op == "block":
                read, written, copies = tpu_block_bytes(T, S, s, score)
            else:
                read, written, copies = tpu_decode_bytes(S, s, score)
            ts_bytes, diff_bytes = reference_intermediates(T, S, s, score, min(WINDOW, T))
            rows.append(
                (
                    f"{op} (T={T}, S={S})",
                    score,
                    timings["xla"],
                    timings["pallas_tpu"],
                    timings["pallas_gpu"],
                    read,
                    written,
                    copies,
                    ts_bytes,
                    diff_bytes,
                    ref_temp,
                )
            )
            print(f"  measured {op} {score}", flush=True)

    print(
        f"\nSmolLM2-135M shapes (Hk={HK}, G={G}, K={K}, batch 1), {dtype.name}, CPU "
        f"({jax.devices()[0].device_kind}), best of {args.repeats}; jax {jax.__version__}. "
        "Kernel times are the Pallas *interpreter* on CPU; no TPU/GPU compile or timing was "
        "possible here.\n"
    )
    print(
        "| operation | score | XLA reference, CPU (ms) | TPU kernel, interpreted (ms) | Triton "
        "kernel, "
        "interpreted (ms) | TPU kernels read (MiB) | TPU kernels write (MiB) | wrapper copies "
        "(MiB) | "
        "reference [G, T, S] arrays (MiB) | reference differences (MiB) | reference XLA:CPU temp "
        "(MiB) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op, score, t_ref, t_tpu, t_gpu, read, written, copies, ts_bytes, diff_bytes, temp in rows:
        print(
            f"| {op} | {score} | {t_ref:.2f} | {t_tpu:.1f} | {t_gpu:.1f} | {mib(read)} | "
            f"{mib(written)} | "
            f"{mib(copies)} | {mib(ts_bytes)} | {mib(diff_bytes)} | {mib(temp)} |"
        )
    print(
        f"\nInputs for reference: q+K+V+positions = "
        f"{mib(BLOCK_T * HK * G * K * s + 2 * HK * BLOCK_S * K * s + 4 * HK * BLOCK_S)} MiB "
        "(block), "
        f"{mib(HK * G * K * s + 2 * HK * DECODE_S * K * s + 4 * HK * DECODE_S)} MiB (decode). "
        "The byte columns model the TPU kernels only; the Triton kernels (block: one program per "
        "query head "
        f"and query tile, K/V tiles re-read per program; decode: G = {G} rows padded to "
        f"{max(16, next_pow2(G))}, tl.dot's minimum) are not modelled."
    )


if __name__ == "__main__":
    main()
