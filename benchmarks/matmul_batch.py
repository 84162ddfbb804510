"""What batching can give on this CPU before any attention or eviction: one decode step's weight
products alone.

    .venv/bin/python benchmarks/matmul_batch.py            # about 1 minute on 2 cores

The matrix products of one SmolLM2-135M decode step (30 layers of the q/k/v projection (one product,
as kvjax's ``wqkv``), o, gate, up and down projections, then the 49,152-token head; float32, random
weights of the real shapes), for a batch of 1 and of 8 rows, done four ways: NumPy (OpenBLAS) over
per-layer arrays; XLA (``jax.jit``) unrolled over per-layer arrays; XLA over stacked [30, ...]
arrays in a ``lax.scan`` (kvjax's layout: each layer's weights are a dynamic slice of the stack);
and the same scan with the head. Each time is the best of ``--repeats`` rounds of ``--iters`` calls.
"batch-8 / batch-1 throughput" is 8 × t₁ / t₈: what batch 8 could give over batch 1 if a step did
nothing else. Markdown to stdout.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, D, HQ, HKV, FF, VOCAB = (
    30,
    576,
    576,
    192,
    1536,
    49152,
)  # SmolLM2-135M: 9 × 64 query, 3 × 64 KV dims
SHAPES = dict(wqkv=(D, HQ + 2 * HKV), wo=(HQ, D), gate=(D, FF), up=(D, FF), down=(FF, D))


def split_qkv(qkv):
    """[B, HQ + 2 HKV] -> q, k, v."""
    return qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]


def layer(x, w):
    """The products of one layer (a cheap nonlinearity between them: the products are what is
    measured)."""
    q, k, v = split_qkv(x @ w["wqkv"])
    x = x + (q + jnp.tile(k + v, (1, HQ // HKV))) @ w["wo"]
    return x + (jnp.tanh(x @ w["gate"]) * (x @ w["up"])) @ w["down"]


def numpy_step(x, layers, head):
    for w in layers:
        q, k, v = split_qkv(x @ w["wqkv"])
        x = x + (q + np.tile(k + v, (1, HQ // HKV))) @ w["wo"]
        x = x + (np.tanh(x @ w["gate"]) * (x @ w["up"])) @ w["down"]
    return x @ head


@jax.jit
def unrolled(x, layers, head):
    for w in layers:
        x = layer(x, w)
    return x @ head


@jax.jit
def scanned_layers_only(x, stacked):
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0]


@jax.jit
def scanned(x, stacked, head):
    return scanned_layers_only(x, stacked) @ head


def best_ms(fn, iters: int, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters * 1e3)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    def scaled(shape):
        return rng.standard_normal(shape, np.float32) / np.float32(4 * np.sqrt(shape[0]))

    layers = [
        {k: scaled(s) for k, s in SHAPES.items()} for _ in range(LAYERS)
    ]  # activations stay finite
    head = scaled((D, VOCAB))
    j_layers, j_head = jax.device_put(layers), jax.device_put(head)
    stacked = jax.device_put({k: np.stack([w[k] for w in layers]) for k in SHAPES})
    layers_mb = sum(a.size for w in layers for a in w.values()) * 4 / 2**20
    weights_mb = layers_mb + head.size * 4 / 2**20
    ways = {
        "NumPy (OpenBLAS), per-layer arrays": lambda x: lambda: numpy_step(x, layers, head),
        "XLA, per-layer arrays (unrolled)": lambda x: (
            lambda: unrolled(jnp.asarray(x), j_layers, j_head)
        ),
        "XLA, stacked arrays in lax.scan (kvjax)": lambda x: (
            lambda: scanned(jnp.asarray(x), stacked, j_head)
        ),
        "XLA, stacked arrays in lax.scan, layers only": lambda x: (
            lambda: scanned_layers_only(jnp.asarray(x), stacked)
        ),
    }
    print(
        f"SmolLM2-135M decode step, weight products only ({weights_mb:.0f} MiB of float32 "
        "weights); best of "
        f"{args.repeats} rounds of {args.iters} calls; GB/s: the products' weights read once per "
        "step. "
        f"jax {jax.__version__}, {jax.devices()[0].platform}."
    )
    print()
    print(
        "| products | batch 1 ms | batch 8 ms | batch-1 weight GB/s | batch-8 / batch-1 throughput "
        "|"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, make in ways.items():
        t = {
            b: best_ms(make(rng.standard_normal((b, D), np.float32)), args.iters, args.repeats)
            for b in (1, 8)
        }
        gbs = (layers_mb if "layers only" in name else weights_mb) * 2**20 / 1e9 / (t[1] / 1e3)
        print(
            f"| {name} | {t[1]:.2f} | {t[8]:.2f} | {gbs:.0f} | {8 * t[1] / t[8]:.2f}x |", flush=True
        )


if __name__ == "__main__":
    main()
