"""The full cache's causal prompt attention on this CPU in several chunk shapes: what
``kvjax.kernels.causal_attention`` picks on CPU, against one product per 256 queries (its form
before, and still on TPU and for float32 on GPU).

    .venv/bin/python benchmarks/prefill_attention.py            # about 9 minutes on 2 cores
    .venv/bin/python benchmarks/prefill_attention.py --lengths 1024 4096 --model-lengths 1024

A shape is (span, tile): the queries of a span share one static key length (keys 0 … end of span); a
span's queries go through the product ``tile`` at a time in a ``lax.map`` ("-": the whole span in
one product). Two tables: one layer's attention alone (SmolLM2-135M's heads: 3 KV heads of 3 query
heads, head dim 64; float32, one row, random inputs), and SmolLM2-135M-Instruct's whole prefill of
one prompt (random ids, float32) with each shape in place of the CPU's choice. The second decides:
there the products of unrolled spans run side by side with the rest of the layer, which one layer's
attention alone does not show. "first s" is the first call (compilation included), then the best of
the next ``--repeats`` calls.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import kvjax.kernels.prompt_attention as prompt_attention
import numpy as np
from kvjax.kernels.prompt_attention import (
    CPU_SHORT,
    CPU_SHORT_SPAN,
    CPU_SPAN,
    CPU_TILE,
    PREFILL_CHUNK,
    chunked_causal_attention,
)

import kvjax
from kvjax.runtime.decoding import Generation
from kvjax.runtime.sampling import Sampling

SHAPES = [
    (PREFILL_CHUNK, None),
    (CPU_SHORT_SPAN, None),
    (64, None),
    (CPU_SPAN, CPU_TILE),
    (CPU_SPAN, 128),
]


def measure(T: int, span: int, tile: int | None, repeats: int) -> tuple[float, float]:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, T, 9, 64))
    k, v = (jax.random.normal(key, (1, 3, T, 64)) for key in keys[1:])
    fn = jax.jit(functools.partial(chunked_causal_attention, span=span, tile=tile))
    return timed(lambda: fn(q, k, v), repeats)


def timed(call, repeats: int) -> tuple[float, float]:
    """(first call's seconds, best of the next ``repeats``)."""
    start = time.perf_counter()
    jax.block_until_ready(call())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return first, min(times)


def chosen(T: int) -> tuple[int, int | None]:
    return (CPU_SHORT_SPAN, None) if T <= CPU_SHORT else (CPU_SPAN, CPU_TILE)


def row(T, span, tile, first, best, base) -> str:
    mark = "yes" if (span, tile) == chosen(T) else ""
    return (
        f"| {T} | {span} | {tile or '-'} | {first:.2f} | {best:.3f} | {base / best:.2f}x | {mark} |"
    )


HEAD = [
    "| tokens | span | tile | first s | best s | vs one product per 256 | kvjax's CPU choice |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="one layer"
    )
    parser.add_argument(
        "--model-lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="whole prefill"
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}, float32; first call, then the "
        "best of "
        f"{args.repeats}",
        end="\n\n",
    )
    print("One layer's causal attention (SmolLM2's heads):", end="\n\n")
    print("\n".join(HEAD))
    for T in args.lengths:
        base = None
        for span, tile in SHAPES:
            print(f"[layer {T}] span {span} tile {tile}", file=sys.stderr, flush=True)
            first, best = measure(T, span, tile, args.repeats)
            base = base or best
            print(row(T, span, tile, first, best, base), flush=True)
    params = kvjax.load("smollm2-135m-instruct")
    rng = np.random.default_rng(0)
    print(
        "\nSmolLM2-135M-Instruct's prefill of one prompt, each shape in place of the CPU's choice:",
        end="\n\n",
    )
    print("\n".join(HEAD))
    for T in args.model_lengths:
        prompt = rng.integers(0, params.config.vocab_size, T).astype(np.int32)
        base = None
        for span, tile in SHAPES:
            print(f"[model {T}] span {span} tile {tile}", file=sys.stderr, flush=True)
            prompt_attention.cpu_causal_attention = functools.partial(
                chunked_causal_attention, span=span, tile=tile
            )
            jax.clear_caches()  # the jitted prefill traced with the previous shape
            first, best = timed(
                lambda: (
                    Generation.from_prompts(
                        params, [prompt], 2, Sampling(), seed=0, stop_ids=(), ev=None
                    ).state
                ),
                args.repeats,
            )
            base = base or best
            print(row(T, span, tile, first, best, base), flush=True)


if __name__ == "__main__":
    main()
