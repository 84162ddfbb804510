"""Record which context positions NVIDIA kvpress's ``KVzipPress`` keeps, for kvjax's exactness
tests.

    .venv/bin/python record_kvzip_kept.py --samples samples.jsonl --budgets 128 --out kept.json \
        [--press kvzip_global] [--ratios 0.75]

Runs inside benchmarks/kvpress_baseline/.venv (``setup.sh``), on the same SmolLM2 GGUF weights as
``run_kvpress.py`` (float32, sdpa, CPU). For each sample of ``--samples`` (kvjax's JSONL: token ids
of ``context``): for each of ``--budgets``, the press at the ratio that keeps ``budget`` per KV head
on average (``run_kvpress.ratio_for``), and for each of ``--ratios``, the press at that
``compression_ratio`` as a user writes it; ``--press``: ``kvzip`` = ``KVzipPress(layerwise=True)``,
``kvzip_global`` = ``KVzipPress()`` (kvpress's default: one threshold over every layer and KV head).
The context is prefilled under the press as kvpress's pipeline does; the kept positions of every
(layer, KV head) are the context's positions less the press's ``masked_key_indices``. Writes JSON:
kvpress's version, the press, and per record the sample id, the context ids, the budget (or null),
the compression ratio and ``kept`` [layer][head] (one hexadecimal bit mask of positions each).
"""

from __future__ import annotations

import importlib.metadata
import json

import torch
from run_kvpress import KVZIP_PRESSES, gguf_tokenizer, make_press, recorder_setup


def main() -> None:
    args, model = recorder_setup(
        __doc__,
        {
            "--press": dict(choices=KVZIP_PRESSES, default="kvzip"),
            "--ratios": dict(
                type=float, nargs="*", default=[], help="compression ratios as written"
            ),
        },
    )
    gguf_tokenizer()  # KVzipPress reloads the tokenizer: the GGUF one
    import kvpress
    from transformers import DynamicCache

    records = []
    for sample in map(json.loads, open(args.samples)):
        context = sample["context"]
        presses = [(b, make_press(args.press, len(context), b, model.config)) for b in args.budgets]
        presses += [
            (None, kvpress.KVzipPress(compression_ratio=r, layerwise=args.press == "kvzip"))
            for r in args.ratios
        ]
        for budget, press in presses:
            ratio = press.compression_ratio
            with torch.no_grad(), press(model):
                model.model(input_ids=torch.tensor([context]), past_key_values=DynamicCache())
            kept = []
            for layer in model.model.layers:
                _, heads, positions = layer.self_attn.masked_key_indices
                masks = [(1 << len(context)) - 1] * model.config.num_key_value_heads
                for h, p in zip(heads.tolist(), positions.tolist(), strict=True):
                    masks[h] &= ~(1 << p)
                kept.append([hex(m) for m in masks])
            records.append(
                dict(sample=sample["id"], context=context, budget=budget, ratio=ratio, kept=kept)
            )
            print(sample["id"], len(context), budget, ratio, flush=True)
    with open(args.out, "w") as f:
        json.dump(
            dict(kvpress=importlib.metadata.version("kvpress"), press=args.press, records=records),
            f,
        )


if __name__ == "__main__":
    main()
