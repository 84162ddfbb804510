"""How many slots ``kvjax serve --kv-memory`` gives (``Engine.for_memory``), per cache, for a model
shape.

    .venv/bin/python benchmarks/serve_capacity.py --model random:llama-3.1-8b --dtype bfloat16 \
        --kv-memory 60GiB --max-prompt 32768 --max-tokens 512 --prefill-rows 4 \
        --out benchmarks/results/capacity.md

``--prefill-rows 4``: a budget cache's prompt rows in an engine on an accelerator (on a CPU it has
one; the full cache has one everywhere). Shapes only: the weights are abstract (``jax.eval_shape``)
and the caches' bytes come from abstract shapes (``Engine.cache_bytes``), so an 8B shape runs in
seconds on a CPU. ``--caches``: ``full`` or ``SCORER:BUDGET`` (SnapKV's dense cache, AdaKV's paged
one, ...), either with ``:KV_DTYPE`` (int8, float8_e4m3fn, int4: ``full:int8``,
``snapkv:1024:int4``).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvjax.checkpoint.random_model import shape_of  # noqa: E402
from kvjax.cli.main import memory_bytes  # noqa: E402
from kvjax.loading import DTYPES  # noqa: E402
from kvjax.model.params import init_params  # noqa: E402
from kvjax.serving import Engine  # noqa: E402


def parse(cache: str) -> dict:
    """``full[:KV_DTYPE]`` or ``SCORER:BUDGET[:KV_DTYPE]`` as eviction keywords."""
    parts = cache.split(":")
    if parts[0] == "full":
        return {"kv_dtype": parts[1]} if len(parts) == 2 else {}
    if len(parts) not in (2, 3):
        raise SystemExit(f"--caches {cache!r}: give full[:KV_DTYPE] or SCORER:BUDGET[:KV_DTYPE]")
    return {"scorer": parts[0], "budget": int(parts[1])} | (
        {"kv_dtype": parts[2]} if len(parts) == 3 else {}
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="random:llama-3.1-8b", help="a random:<shape>")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--kv-memory", default="60GiB")
    parser.add_argument("--max-prompt", type=int, default=32768)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument(
        "--caches",
        nargs="+",
        default=[
            "full",
            "full:int8",
            "full:int4",
            "snapkv:1024",
            "snapkv:1024:int8",
            "snapkv:1024:int4",
            "adakv:1024",
            "snapkv:256",
        ],
    )
    parser.add_argument(
        "--prefill-rows",
        type=int,
        help="the budget caches' prompt rows (Engine's prefill_rows; default the engine's on this "
        "machine: 4 on an accelerator, 1 on a CPU); the full cache's rows hold a whole prompt and "
        "the engine gives it one everywhere",
    )
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    cfg = shape_of(args.model)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), DTYPES[args.dtype]))
    memory = memory_bytes(args.kv_memory)
    lines = [
        f"{args.model} ({args.dtype}), --kv-memory {args.kv_memory}, prompts up to "
        f"{args.max_prompt} tokens, {args.max_tokens} new",
        "",
        "| cache | slots | a slot keeps | one slot MiB | prompt rows | prompt rows MiB | vs full |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    full = None
    for cache in args.caches:
        options = parse(cache)
        if args.prefill_rows is not None and "scorer" in options:
            options["prefill_rows"] = args.prefill_rows
        engine = Engine.for_memory(
            params, memory, max_prompt=args.max_prompt, max_new_tokens=args.max_tokens, **options
        )
        m = engine.memory()
        full = full or (m["slots"] if cache == "full" else None)  # the model dtype's full cache
        keeps = (
            f"{m['tokens_per_slot']} per layer and KV head"
            if m["per_kv_head"]
            else f"{m['tokens_per_slot']} tokens"
        )
        ratio = f"{m['slots'] / full:.1f}x" if full else ""
        lines.append(
            f"| {cache} | {m['slots']} | {keeps} | {m['slot_bytes'] / 2**20:.1f} | "
            f"{m['prompt_rows']} | {m['prompt_bytes'] / 2**20:.0f} | {ratio} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
