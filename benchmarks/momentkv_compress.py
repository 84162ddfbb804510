"""MomentKV's compression time under the prefill protocol: the exact rule (Algorithm 1, one token
per statistics update) against ``mi_batch`` and against SnapKV, whose scores MomentKV's priorities
are.

    .venv/bin/python benchmarks/momentkv_compress.py  # 5 minutes per budget on 2 idle cores
    .venv/bin/python benchmarks/momentkv_compress.py --lengths 1024 --budgets 128

SmolLM2 prefills a stretch of the real-text haystack once (``kvjax.prefill_full``); each row is
``Prefilled.compress`` alone (scoring, eviction and the moments; not the prefill), compiled, best of
2. "steps" is how many sequential statistics updates the eviction loop runs per (layer, row, KV
head): the exact loop stops after the prompt's evictions, the batched one runs its static bound (the
decoding room included).
"""

from __future__ import annotations

import argparse

import numpy as np
from momentkv_batched import compress

import kvjax
from kvjax.eval.haystack import pydoc_prose


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    args = parser.parse_args()

    params = kvjax.load("smollm2-135m-instruct")
    tokenizer = kvjax.load_tokenizer("smollm2-135m-instruct")
    ids = tokenizer(pydoc_prose(), add_special_tokens=False)["input_ids"]
    print(
        "SmolLM2-135M-Instruct, float32, CPU; prefill protocol, compression alone (compiled, best "
        "of 2)\n"
    )
    print("| length | budget | method | steps | compress s | × SnapKV |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for length in args.lengths:
        pre = kvjax.prefill_full(params, np.asarray(ids[:length], np.int32))
        slots = pre.cache.full.k.shape[-2]
        for budget in args.budgets:
            _, base = compress(pre, budget, scorer="snapkv")
            rows = [("snapkv", "—", base)]
            for batch in [1] + args.batches:
                name = "momentkv (exact)" if batch == 1 else f"momentkv, mi_batch={batch}"
                steps = length - budget if batch == 1 else -(-(slots - budget) // batch)
                rows.append((name, steps, compress(pre, budget, batch)[1]))
            for name, steps, seconds in rows:
                print(
                    f"| {length} | {budget} | {name} | {steps} | {seconds:.2f} | "
                    f"{seconds / base:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
