"""Part "kvpress": NVIDIA kvpress 0.5.5's ``KVzipPress`` and ``ExpectedAttentionPress`` compressing
a 4K and a 32K context on the 8B shapes (peer_transformers' ``LlamaForCausalLM``: the same config,
random bfloat16 weights, sdpa), in a process of its own (kvpress patches transformers' attention
functions when imported).

Each press keeps 1024 tokens per KV head, kvjax's budget 1024 (64 with ``--smoke``: kvjax's smoke
budget): ``compression_ratio`` = (n − 1024) / n, 0.75 at 4K and 0.96875 at 32K, exact in binary, so
that kvpress's rounding keeps exactly 1024 (``ExpectedAttentionPress``: ``int(n (1 − r))`` in every
layer and head; ``KVzipPress``: ``int(rows n r)`` of the rows × n scores evicted, rows = 32 layers ×
8 KV heads with its default ``layerwise=False``, so 1024 per head on average, uneven over layers
and heads). Every other argument is the press's default (``KVzipPress``: chunks of 2048, 4 sinks;
``ExpectedAttentionPress``: 512 future positions, covariance and value norms). Each row checks the
count kept: ``kept_per_head`` (the mean over layers and KV heads).

The call is kvpress's README's, ``with press(model): model.model(input_ids=ids,
past_key_values=DynamicCache())`` (the base model, as kvpress's pipeline calls it; no logits):
the prefill of the context and the press's work in it (Expected Attention scores and prunes each
layer in its forward hook; KVzip, after the prefill, runs the base model again over the context
repeated in chunks of 2048 behind a "Repeat the previous context exactly." prompt, scores every
context token, and masks the evicted ones: kvpress's "fake" eviction). ``seconds``: the median of
2 timed calls after a warm-up (fewer where the deadline is near: ``timed``), synchronized;
``tokens_per_s``: context tokens over it; ``prefill_s``: the same forward without a press (its
overhead: ``seconds − prefill_s``).

KVzipPress loads a tokenizer (``AutoTokenizer.from_pretrained(model.config.name_or_path)``) for
its repeat prompt; random weights have none and the card no network: ``word_pieces.WordPieces``
stands in, as for kvjax's KVzip in the model part (Llama 3-like word pieces: the first chunk's
prompt "\\n\\nRepeat the previous context exactly." is 7 tokens, as Llama 3's tokenizer makes it;
no chat template, so the suffix is "\\n" and no prefix is
left unscored; Llama 3.1 Instruct's template would add about 5 header tokens per chunk). With
``--smoke``, tiny shapes on the CPU, contexts of 256 and 512 and KVzip's chunks of 128 (so that its
chunked path runs).

kvpress's ``__init__`` imports every press; three modules it imports are used only by presses not
run here: ``datasets`` (DuoAttentionPress, ExpectedAttentionStatsPress), ``fire``
(ExpectedAttentionStatsPress's command line) and ``requests`` (DuoAttentionPress, LUKVPress). Where
one is not installed, a stub stands in (``stubbed`` names them), which raises if anything calls it.
``cachetools`` runs at import (DuoAttentionPress's and LUKVPress's module-level caches): a wheel.
kvpress 0.5.5 asks for transformers < 5.3; for the image's 5.17, ``pass_cache_position``.

    python benchmarks/gpu/peer_kvpress.py [--smoke] [--seconds S] [--out FILE]
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time
import types

import torch
import transformers
from peer_transformers import Peer, arguments, config, error_text, log, sync
from transformers import DynamicCache, LlamaForCausalLM
from word_pieces import WordPieces

UNUSED_IMPORTS = ("datasets", "fire", "requests")
PRESSES = ("KVzipPress", "ExpectedAttentionPress")


def stub_unused_imports() -> list[str]:
    """A stub module for each of UNUSED_IMPORTS that is not installed; their names."""
    stubbed = []
    for name in UNUSED_IMPORTS:
        if importlib.util.find_spec(name) is not None:
            continue
        module = types.ModuleType(name)

        def attribute(attr: str, name=name):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def missing(*args, **kwargs):
                raise ImportError(f"{name}.{attr}: {name} is not installed (a stub, peer_kvpress)")

            return missing

        module.__getattr__ = attribute
        sys.modules[name] = module
        stubbed.append(name)
    return stubbed


def ratio_for(n: int, budget: int, rows: int) -> float:
    """The compression ratio keeping ``budget`` of ``n`` per KV head, checked against both of
    kvpress's roundings (``rows``: the scores KVzip ranks together per context position)."""
    ratio = (n - budget) / n
    assert int(n * (1 - ratio)) == budget, (n, budget, ratio)
    assert rows * n - int(rows * n * ratio) == rows * budget, (n, budget, rows, ratio)
    return ratio


