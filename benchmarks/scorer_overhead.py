"""Cost of each scorer relative to ``snapkv`` at the same budget on SmolLM2: block-wise prefill
seconds and decode ms/token (eviction after every token) at batch 1, and the decode tokens/s of a
batch of ``--batch`` copies of the prompt over that of batch 1.

    .venv/bin/python benchmarks/scorer_overhead.py  # about 20 minutes on 2 cores
    .venv/bin/python benchmarks/scorer_overhead.py --scorers snapkv tova momentkv --length 1024

Every scorer runs on the same random prompt. All are compiled first; then ``--repeats`` rounds
measure each scorer once per round (so that a drift of the machine's speed hits every scorer alike):
block-wise prefill seconds and ms per decode step over ``--new-tokens`` steps, best over the rounds.
The batched decode is prefilled once per scorer, after the rounds, and timed ``--repeats`` times
over ``--new-tokens`` steps (best). Targets from the papers:
OBCache-value within 5% of the attention-only score, MomentKV within 25%.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import kvjax
from kvjax.eviction import SCORERS
from kvjax.runtime.decoding import Generation
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling

DEFAULT = [
    "snapkv",
    "h2o",
    "tova",
    "streamingllm",
    "snapkv+obcache-value",
    "snapkv+obcache-key",
    "snapkv+obcache-joint",
    "h2o+obcache-value",
    "snapkv+caote",
    "snapkv+fastcaote",
    "momentkv",
    "snapkv+momentkv-mi",
    "snapkv+momentkv-nc",
    "snapkv+momentkv-zeroth",
]
TARGETS = {"snapkv+obcache-value": 1.05, "h2o+obcache-value": 1.05, "momentkv": 1.25}


def eviction(scorer: str, args):
    return eviction_from(budget=args.budget, scorer=scorer, block_size=args.block_size)


def measure(params, prompt, scorer: str, args) -> tuple[float, float]:
    """(prefill seconds, decode ms/token) of one compiled run."""
    ev = eviction(scorer, args)
    start = time.perf_counter()
    gen = Generation.from_prompts(params, [prompt], args.new_tokens + 1, Sampling(), 0, (), ev)
    jax.block_until_ready(gen.state)
    prefill = time.perf_counter() - start
    gen.run(1)
    start = time.perf_counter()
    gen.run(args.new_tokens)
    return prefill, (time.perf_counter() - start) / args.new_tokens * 1e3


def batched_decode(params, prompt, scorer: str, args) -> float:
    """ms per decode step of ``args.batch`` rows (best of ``args.repeats`` runs after a compiling
    one)."""
    ev = eviction(scorer, args)
    gen = Generation.from_prompts(
        params,
        [prompt] * args.batch,
        args.new_tokens * (args.repeats + 1) + 1,
        Sampling(),
        0,
        (),
        ev,
    )
    gen.run(1)
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        gen.run(args.new_tokens)
        best = min(best, (time.perf_counter() - start) / args.new_tokens * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scorers", nargs="+", default=DEFAULT, choices=list(SCORERS), metavar="SCORER"
    )
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="rows of the batched decode")
    args = parser.parse_args()
    scorers = ["snapkv"] + [s for s in args.scorers if s != "snapkv"]

    params = kvjax.load("smollm2-135m-instruct")
    prompt = np.random.default_rng(0).integers(100, 40000, args.length).astype(np.int32)
    for i, scorer in enumerate(scorers):  # compile everything first
        print(f"[compile {i + 1}/{len(scorers)}] {scorer}", file=sys.stderr, flush=True)
        measure(params, prompt, scorer, args)
    runs = {scorer: [] for scorer in scorers}
    # then rounds over all scorers, so that drifts of the machine hit every one
    for r in range(args.repeats):
        print(f"[round {r + 1}/{args.repeats}]", file=sys.stderr, flush=True)
        for scorer in scorers:
            runs[scorer].append(measure(params, prompt, scorer, args))
    batched = {}
    for i, scorer in enumerate(scorers):
        print(f"[batch {args.batch} {i + 1}/{len(scorers)}] {scorer}", file=sys.stderr, flush=True)
        batched[scorer] = batched_decode(params, prompt, scorer, args)
    rows = {
        scorer: (min(p for p, _ in got), min(d for _, d in got)) for scorer, got in runs.items()
    }
    base_prefill, base_decode = rows["snapkv"]
    print(
        f"SmolLM2-135M-Instruct, float32, CPU, batch 1, {args.length}-token prompt, budget "
        f"{args.budget}, "
        f"block-wise prefill in blocks of {args.block_size}, decode evicting every token; best of "
        f"{args.repeats}\n"
    )
    print(
        "| scorer | prefill s | vs snapkv | decode ms/token | vs snapkv | target | "
        f"batch-{args.batch} ms/step | "
        f"batch-{args.batch} / batch-1 tokens/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for scorer, (prefill, decode) in rows.items():
        ratio_p, ratio_d = prefill / base_prefill, decode / base_decode
        target = TARGETS.get(scorer)
        verdict = (
            ""
            if target is None
            else (f"{'PASS' if max(ratio_p, ratio_d) <= target else 'FAIL'} (<= {target:.2f}x)")
        )
        print(
            f"| {scorer} | {prefill:.2f} | {ratio_p:.2f}x | {decode:.1f} | {ratio_d:.2f}x | "
            f"{verdict} | "
            f"{batched[scorer]:.1f} | {args.batch * decode / batched[scorer]:.2f}x |"
        )


if __name__ == "__main__":
    main()
