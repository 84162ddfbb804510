"""Prefill and decode speed of kvjax vs Hugging Face transformers (torch, CPU) on SmolLM2-135M-Instruct.

Run from the repository root (the default run takes about N minutes on a 2-core CPU):

    .venv/bin/python benchmarks/generate_speed.py
    .venv/bin/python benchmarks/generate_speed.py --dtype bfloat16 --repeats 1 --skip-transformers

Both frameworks run in this one process, on the same random prompt ids and in the same dtype:
- prefill: one forward pass over a batch-1 prompt of each ``--lengths`` value, as prompt tokens/s;
- decode: greedy, no early stop, ``--new-tokens`` tokens after a ``--context``-token prompt for each
  ``--batch-sizes`` value, as ms per decode step (one new token per row), prefill excluded.
Every measurement is the median of ``--repeats`` timed runs after one untimed warm-up run (which compiles
kvjax). All kvjax measurements run before the transformers ones, so that the two thread pools do not overlap.
The result is a Markdown table on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.checkpoint.registry import REGISTRY
from kvjax.generate import Generation, cache_capacity, prefill, prompt_bucket
from kvjax.sampling import Sampling

MODEL = "smollm2-135m-instruct"
PREFILL_TARGET = 1.0  # kvjax prefill no slower than transformers
DECODE_TARGET = 2.0  # kvjax batch-1 decode at most half of transformers' ms/token


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median_run(run, repeats: int) -> float:
    """Median over ``repeats`` calls of ``run()`` (which times itself), after one untimed warm-up call."""
    run()
    return statistics.median(run() for _ in range(repeats))


def kvjax_prefill(params, prompt: np.ndarray, new_tokens: int) -> float:
    """Seconds of the jitted prefill of one prompt (the cache sized as ``kvjax.generate`` sizes it)."""
    tokens, lengths = jnp.asarray(prompt[None]), jnp.asarray([prompt.size], jnp.int32)
    capacity, key = cache_capacity(prompt_bucket(prompt.size), new_tokens), jax.random.key(0)
    start = time.perf_counter()
    jax.block_until_ready(prefill(params, tokens, lengths, key, capacity=capacity))
    return time.perf_counter() - start


def kvjax_decode(params, prompts: np.ndarray, new_tokens: int) -> float:
    """Seconds per decode step: ``Generation.run`` of all new tokens, timed after its prefill has finished."""
    gen = Generation(params, prompts, new_tokens, Sampling(), seed=0, stop_ids=())
    jax.block_until_ready(gen.state)
    start = time.perf_counter()
    out = gen.run(new_tokens)  # returns numpy arrays, so the decode has finished
    elapsed = time.perf_counter() - start
    assert all(len(row) == new_tokens for row in out)
    return elapsed / new_tokens


def hf_prefill(model, prompt: np.ndarray) -> float:
    """Seconds of one forward pass filling the cache; logits of the last position only, as generate does."""
    import torch

    ids = torch.from_numpy(prompt[None].astype(np.int64))
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start


def hf_decode(model, prompts: np.ndarray, new_tokens: int) -> float:
    """Seconds per decode step of ``model.generate``, prefill excluded.

    A logits processor stamps the time after each forward pass (the first right after the prefill), so
    (last stamp - first stamp) / (stamps - 1) is the time of one whole generate loop iteration.
    """
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    ids, clock = torch.from_numpy(prompts.astype(np.int64)), Clock()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=model.config.eos_token_id,
                             logits_processor=LogitsProcessorList([clock]))
    assert out.shape[1] == ids.shape[1] + new_tokens
    return (clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1)


def load_hf(dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    path = REGISTRY[MODEL].path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=getattr(torch, dtype)).eval()


def measure(name: str, prefill_fn, decode_fn, args, prompts: dict) -> dict:
    """{row label: (seconds per prefill | seconds per decode step)} for one framework."""
    results = {}
    for n in args.lengths:
        results[("prefill", n)] = t = median_run(lambda: prefill_fn(prompts[("prefill", n)]), args.repeats)
        log(f"{name}: prefill {n} tokens: {t:.3f} s = {n / t:.0f} tokens/s")
    for b in args.batch_sizes:
        results[("decode", b)] = t = median_run(lambda: decode_fn(prompts[("decode", b)]), args.repeats)
        log(f"{name}: decode batch {b}: {1e3 * t:.1f} ms/step")
    return results


def table(args, ours: dict, theirs: dict | None, threads: str) -> str:
    lines = [f"SmolLM2-135M-Instruct, {args.dtype}, CPU; {threads}; median of {args.repeats} runs after a warm-up",
             "", "| measurement | kvjax | transformers | kvjax speedup | target |", "|---|---|---|---|---|"]
    for (kind, n), ours_s in ours.items():
        theirs_s = theirs[(kind, n)] if theirs else None
        if kind == "prefill":
            label, fmt, goal = f"prefill tokens/s, {n} tokens, batch 1", lambda s: f"{n / s:,.0f}", PREFILL_TARGET
        else:
            label = f"decode ms/token, batch {n}, {args.context}-token context, {args.new_tokens} new"
            fmt, goal = (lambda s: f"{1e3 * s:.2f}"), (DECODE_TARGET if n == 1 else None)
        speedup = theirs_s / ours_s if theirs_s else None
        verdict = "-" if goal is None or speedup is None else (
            f">= {goal:g}x: {'PASS' if speedup >= goal else 'FAIL'}")
        lines.append(f"| {label} | {fmt(ours_s)} | {fmt(theirs_s) if theirs_s else '-'} | "
                     f"{f'{speedup:.2f}x' if speedup else '-'} | {verdict} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096],
                        help="prefill prompt lengths (batch 1)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    parser.add_argument("--context", type=int, default=1024, help="decode prompt length")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps (>= 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, after one warm-up")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--skip-transformers", action="store_true", help="time kvjax only")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2")

    wall = time.perf_counter()
    rng = np.random.default_rng(0)
    prompts = {("prefill", n): rng.integers(100, 40000, n, dtype=np.int32) for n in args.lengths}
    prompts |= {("decode", b): rng.integers(100, 40000, (b, args.context), dtype=np.int32)
                for b in args.batch_sizes}

    log(f"kvjax: loading {MODEL} ({args.dtype})")
    params = kvjax.load(MODEL, dtype=args.dtype)
    ours = measure("kvjax", lambda p: kvjax_prefill(params, p, args.new_tokens),
                   lambda p: kvjax_decode(params, p, args.new_tokens), args, prompts)
    threads = f"jax {jax.__version__}: XLA CPU over {len(os.sched_getaffinity(0))} cores"
    theirs = None
    if not args.skip_transformers:
        import torch
        import transformers

        log(f"transformers: loading {MODEL} ({args.dtype})")
        model = load_hf(args.dtype)
        theirs = measure("transformers", lambda p: hf_prefill(model, p),
                         lambda p: hf_decode(model, p, args.new_tokens), args, prompts)
        threads += (f"; transformers {transformers.__version__} (torch {torch.__version__}, "
                    f"{model.config._attn_implementation} attention): {torch.get_num_threads()} threads")
    print(table(args, ours, theirs, threads))
    log(f"total wall time {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
