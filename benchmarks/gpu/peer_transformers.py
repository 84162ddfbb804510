"""Part "peer": the same 8B shapes in torch ``transformers`` (``LlamaForCausalLM``, random bfloat16
weights, sdpa attention, ``StaticCache``), run in a process of its own so that it has the whole card
(JAX keeps what it took). Every row is labelled by its ``mode``: "eager" rows first (as calls 1–4
ran them: their record), then "compiled" rows.

prefill: one prompt of random ids, ``logits_to_keep=1``, no cache, median of timed calls after a
warm-up.
decode: greedy steps (argmax in torch, as kvjax's loop) at each batch; the static cache is sized for
the context plus the steps and filled by a 16-token prefill (eager), and each step runs at position
context + i. A static cache's sdpa step attends over every slot of the cache with a mask, so its
cost is that of a full context whatever the slots hold.
compiled: transformers' recipe for a static cache, ``model.forward`` compiled by
``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs on a GPU), with
``dynamic=False``: every shape (batch, prompt length) gets a graph of its own rather than one made
dynamic at the second shape. Decode at batch 1, 8 and 32 over a 4K context, prefill of 4K and 32K
tokens. Each row's warm-up (the compile, the CUDA graph's recording) is timed apart, as
``compile_s``, from its timed calls.

A row that fails is a row with its error, and the script goes on. ``--seconds``: no row starts after
the deadline, nor a compiled row with less than its reserve left (COMPILE_RESERVE_S before any has
compiled, then 1.5× the longest compile seen); a row not started says so, and ``stopped`` says
where the script stopped. ``--out FILE``: the object written there after every row (the run's
parts/peer.json, kept if the process is killed). Prints one JSON object.

    python benchmarks/gpu/peer_transformers.py [--smoke] [--seconds S] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

COMPILE_RESERVE_S = 120.0  # the time a compiled row needs left to start, before any has compiled
EAGER_RESERVE_S = 5.0


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


def log(tag: str, message: str) -> None:
    print(f"[{tag}] {message}", file=sys.stderr, flush=True)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[-400:]}"


class Peer:
    """A peer script's JSON object, written to ``path`` after every row, and its deadline."""

    def __init__(self, tag: str, out: dict, path: Path | None, seconds: float | None):
        self.tag, self.out, self.path = tag, out, path
        self.end = None if seconds is None else time.monotonic() + seconds
        self.save()

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()

    def add(self, table: str, row: dict) -> None:
        self.out[table].append(row)
        log(self.tag, f"{table}: {row}")
        self.save()

    def starts(self, table: str, label: dict, reserve: float) -> bool:
        """Whether a row needing ``reserve`` seconds may start; if not, its "not run" row."""
        left = self.left()
        if left >= reserve:
            return True
        why = (
            f"not run: {max(0.0, left):.1f} s left before the deadline, under the row's reserve "
            f"of {reserve:.0f} s"
        )
        self.out.setdefault("stopped", f"at {label}: {why}")
        self.add(table, {**label, "error": why})
        return False

    def save(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.out, indent=1))
            tmp.replace(self.path)


def compile_forward(model):
    """transformers' static-cache recipe: ``model.forward`` compiled with CUDA graphs, one graph
    per shape (the compile cache is per code object: every row's shape may add one)."""
    limits = torch._dynamo.config
    setattr(
        limits, "recompile_limit" if hasattr(limits, "recompile_limit") else "cache_size_limit", 64
    )
    return torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)


