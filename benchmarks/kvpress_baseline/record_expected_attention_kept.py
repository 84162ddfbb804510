"""Record which context positions NVIDIA kvpress's ``ExpectedAttentionPress`` keeps, for kvjax's
exactness test of ``expected-attention``.

    .venv/bin/python record_expected_attention_kept.py --samples samples.jsonl --budgets 64 256 \
        --out kept.json

Runs inside benchmarks/kvpress_baseline/.venv (``setup.sh``), on the same SmolLM2 GGUF weights as
``run_kvpress.py`` (float32, sdpa, CPU). For each sample of ``--samples`` (JSONL: ``id`` and the
token ids of ``context``) and each budget: the press at the ratio that keeps ``budget`` per KV head
(``ratio_for``), its defaults otherwise (512 future positions, 4 sinks, covariance and value norm),
the context prefilled under it; the kept positions of every (layer, KV head) are the ``budget``
highest of the press's scores, as its ``compress`` takes them. Writes JSON: kvpress's version, and
per record the sample id, the context ids, the budget and ``kept`` [layer][head] (one hexadecimal
bit mask of positions each).
"""

from __future__ import annotations

import importlib.metadata
import json

import torch
from run_kvpress import ratio_for, recorder_setup


def main() -> None:
    args, model = recorder_setup(__doc__)
    import kvpress
    from transformers import DynamicCache

    class Recording(kvpress.ExpectedAttentionPress):
        """The press, noting each layer's kept positions as ``ScorerPress.compress`` picks them."""

        kept: list

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = super().score(module, hidden_states, keys, values, attentions, kwargs)
            n = int(keys.shape[2] * (1 - self.compression_ratio))
            self.kept.append(scores.topk(n, dim=-1).indices[0].tolist())
            return scores

    records = []
    for sample in map(json.loads, open(args.samples)):
        context = sample["context"]
        for budget in args.budgets:
            press = Recording(compression_ratio=ratio_for(len(context), budget))
            press.kept = []
            with torch.no_grad(), press(model):
                model.model(input_ids=torch.tensor([context]), past_key_values=DynamicCache())
            masks = [[hex(sum(1 << p for p in head)) for head in layer] for layer in press.kept]
            records.append(dict(sample=sample["id"], context=context, budget=budget, kept=masks))
            print(sample["id"], len(context), budget, flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(kvpress=importlib.metadata.version("kvpress"), records=records), f)


if __name__ == "__main__":
    main()
