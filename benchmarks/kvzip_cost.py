"""KVzip's compression cost against one full prefill, on SmolLM2-135M-Instruct (float32, CPU).

    .venv/bin/python benchmarks/kvzip_cost.py  # contexts of 2048 and 4096 tokens, best of 2

For a context of real prose: the full-cache prefill (``kvjax.prefill_full``), KVzip's reconstruction
pass over it (the context repeated in chunks of 2048 tokens after the repeat prompt, scored per
layer), and the whole ``prefill(..., scorer="kvzip")`` (prefill + pass + compression), next to
SnapKV's compression of the same context (prefill protocol). Each timing is the best of
``--repeats`` runs after a warm-up run (compile excluded).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import kvjax
from kvjax.eval.haystack import pydoc_prose
from kvjax.runtime.kvzip_pass import kvzip_scores


def best(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # warm-up: compilation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    params = kvjax.load("smollm2-135m-instruct")
    tokenizer = kvjax.load_tokenizer("smollm2-135m-instruct")
    prompt = kvjax.kvzip_prompt(tokenizer)
    text = tokenizer(pydoc_prose(), add_special_tokens=False)["input_ids"]
    print(
        f"SmolLM2-135M-Instruct, float32, CPU (jax {jax.__version__}); budget {args.budget}; best "
        "of "
        f"{args.repeats} after a warm-up\n"
    )
    print(
        "| context tokens | full prefill s | KVzip pass s | pass / prefill | kvzip compress s | "
        "snapkv compress s | kvzip / snapkv |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.lengths:
        ids = np.asarray(text[:n], np.int32)
        prefill = best(lambda: kvjax.prefill_full(params, ids).cache, args.repeats)
        shared = kvjax.prefill_full(params, ids)
        repeat = best(
            lambda: kvzip_scores(params, shared.cache.full, shared.rows, prompt), args.repeats
        )
        kvzip = best(
            lambda: (
                kvjax.prefill(
                    params, ids, budget=args.budget, scorer="kvzip", repeat_prompt=prompt
                ).cache
            ),
            args.repeats,
        )
        snapkv = best(
            lambda: (
                kvjax.prefill(
                    params, ids, budget=args.budget, scorer="snapkv", protocol="prefill"
                ).cache
            ),
            args.repeats,
        )
        print(
            f"| {n} | {prefill:.2f} | {repeat:.2f} | {repeat / prefill:.2f}x | {kvzip:.2f} | "
            f"{snapkv:.2f} | "
            f"{kvzip / snapkv:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
