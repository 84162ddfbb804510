"""Prefill and decode speed of kvjax vs Hugging Face transformers (torch, CPU) on
SmolLM2-135M-Instruct.

Run from the repository root (the default run takes about 9 minutes on a 2-core CPU):

    .venv/bin/python benchmarks/generate_speed.py
    .venv/bin/python benchmarks/generate_speed.py --dtype bfloat16 --skip-transformers

Both frameworks run in this one process, on the same random prompt ids and in the same dtype:
- prefill: a batch-1 prompt of each ``--lengths`` value through the model into a fresh cache, as
  tokens/s;
- decode: ``--new-tokens`` greedy steps (no early stop) after a ``--context``-token prompt for each
  ``--batch-sizes`` value, as ms per step (one new token per row), prefill excluded.
Each measurement is the fastest of ``--repeats`` timed runs after one untimed warm-up run (which
compiles kvjax). All kvjax measurements run before the transformers ones, so that the two thread
pools never overlap. The Markdown table goes to stdout, progress to stderr. On CPUs without native
bfloat16 (like the 2-core development machine), torch's bfloat16 is ~10x slower than its float32:
compare bfloat16 at shorter lengths.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.checkpoint.registry import REGISTRY
from kvjax.runtime.decoding import Generation
from kvjax.runtime.sampling import Sampling

MODEL = "smollm2-135m-instruct"
PREFILL_TARGET = 1.0  # kvjax prefill no slower than transformers
DECODE_TARGET = 2.0  # kvjax batch-1 decode at most half of transformers' ms/token
BATCH_TARGET = 6.0  # kvjax batch-8 decode tokens/s at least 6x its batch-1 tokens/s (issue 16)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def best_run(run, repeats: int) -> float:
    """Fastest of ``repeats`` calls of ``run()`` (which times itself), after one untimed warm-up
    call."""
    run()
    return min(run() for _ in range(repeats))


def kvjax_generation(params, prompts: np.ndarray, new_tokens: int) -> Generation:
    """What ``kvjax.generate`` builds before decoding (full cache): padding, buckets and the jitted
    prefill."""
    return Generation.from_prompts(
        params, list(prompts), new_tokens, Sampling(), seed=0, stop_ids=(), ev=None
    )


def kvjax_prefill(params, prompt: np.ndarray, new_tokens: int):
    """Timer of the prefill of one prompt, until its decode state is ready."""

    def run() -> float:
        start = time.perf_counter()
        jax.block_until_ready(kvjax_generation(params, prompt[None], new_tokens).state)
        return time.perf_counter() - start

    return run


def kvjax_decode(params, prompts: np.ndarray, new_tokens: int):
    """Timer of seconds per step of ``Generation.run`` over all new tokens, each run from a copy of
    one prefilled state (decode donates its state)."""
    gen = kvjax_generation(params, prompts, new_tokens)
    prefilled = jax.block_until_ready(gen.state)

    def run() -> float:
        gen.state = jax.block_until_ready(jax.tree.map(jnp.copy, prefilled))
        start = time.perf_counter()
        out = gen.run(new_tokens)  # numpy arrays, so the decode has finished
        elapsed = time.perf_counter() - start
        assert all(len(row) == new_tokens for row in out)
        return elapsed / new_tokens

    return run


def hf_prefill(model, prompt: np.ndarray):
    """Timer of one forward pass filling the cache; logits of the last position only, as generate
    does."""
    import torch

    ids = torch.from_numpy(prompt[None].astype(np.int64))

    @torch.inference_mode()
    def run() -> float:
        start = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    return run


def hf_decode(model, prompts: np.ndarray, new_tokens: int):
    """Timer of seconds per greedy decode step: a loop of forward passes over the newest token with
    the ``DynamicCache``, each run from a copy of one prefilled cache. Per step this is as fast as
    the loop of ``model.generate`` (checked), without re-running the prefill for every timed run."""
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))
    with torch.inference_mode():
        prefilled = model(ids, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def run() -> float:
        cache, logits = copy.deepcopy(prefilled.past_key_values), prefilled.logits
        start = time.perf_counter()
        for _ in range(new_tokens):
            logits = model(logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
        return (time.perf_counter() - start) / new_tokens

    return run


def load_hf(dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    path = REGISTRY[MODEL].path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)
    ).eval()


def measure(name: str, prefill_timer, decode_timer, args, prompts: dict) -> dict:
    """{(kind, size): seconds per prefill or per decode step} for one framework, from its timer
    factories."""
    results = {}
    for n in args.lengths:
        results[("prefill", n)] = t = best_run(prefill_timer(prompts[("prefill", n)]), args.repeats)
        log(f"{name}: prefill {n} tokens: {t:.3f} s = {n / t:.0f} tokens/s")
    for b in args.batch_sizes:
        results[("decode", b)] = t = best_run(decode_timer(prompts[("decode", b)]), args.repeats)
        log(f"{name}: decode batch {b}: {1e3 * t:.1f} ms/step")
    return results


def cell(kind: str, n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}" if kind == "prefill" else f"{1e3 * seconds:.1f}"


def table(args, ours: dict, theirs: dict | None, threads: str) -> str:
    lines = [
        f"SmolLM2-135M-Instruct, {args.dtype}, CPU. {threads}. Best of {args.repeats} runs after a "
        "warm-up "
        "run. Decode ms/token = ms per decode step (one token for each row of the batch); "
        "speedup = transformers time / kvjax time.",
        "",
        "| measurement | kvjax | transformers | kvjax speedup | target |",
        "|---|---|---|---|---|",
    ]
    for (kind, n), ours_s in ours.items():
        if kind == "prefill":
            label, goal = f"prefill tokens/s, {n}-token prompt, batch 1", PREFILL_TARGET
        else:
            label = (
                f"decode ms/token, batch {n}, {args.context}-token prompt, "
                f"{args.new_tokens} new tokens"
            )
            goal = DECODE_TARGET if n == 1 else None
        cells = [label, cell(kind, n, ours_s), "-", "-", "-"]
        if theirs:
            speedup = theirs[(kind, n)] / ours_s
            cells[2:] = [
                cell(kind, n, theirs[(kind, n)]),
                f"{speedup:.2f}x",
                "-" if goal is None else f"{'PASS' if speedup >= goal else 'FAIL'} (>= {goal:g}x)",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    for b in (b for b in args.batch_sizes if b > 1 and 1 in args.batch_sizes):

        def ratio(r):
            """tokens/s at b over tokens/s at 1"""
            return b * r[("decode", 1)] / r[("decode", b)]

        cells = [
            f"decode tokens/s, batch {b} / batch 1 (same steps as above)",
            f"{ratio(ours):.2f}x",
            f"{ratio(theirs):.2f}x" if theirs else "-",
            "-",
            f"{'PASS' if ratio(ours) >= BATCH_TARGET else 'FAIL'} (>= {BATCH_TARGET:g}x)"
            if b == 8
            else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[1024, 2048, 4096],
        help="prefill prompt lengths (batch 1)",
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 8], help="decode batch sizes"
    )
    parser.add_argument("--context", type=int, default=1024, help="decode prompt length")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps")
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed runs per measurement, after one warm-up"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--skip-transformers", action="store_true", help="time kvjax only")
    args = parser.parse_args()

    wall = time.perf_counter()
    rng = np.random.default_rng(0)
    prompts = {("prefill", n): rng.integers(100, 40000, n, dtype=np.int32) for n in args.lengths}
    prompts |= {
        ("decode", b): rng.integers(100, 40000, (b, args.context), dtype=np.int32)
        for b in args.batch_sizes
    }

    log(f"kvjax: loading {MODEL} ({args.dtype})")
    params = kvjax.load(MODEL, dtype=args.dtype)
    ours = measure(
        "kvjax",
        lambda p: kvjax_prefill(params, p, args.new_tokens),
        lambda p: kvjax_decode(params, p, args.new_tokens),
        args,
        prompts,
    )
    threads = f"jax {jax.__version__}: XLA CPU over {len(os.sched_getaffinity(0))} cores"
    theirs = None
    if not args.skip_transformers:
        import torch
        import transformers

        log(f"transformers: loading {MODEL} ({args.dtype})")
        model = load_hf(args.dtype)
        theirs = measure(
            "transformers",
            lambda p: hf_prefill(model, p),
            lambda p: hf_decode(model, p, args.new_tokens),
            args,
            prompts,
        )
        threads += (
            f"; transformers {transformers.__version__} (torch {torch.__version__}, "
            f"{model.config._attn_implementation} attention): {torch.get_num_threads()} threads"
        )
    print(table(args, ours, theirs, threads))
    log(f"total wall time {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
