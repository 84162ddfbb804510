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
import copy
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.checkpoint.registry import REGISTRY
from kvjax.generate import Generation
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


def kvjax_prefill(params, prompt: np.ndarray, new_tokens: int):
    """Timer of the prefill of one prompt: building a ``Generation`` (host-side checks and padding, then the
    jitted prefill, with the cache sized as ``kvjax.generate`` sizes it) until its state is ready."""

    def run() -> float:
        start = time.perf_counter()
        jax.block_until_ready(Generation(params, prompt, new_tokens, Sampling(), seed=0, stop_ids=()).state)
        return time.perf_counter() - start

    return run


def kvjax_decode(params, prompts: np.ndarray, new_tokens: int):
    """Timer of seconds per step of ``Generation.run`` over all new tokens, each run from a copy of one
    prefilled state (decode donates its state)."""
    gen = Generation(params, prompts, new_tokens, Sampling(), seed=0, stop_ids=())
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
    """Timer of one forward pass filling the cache; logits of the last position only, as generate does."""
    import torch

    ids = torch.from_numpy(prompt[None].astype(np.int64))

    @torch.inference_mode()
    def run() -> float:
        start = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    return run


def hf_decode(model, prompts: np.ndarray, new_tokens: int):
    """Timer of seconds per decode step of ``model.generate``, prefill excluded.

    All prompt tokens but the last are prefilled once; each run continues from a copy of that cache, and a
    logits processor stamps the time after each forward pass (the first right after the last prompt token),
    so (last stamp - first stamp) / (stamps - 1) is the time of one whole generate loop iteration.
    """
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    ids, clock = torch.from_numpy(prompts.astype(np.int64)), Clock()
    with torch.inference_mode():
        prompt_cache = model(ids[:, :-1], use_cache=True, logits_to_keep=1).past_key_values

    @torch.inference_mode()
    def run() -> float:
        clock.stamps = []
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=copy.deepcopy(prompt_cache),
                             do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=model.config.eos_token_id, logits_processor=LogitsProcessorList([clock]))
        assert out.shape[1] == ids.shape[1] + new_tokens
        return (clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1)

    return run


def load_hf(dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    path = REGISTRY[MODEL].path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=getattr(torch, dtype)).eval()


def measure(name: str, prefill_timer, decode_timer, args, prompts: dict) -> dict:
    """{(kind, size): seconds per prefill or per decode step} for one framework, from its timer factories."""
    results = {}
    for n in args.lengths:
        results[("prefill", n)] = t = median_run(prefill_timer(prompts[("prefill", n)]), args.repeats)
        log(f"{name}: prefill {n} tokens: {t:.3f} s = {n / t:.0f} tokens/s")
    for b in args.batch_sizes:
        results[("decode", b)] = t = median_run(decode_timer(prompts[("decode", b)]), args.repeats)
        log(f"{name}: decode batch {b}: {1e3 * t:.1f} ms/step")
    return results


def cell(kind: str, n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}" if kind == "prefill" else f"{1e3 * seconds:.1f}"


def table(args, ours: dict, theirs: dict | None, threads: str) -> str:
    lines = [f"SmolLM2-135M-Instruct, {args.dtype}, CPU. {threads}. Median of {args.repeats} runs after a warm-up "
             "run. Decode ms/token = ms per decode step (one token for each row of the batch); "
             "speedup = transformers time / kvjax time.", "",
             "| measurement | kvjax | transformers | kvjax speedup | target |", "|---|---|---|---|---|"]
    for (kind, n), ours_s in ours.items():
        if kind == "prefill":
            label, goal = f"prefill tokens/s, {n}-token prompt, batch 1", PREFILL_TARGET
        else:
            label = f"decode ms/token, batch {n}, {args.context}-token prompt, {args.new_tokens} new tokens"
            goal = DECODE_TARGET if n == 1 else None
        cells = [label, cell(kind, n, ours_s), "-", "-", "-"]
        if theirs:
            speedup = theirs[(kind, n)] / ours_s
            cells[2:] = [cell(kind, n, theirs[(kind, n)]), f"{speedup:.2f}x",
                         "-" if goal is None else f"{'PASS' if speedup >= goal else 'FAIL'} (>= {goal:g}x)"]
        lines.append("| " + " | ".join(cells) + " |")
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