def prefill_row(forward, ids, device, compiled: bool) -> dict:
    """Eager: 3 calls, the median of the last 2. Compiled: 3 warm-up calls (compile, the CUDA
    graph's recording, its first replay: ``compile_s``), then the median of 2 timed calls."""

    def call() -> float:
        sync(device)
        t0 = time.perf_counter()
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        forward(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync(device)
        return time.perf_counter() - t0

    context = ids.shape[1]
    if not compiled:
        times = [call() for _ in range(3)]
        seconds = statistics.median(times[1:])
        return {"context": context, "tokens_per_s": context / seconds, "seconds": seconds}
    warmup = sum(call() for _ in range(3))
    seconds = statistics.median(call() for _ in range(2))
    return {
        "context": context,
        "tokens_per_s": context / seconds,
        "seconds": seconds,
        "compile_s": warmup,
    }


def decode_row(model, forward, cfg, context, batch, steps, device, compiled: bool) -> dict:
    """3 warm-up steps (compiled: the compile and the CUDA graph's recording, ``compile_s``), then
    ``steps`` timed."""
    vocab = cfg.vocab_size
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
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            logits = forward(
                input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True
            ).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)

    t0 = time.perf_counter()
    run(0, 3)
    sync(device)
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    run(3, steps)
    sync(device)
    seconds = (time.perf_counter() - t0) / steps
    row = {
        "context": context,
        "batch": batch,
        "ms_per_step": 1e3 * seconds,
        "tokens_per_s": batch / seconds,
    }
    return {**row, "compile_s": warmup} if compiled else row


def arguments(doc: str) -> argparse.Namespace:
    """A peer script's command line (``doc``: its docstring): ``--smoke``, ``--seconds`` (its
    deadline) and ``--out`` (``Peer``'s file)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--seconds", type=float, help="no row starts after this (default: none)")
    parser.add_argument("--out", type=Path, help="the JSON object, written after every row")
    return parser.parse_args()


@torch.inference_mode()
def main() -> int:
    args = arguments(__doc__)
    smoke = args.smoke
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    contexts, batches, steps = (
        ((256, 512), (1, 2, 4), 2) if smoke else ((4096, 32768), (1, 8, 32, 64), 16)
    )
    # compiled: decode batches at the shorter context, prefill lengths
    compiled_batches, compiled_prefills = ((1, 4), (256,)) if smoke else ((1, 8, 32), contexts)
    cfg = config(smoke)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    peer = Peer(
        "peer",
        {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": str(device),
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "compile": "torch.compile(model.forward, mode='reduce-overhead', fullgraph=True, "
            "dynamic=False)",
            "prefill": [],
            "decode": [],
        },
        args.out,
        args.seconds,
    )
    log("peer", f"weights ready on {peer.out['device_name']}")
    vocab = cfg.vocab_size

    def prefill(forward, context: int, mode: str, reserve: float) -> None:
        label = {"mode": mode, "context": context}
        if not peer.starts("prefill", label, reserve):
            return
        try:
            ids = torch.randint(10, vocab - 10, (1, context), device=device)
            row = prefill_row(forward, ids, device, mode == "compiled")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            row = {"context": context, "error": error_text(e)}
        peer.add("prefill", {"mode": mode, **row})

    def decode(forward, context: int, batch: int, mode: str, reserve: float) -> None:
        label = {"mode": mode, "context": context, "batch": batch}
        if not peer.starts("decode", label, reserve):
            return
        try:
            row = decode_row(model, forward, cfg, context, batch, steps, device, mode == "compiled")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            row = {"context": context, "batch": batch, "error": error_text(e)}
        peer.add("decode", {"mode": mode, **row})
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for context in contexts:
        prefill(model, context, "eager", EAGER_RESERVE_S)
    for context in contexts:
        for batch in batches:
            if context == contexts[1] and batch > 8:
                continue
            decode(model, context, batch, "eager", EAGER_RESERVE_S)

    forward = compile_forward(model)

    def reserve() -> float:  # a compiled row's: 1.5× the longest compile so far
        if smoke:
            return 0.0
        seen = [
            r["compile_s"] for t in ("prefill", "decode") for r in peer.out[t] if "compile_s" in r
        ]
        return 1.5 * max(seen) if seen else COMPILE_RESERVE_S

    for batch in compiled_batches:
        decode(forward, contexts[0], batch, "compiled", reserve())
    for context in compiled_prefills:
        prefill(forward, context, "compiled", reserve())
    print(json.dumps(peer.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
