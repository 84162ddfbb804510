"""KV memory, peak process memory, prefill and decode speed: full cache vs block-wise eviction
(SmolLM2).

    .venv/bin/python benchmarks/eviction_memory_speed.py  # about 15 minutes on 2 cores
    # quick look
    .venv/bin/python benchmarks/eviction_memory_speed.py --lengths 2048 --new-tokens 16

Each (mode, prompt length) runs in its own subprocess, so that its peak resident memory (ru_maxrss)
is its own. Modes: ``full`` (budget=None) and ``blockwise`` (budget ``--budget``, scorer
``--scorer``, blocks of ``--block-size``). Prefill seconds are those of a second, already compiled
call on the same shapes; decode ms/token is the best of ``--repeats`` runs of ``--new-tokens``
greedy steps after a compiled warm-up step (all in one generation, so the cache keeps evicting
between runs). "KV bytes" is the cache allocated during prefill (for block-wise: budget + block
slots, with positions, scores and moments). The 8K point uses 8192 minus the decoded tokens as
prompt, so that prompt plus answer fit the 8K context.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

MODEL = "smollm2-135m-instruct"


def measure(mode: str, length: int, args) -> dict:
    import jax
    import numpy as np

    import kvjax
    from kvjax.cache.full import FullCache
    from kvjax.runtime.decoding import Generation
    from kvjax.runtime.inputs import prompt_bucket
    from kvjax.runtime.options import eviction_from
    from kvjax.runtime.protocol import round_capacity
    from kvjax.runtime.sampling import Sampling

    params = kvjax.load(MODEL)
    cfg = params.config
    prompt = np.random.default_rng(0).integers(100, 40000, length).astype(np.int32)
    ev = (
        None
        if mode == "full"
        else eviction_from(budget=args.budget, scorer=args.scorer, block_size=args.block_size)
    )

    def start():
        t = time.perf_counter()
        gen = Generation.from_prompts(
            params, [prompt], 1 + args.repeats * args.new_tokens, Sampling(), 0, (), ev
        )
        jax.block_until_ready(gen.state)
        return gen, time.perf_counter() - t

    start()  # compile
    gen, prefill_s = start()
    gen.run(1)  # compile the decode loop
    runs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        gen.run(args.new_tokens)
        runs.append((time.perf_counter() - t) / args.new_tokens * 1e3)
    decode_ms = min(runs)
    if ev is None:
        capacity = round_capacity(prompt_bucket(length) + 1 + args.repeats * args.new_tokens)
        shape = jax.eval_shape(lambda: FullCache.init(cfg, 1, capacity, params.dtype))
    else:
        shape = jax.eval_shape(
            lambda: ev.empty_cache(cfg, 1, ev.extend_spare(args.block_size), params.dtype)
        )
    return dict(
        mode=mode,
        length=length,
        kv_bytes=kvjax.cache_bytes(shape),
        prefill_s=prefill_s,
        decode_ms=decode_ms,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--scorer", default="snapkv")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="decode runs; the best is reported")
    parser.add_argument(
        "--full-decode-context",
        type=int,
        default=1024,
        help="context of the full-cache decode reference for the decode target",
    )
    parser.add_argument("--one", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args)))
        return

    lengths = [min(n, 8192 - 1 - args.repeats * args.new_tokens) for n in args.lengths]
    runs = [("full", args.full_decode_context)] + [
        (m, n) for n in lengths for m in ("full", "blockwise")
    ]
    rows = []
    for i, (mode, n) in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {mode} at {n} tokens", file=sys.stderr, flush=True)
        cmd = [
            sys.executable,
            __file__,
            "--one",
            mode,
            str(n),
            "--budget",
            str(args.budget),
            "--scorer",
            args.scorer,
            "--block-size",
            str(args.block_size),
            "--new-tokens",
            str(args.new_tokens),
            "--repeats",
            str(args.repeats),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))

    print(
        f"SmolLM2-135M-Instruct, float32, batch 1, block-wise = {args.scorer} at budget "
        f"{args.budget}, "
        f"blocks of {args.block_size}; decode: best of {args.repeats} runs of {args.new_tokens} "
        "tokens\n"
    )
    print("| mode | prompt tokens | KV cache bytes | peak RSS MB | prefill s | decode ms/token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['mode']} | {r['length']} | {r['kv_bytes']:,} | {r['peak_rss_mb']:.0f} | "
            f"{r['prefill_s']:.2f} "
            f"| {r['decode_ms']:.1f} |"
        )
    by = {(r["mode"], r["length"]): r for r in rows}
    block_bytes = {by[("blockwise", n)]["kv_bytes"] for n in lengths}
    longest = max(lengths)
    checks = [
        ("block-wise KV bytes constant in the prompt length", len(block_bytes) == 1),
        (
            f"block-wise prefill at {longest} no slower than full-cache prefill",
            by[("blockwise", longest)]["prefill_s"] <= by[("full", longest)]["prefill_s"],
        ),
        (
            f"decode at budget {args.budget} no slower than the full cache at "
            f"{args.full_decode_context} context",
            all(
                by[("blockwise", n)]["decode_ms"]
                <= by[("full", args.full_decode_context)]["decode_ms"]
                for n in lengths
            ),
        ),
    ]
    print()
    for name, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'}: {name}")


if __name__ == "__main__":
    main()