def pass_cache_position(model) -> dict:
    """transformers after 5.2 (5.17 on the card, 5.23 here) no longer hands the attention layers a
    ``cache_position``, which kvpress 0.5.5's ``BasePress.forward_hook`` reads to tell a prefill
    (``is_prefilling``; every ScorerPress, Expected Attention's too, fails on a KeyError without
    it). A forward pre-hook on every attention layer gives it the one transformers 5.2 gave, the
    positions of the tokens the call appends (the layer's cached length onwards), where it is
    absent. The count of calls it served: ``added``."""
    count = {"added": 0}

    def hook(module, args, kwargs):
        if "cache_position" in kwargs:
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cache = kwargs.get("past_key_values")
        past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
        kwargs["cache_position"] = torch.arange(past, past + hidden.shape[1], device=hidden.device)
        count["added"] += 1
        return args, kwargs

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    return count


def kept_per_head(model, cache, press: str, context: int) -> float:
    """The mean over layers and KV heads of the tokens kept: the cache's length (Expected
    Attention prunes), or the context less the masked keys (KVzip masks)."""
    layers = model.model.layers
    heads = model.config.num_key_value_heads
    if press == "KVzipPress":
        masked = sum(
            len(m[2])
            for m in (getattr(layer.self_attn, "masked_key_indices", None) for layer in layers)
            if m is not None
        )
        return context - masked / (len(layers) * heads)
    return statistics.mean(cache.layers[i].keys.shape[2] for i in range(len(layers)))


@torch.inference_mode()
def main() -> int:
    args = arguments(__doc__)
    smoke = args.smoke
    out = {"prefill": [], "compress": []}
    peer = Peer("kvpress", out, args.out, args.seconds)
    stubbed = stub_unused_imports()
    try:
        import kvpress
        from kvpress.presses import kvzip_press
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["error"] = f"kvpress not importable: {error_text(e)}"
        peer.save()
        print(json.dumps(out))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    contexts, budget, chunk = ((256, 512), 64, 128) if smoke else ((4096, 32768), 1024, 2048)
    cfg = config(smoke)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    added = pass_cache_position(model)
    tokenizer = WordPieces(cfg.vocab_size)
    kvzip_press.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: tokenizer)
    out.update(
        {
            "kvpress": importlib.metadata.version("kvpress"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": str(device),
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "budget": budget,
            "stubbed": stubbed,
            "tokenizer": "WordPieces (no chat template)",
        }
    )
    peer.save()
    log("kvpress", f"kvpress {out['kvpress']}, weights ready on {out['device_name']}")
    rows = cfg.num_hidden_layers * cfg.num_key_value_heads

    def press_for(name: str, context: int):
        if name == "KVzipPress":
            ratio = ratio_for(context, budget, rows)
            return kvpress.KVzipPress(compression_ratio=ratio, chunk_size=chunk), ratio
        ratio = ratio_for(context, budget, 1)
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio), ratio

    def call(ids, press=None) -> tuple[float, DynamicCache]:
        cache = DynamicCache()
        sync(device)
        t0 = time.perf_counter()
        if press is None:
            model.model(input_ids=ids, past_key_values=cache)
        else:
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
        sync(device)
        return time.perf_counter() - t0, cache

    def timed(ids, press, label: dict) -> dict:
        """A warm-up call, then up to 2 timed ones while the deadline allows."""
        warmup, cache = call(ids, press)
        row = {"warmup_s": warmup}
        if press is not None:
            row["kept_per_head"] = kept_per_head(model, cache, label["press"], label["context"])
        del cache
        times = []
        while len(times) < 2 and peer.left() > 1.5 * warmup:
            times.append(call(ids, press)[0])
        seconds = statistics.median(times) if times else warmup
        context = label["context"]
        return {**row, "seconds": seconds, "tokens_per_s": context / seconds, "timed": len(times)}

    for context in contexts:
        ids = torch.randint(10, cfg.vocab_size - 10, (1, context), device=device)
        label = {"context": context}
        prefill_s = None
        if peer.starts("prefill", label, 0.0):
            try:
                row = timed(ids, None, label)
                prefill_s = row["seconds"]
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                row = {"error": error_text(e)}
            peer.add("prefill", {**label, **row})
        for name in PRESSES:
            label = {"press": name, "context": context}
            if not peer.starts("compress", label, 0.0):
                continue
            try:
                press, ratio = press_for(name, context)
                row = {"compression_ratio": ratio, **timed(ids, press, label)}
                if prefill_s is not None:
                    row["prefill_s"] = prefill_s
                    row["overhead_s"] = row["seconds"] - prefill_s
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                row = {"error": error_text(e)}
            peer.add("compress", {**label, **row})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out["cache_position_added"] = added["added"]
    peer.save()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
