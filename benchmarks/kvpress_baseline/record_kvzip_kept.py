"""Record which context positions NVIDIA kvpress's ``KVzipPress`` keeps, for kvjax's exactness test.

    .venv/bin/python record_kvzip_kept.py --samples samples.jsonl --budgets 128 --out kept.json

Runs inside benchmarks/kvpress_baseline/.venv (``setup.sh``), on the same SmolLM2 GGUF weights as
``run_kvpress.py`` (float32, sdpa, CPU). For each sample of ``--samples`` (kvjax's JSONL: token ids of
``context``) and each budget: ``KVzipPress(ratio, layerwise=True)`` with the ratio that keeps ``budget`` per KV
head on average (``run_kvpress.ratio_for``), the context prefilled under the press as kvpress's pipeline does;
the kept positions of every (layer, KV head) are the context's positions less the press's
``masked_key_indices``. Writes JSON: kvpress's version, and per record the sample id, the context ids, the
budget and ``kept`` [layer][head] (sorted positions).
"""

from __future__ import annotations

import importlib.metadata
import json

import torch
from run_kvpress import gguf_tokenizer, make_press, recorder_setup


def main() -> None:
    args, model = recorder_setup(__doc__)
    gguf_tokenizer()  # KVzipPress reloads the tokenizer: the GGUF one
    from transformers import DynamicCache

    records = []
    for sample in map(json.loads, open(args.samples)):
        context = sample["context"]
        for budget in args.budgets:
            press = make_press("kvzip", len(context), budget, model.config)
            with torch.no_grad(), press(model):
                model.model(input_ids=torch.tensor([context]), past_key_values=DynamicCache())
            kept = []
            for layer in model.model.layers:
                _, heads, positions = layer.self_attn.masked_key_indices
                dropped = [set() for _ in range(model.config.num_key_value_heads)]
                for h, p in zip(heads.tolist(), positions.tolist(), strict=True):
                    dropped[h].add(p)
                kept.append([[p for p in range(len(context)) if p not in d] for d in dropped])
            records.append(dict(sample=sample["id"], context=context, budget=budget, kept=kept))
            print(sample["id"], budget, [sum(len(h) for h in layer) for layer in kept][:4], flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(kvpress=importlib.metadata.version("kvpress"), records=records), f)


if __name__ == "__main__":
    main()
