"""What a quantized cache (``kv_dtype``) costs and saves: bytes per kept token and whole caches
(shapes only), and the CPU decode step of SmolLM2 in each kv_dtype.

    .venv/bin/python benchmarks/kv_dtype_cost.py --part memory      # instant: from the shapes
    .venv/bin/python benchmarks/kv_dtype_cost.py --part speed       # about 10 minutes on 2 cores

memory: per (layer, KV head) token, keys and values with their scales, against bfloat16's, at
SmolLM2's head_dim of 64 and Llama-3.1-8B's of 128; the whole cache of one row (positions, scorer
state and order included: ``kvjax.cache_bytes`` of its ``jax.eval_shape``) at a budget of 1024 and
of the full cache at 32K tokens (+512 new), and the rows of each that 60 GiB hold (8B shapes,
bfloat16 model). speed: ms per greedy decode step (best of ``--repeats`` runs of ``--steps``
steps, after a compiled warm-up) of SmolLM2 in float32 on this CPU, the full cache at a 2K prompt
and SnapKV 256 at the same prompt, batch 1 and 8, for each kv_dtype, and its ratio to the model
dtype's. Markdown to stdout; the raw rows to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax.cache.full import FullCache, cache_bytes  # noqa: E402
from kvjax.checkpoint.random_model import shape_of  # noqa: E402
from kvjax.runtime.decoding import Generation  # noqa: E402
from kvjax.runtime.options import EvictionOptions  # noqa: E402
from kvjax.runtime.sampling import Sampling  # noqa: E402

DTYPES = (None, "int8", "float8_e4m3fn", "int4")
GIB = 1 << 30


def memory() -> tuple[list[dict], str]:
    rows, lines = [], []
    lines += [
        "| model | kv_dtype | bytes per token and KV head (keys + values + scales) | vs bfloat16 "
        "| one row, SnapKV 1024, all leaves | one row, full cache at 32K | rows in 60 GiB: "
        "SnapKV 1024 | rows in 60 GiB: full 32K |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ("smollm2-135m", "llama-3.1-8b"):
        cfg = shape_of(f"random:{name}")
        base = None
        for kv in DTYPES:
            ev = EvictionOptions.of(budget=1024, scorer="snapkv", kv_dtype=kv).resolve()
            budget = jax.eval_shape(lambda: ev.empty_cache(cfg, 1, 1, jnp.bfloat16))  # noqa: B023
            full = jax.eval_shape(
                lambda: FullCache.init(cfg, 1, 32768 + 512, jnp.bfloat16, kv_dtype=kv)  # noqa: B023
            )
            per_token = cache_bytes(budget, kv_only=True) / (cfg.n_layers * cfg.n_kv_heads * 1025)
            base = base or per_token
            row = dict(
                model=name,
                kv_dtype=kv or "bfloat16",
                per_token=per_token,
                vs_bf16=per_token / base,
                budget_row=cache_bytes(budget),
                full_row=cache_bytes(full),
                budget_rows_60g=int(60 * GIB // cache_bytes(budget)),
                full_rows_60g=int(60 * GIB // cache_bytes(full)),
            )
            rows.append(row)
            lines.append(
                f"| {name} | {row['kv_dtype']} | {per_token:.0f} | {row['vs_bf16']:.3f}x | "
                f"{row['budget_row'] / 2**20:.1f} MiB | {row['full_row'] / 2**20:.0f} MiB | "
                f"{row['budget_rows_60g']:,} | {row['full_rows_60g']:,} |"
            )
    return rows, "\n".join(lines)


def step_ms(params, rows, eviction: dict, steps: int, repeats: int) -> float:
    options = EvictionOptions.of(**eviction)
    ev = options.resolve(max(map(len, rows)))
    total = steps * (repeats + 1)
    gen = Generation.from_prompts(params, rows, total, Sampling(), 0, (), ev, **options.full_cache)
    gen.run(steps)  # compiles
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gen.run(steps)
        jax.block_until_ready(gen.state.logits)
        best = min(best, (time.perf_counter() - start) / steps)
    return 1e3 * best


def speed(steps: int, repeats: int) -> tuple[list[dict], str]:
    params = kvjax.load("smollm2-135m-instruct")
    rng = np.random.default_rng(0)
    rows, lines = [], []
    lines += [
        f"| cache | batch | {' | '.join(kv or 'float32' for kv in DTYPES)} | int8 / float32 |",
        "| --- | ---: |" + " ---: |" * (len(DTYPES) + 1),
    ]
    for name, eviction in (("full, 2K prompt", {}), ("SnapKV 256, 2K prompt", dict(budget=256))):
        for batch in (1, 8):
            prompts = [rng.integers(10, 40000, 2048).astype(np.int32) for _ in range(batch)]
            ms = {}
            for kv in DTYPES:
                ms[kv] = step_ms(params, prompts, eviction | dict(kv_dtype=kv), steps, repeats)
                rows.append(dict(cache=name, batch=batch, kv_dtype=kv or "float32", ms=ms[kv]))
                jax.clear_caches()
            cells = " | ".join(f"{ms[kv]:.1f}" for kv in DTYPES)
            lines.append(f"| {name} | {batch} | {cells} | {ms['int8'] / ms[None]:.2f}x |")
    return rows, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["memory", "speed"], required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="raw rows as JSON (default: none)")
    args = parser.parse_args()
    if args.part == "memory":
        rows, text = memory()
    else:
        rows, text = speed(args.steps, args.repeats)
        text = (
            f"SmolLM2-135M-Instruct, float32, CPU ({os.cpu_count()} cores), ms per decode step\n\n"
            + text
        )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"part": args.part, "rows": rows, "table": text}, f, indent=1)


if __name__ == "__main__":
    main()
