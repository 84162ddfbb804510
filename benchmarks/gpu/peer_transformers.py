"""Part "peer": the same 8B shapes in torch ``transformers`` (``LlamaForCausalLM``, random bfloat16
weights, sdpa attention, ``StaticCache``), run in a process of its own so that it has the whole card
(JAX keeps what it took).

prefill: one prompt of random ids, ``logits_to_keep=1``, no cache, median of timed calls after a
warm-up.
decode: greedy steps (argmax in torch, as kvjax's loop) at each batch; the static cache is sized for
the context plus the steps and filled by a 16-token prefill, and each step runs at position context
+ i. A static cache's sdpa step attends over every slot of the cache with a mask, so its cost is
that of a full context whatever the slots hold. Eager mode, no torch.compile. Prints one JSON
object.

    python benchmarks/gpu/peer_transformers.py [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache


def config(smoke: bool) -> LlamaConfig:
    if smoke:
        shape = dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
        )
    else:
        shape = dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
        )
    return LlamaConfig(
        **shape,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    smoke = args.smoke
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    contexts, batches, steps = (
        ((256, 512), (1, 2, 4), 2) if smoke else ((4096, 32768), (1, 8, 32, 64), 16)
    )
    cfg = config(smoke)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    out = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "prefill": [],
        "decode": [],
    }
    print(f"[peer] weights ready on {out['device_name']}", file=sys.stderr, flush=True)
    vocab = cfg.vocab_size
    for context in contexts:
        try:
            ids = torch.randint(10, vocab - 10, (1, context), device=device)
            times = []
            for _ in range(3):
                sync(device)
                t0 = time.perf_counter()
                model(ids, use_cache=False, logits_to_keep=1)
                sync(device)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times[1:])
            out["prefill"].append(
                {"context": context, "tokens_per_s": context / seconds, "seconds": seconds}
            )
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out["prefill"].append(
                {"context": context, "error": f"{type(e).__name__}: {str(e)[-400:]}"}
            )
        print(f"[peer] prefill {context}: {out['prefill'][-1]}", file=sys.stderr, flush=True)
    for context in contexts:
        for batch in batches:
            if context == contexts[1] and batch > 8:
                continue
            try:
                cache = StaticCache(config=cfg, max_cache_len=context + steps + 8)
                start = torch.randint(10, vocab - 10, (batch, 16), device=device)
                logits = model(
                    start,
                    past_key_values=cache,
                    cache_position=torch.arange(16, device=device),
                    use_cache=True,
                    logits_to_keep=1,
                ).logits
                tok = logits[:, -1].argmax(-1, keepdim=True)

                def run(first: int, n: int):
                    nonlocal tok
                    for i in range(n):
                        pos = torch.tensor([context + first + i], device=device)
                        logits = model(
                            tok, past_key_values=cache, cache_position=pos, use_cache=True
                        ).logits
                        tok = logits[:, -1].argmax(-1, keepdim=True)

                run(0, 3)
                sync(device)
                t0 = time.perf_counter()
                run(3, steps)
                sync(device)
                seconds = (time.perf_counter() - t0) / steps
                out["decode"].append(
                    {
                        "context": context,
                        "batch": batch,
                        "ms_per_step": 1e3 * seconds,
                        "tokens_per_s": batch / seconds,
                    }
                )
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                out["decode"].append(
                    {
                        "context": context,
                        "batch": batch,
                        "error": f"{type(e).__name__}: {str(e)[-400:]}",
                    }
                )
            print(
                f"[peer] decode {context} x{batch}: {out['decode'][-1]}",
                file=sys.stderr,
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
