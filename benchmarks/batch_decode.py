"""Where a batched decode step's time goes: ms per step at batch 1 and 8, against what reading the
weights and the cache once per step costs at this machine's measured bandwidth (SmolLM2, float32).

    .venv/bin/python benchmarks/batch_decode.py  # about 10 minutes on 2 cores
    .venv/bin/python benchmarks/batch_decode.py --contexts 1024 --caches full   # a quick look
    .venv/bin/python benchmarks/batch_decode.py --contexts 1024 --caches full 256 \
        --layers stacked unstacked
    .venv/bin/python benchmarks/batch_decode.py --contexts 2048 --caches 256 1024 --scorer momentkv

``--layers unstacked`` runs the model with ``kvjax.unstack_layers`` (a loop over per-layer arrays,
no slices).

For each (cache, context, batch): the best of ``--repeats`` timed runs of ``--steps`` greedy decode
steps after a compiled warm-up run. "floor ms" is the weights' and the cache's bytes (keys and
values of every row) divided by the bandwidth a batch-1 full-cache step at the shortest context (of
the first ``--layers``) reaches on the weights alone, i.e. the time a step would take if it did
nothing but stream them once. The matmuls, slice copies and other ops columns come from JAX's
profiler over one more run: the time XLA's CPU thunks spent per step in matrix products, in
dynamic-slice copies (a layer's weights and cache taken out of the stacked arrays by the layer scan)
and in everything else, summed over the thread pool's threads (so they may add up to more than the
step); "compile s" is one compilation of the decode loop. Markdown to stdout.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.cache.full import cache_bytes
from kvjax.runtime.decoding import Generation, decode_steps
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling
from kvjax.sharding import to_host

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from common import device_profile  # noqa: E402 - the GPU script's profiler reading (benchmarks/gpu/common.py)

MODEL = "smollm2-135m-instruct"


def run(
    params,
    context: int,
    batch: int,
    budget: int | None,
    steps: int,
    repeats: int,
    scorer: str,
    decode_order: str,
) -> dict:
    rng = np.random.default_rng(0)
    rows = [rng.integers(10, 40000, context).astype(np.int32) for _ in range(batch)]
    ev = (
        None
        if budget is None
        else eviction_from(context=context, budget=budget, scorer=scorer, decode_order=decode_order)
    )
    total = steps * (repeats + 2)  # warm-up, timed runs, profiled run
    gen = Generation.from_prompts(params, rows, total, Sampling(), 0, (), ev)
    gen.run(steps)  # compiles; the cache is now in its decoding shape
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gen.run(steps)
        jax.block_until_ready(gen.state.logits)
        best = min(best, (time.perf_counter() - start) / steps)
    ops = profile(gen, steps)
    stop = int(to_host(gen.state.step)) + 1
    jax.clear_caches()  # or the compilation below is the one the runs above made
    lowered = decode_steps.lower(
        params, gen.state, jnp.int32(total), jnp.int32(stop), Sampling(), (), gen.ev
    )
    start = time.perf_counter()
    lowered.compile()
    return dict(
        ms=1e3 * best,
        compile_s=time.perf_counter() - start,
        kv_bytes=cache_bytes(gen.state.cache, kv_only=True),
        **ops,
    )


def profile(gen: Generation, steps: int) -> dict:
    """ms per step the thunks spent in matmuls, dynamic-slice copies and the rest (a traced run)."""

    def run():
        gen.run(steps)
        return gen.state.logits

    found = collections.Counter()
    # every XLA:CPU thunk's name, ms per step
    for name, ms in device_profile(run, steps, top=None)["top"]:
        kind = (
            "matmul_ms"
            if name.startswith(("dot", "ynn"))
            else "slice_ms"
            if name.startswith("dynamic-slice")
            else "other_ms"
        )
        found[kind] += ms
    return {kind: found[kind] for kind in ("matmul_ms", "slice_ms", "other_ms")}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument(
        "--caches",
        nargs="+",
        default=["full", "256", "1024"],
        help="full, or a budget in tokens per layer and KV head",
    )
    parser.add_argument("--scorer", default="snapkv", help="the budget caches' scorer")
    parser.add_argument(
        "--decode-order", default="attend-first", choices=["attend-first", "evict-first"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--layers",
        nargs="+",
        default=["stacked"],
        choices=["stacked", "unstacked"],
        help="the layers' layout: stacked (lax.scan) or unstacked (kvjax.unstack_layers)",
    )
    args = parser.parse_args()

    loaded = kvjax.load(MODEL)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(loaded))
    results = {}
    for layers in args.layers:
        params = kvjax.unstack_layers(loaded) if layers == "unstacked" else loaded
        for cache in args.caches:
            budget = None if cache == "full" else int(cache)
            for context in args.contexts:
                if budget is not None and budget >= context:
                    continue
                for batch in args.batches:
                    r = results[layers, cache, context, batch] = run(
                        params,
                        context,
                        batch,
                        budget,
                        args.steps,
                        args.repeats,
                        args.scorer,
                        args.decode_order,
                    )
                    print(
                        f"[{layers} {cache} {context} x{batch}: {r['ms']:.1f} ms/step]",
                        flush=True,
                        file=sys.stderr,
                    )
    base = results.get((args.layers[0], "full", min(args.contexts), 1))
    bandwidth = (
        weights / (base["ms"] / 1e3) if base else float("nan")
    )  # bytes/s streaming the weights alone
    print(
        f"SmolLM2-135M-Instruct, float32, CPU ({jax.device_count()} device, {os.cpu_count()} "
        "cores); "
        f"budget caches' scorer {args.scorer} ({args.decode_order}); weights {weights / 1e6:.0f} "
        "MB; "
        f"bandwidth taken as weights / batch-1 full-cache step at {min(args.contexts)} tokens = "
        f"{bandwidth / 1e9:.1f} GB/s; best of {args.repeats} runs of {args.steps} steps\n"
    )
    print(
        "| layers | cache | context | batch | ms/step | KV MB | floor ms | step / floor | tokens/s "
        "| "
        "batch-8 / batch-1 throughput | matmuls ms | slice copies ms | other ops ms | compile s |"
    )
    print(
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |"
    )
    for (layers, cache, context, batch), r in results.items():
        floor = 1e3 * (weights + r["kv_bytes"]) / bandwidth
        rate = batch / (r["ms"] / 1e3)
        one = results.get((layers, cache, context, 1))
        ratio = f"{rate / (1e3 / one['ms']):.2f}x" if one and batch != 1 else ""
        print(
            f"| {layers} | {cache} | {context} | {batch} | {r['ms']:.1f} | "
            f"{r['kv_bytes'] / 1e6:.0f} | "
            f"{floor:.1f} | {r['ms'] / floor:.2f} | {rate:.1f} | {ratio} | {r['matmul_ms']:.1f} | "
            f"{r['slice_ms']:.1f} | {r['other_ms']:.1f} | {r['compile_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
