"""Command line: ``python -m kvjax generate --model smollm2-135m-instruct --chat "..."``."""

from __future__ import annotations

import argparse
import sys
import time

from kvjax.engine import PROTOCOLS
from kvjax.eval.cli import add_eval_parser
from kvjax.kernels import IMPLS
from kvjax.scorers import AGGREGATES, POOLS, SCORERS


def _generate(args) -> int:
    import kvjax
    from kvjax.generate import eviction_settings

    eviction = {} if args.budget is None else dict(
        scorer=args.scorer, protocol=args.protocol, block_size=args.block_size, n_sink=args.n_sink,
        window=args.window, obs_window=args.obs_window, pool=args.pool, kernel=args.kernel,
        aggregate=args.aggregate, mi_batch=args.mi_batch, impl=args.impl, evict_every=args.evict_every,
        decode_evict=not args.no_decode_evict)
    eviction_settings(args.budget, **eviction)  # bad settings fail before the model loads
    start = time.perf_counter()
    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    if args.chat is not None:
        ids = kvjax.chat_tokens(tokenizer, args.chat, system=args.system)
    else:
        ids = tokenizer(args.prompt)["input_ids"]
    print(f"[{args.model}: loaded in {time.perf_counter() - start:.1f}s, prompt {len(ids)} tokens]",
          file=sys.stderr)
    start, new = time.perf_counter(), []
    stream = kvjax.generate_stream(params, ids, max_new_tokens=args.max_new_tokens, chunk=args.chunk,
                                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                   seed=args.seed, budget=args.budget, **eviction)
    printed = ""
    for (chunk,) in stream:
        new.extend(int(t) for t in chunk)
        text = tokenizer.decode(new, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text
    print()
    print(f"[{len(new)} tokens in {time.perf_counter() - start:.1f}s, compilation included]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt or a chat message, streaming the answer",
                       description="Generate text with a Llama/Qwen model, streaming tokens as they are decoded.")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="registry name, .gguf file, Hugging Face directory or kvjax checkpoint "
                        "(default: %(default)s)")
    text = g.add_mutually_exclusive_group(required=True)
    text.add_argument("--chat", metavar="MESSAGE", help="a user message, wrapped in the model's chat template")
    text.add_argument("--prompt", metavar="TEXT", help="raw text to continue (no chat template)")
    g.add_argument("--system", help="system message for --chat (default: the template's own)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="new tokens at most (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    g.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling (default: %(default)s)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and activations")
    g.add_argument("--chunk", type=int, default=4, help="decode steps between streamed outputs")
    e = g.add_argument_group("eviction (active with --budget; see docs/eviction.md)")
    e.add_argument("--budget", type=int, help="KV slots kept per layer and KV head (default: full cache)")
    e.add_argument("--scorer", default="snapkv",
                   help="eviction scorer: a base (%s) or base+modifier, e.g. snapkv+obcache-joint, h2o+caote, "
                        "momentkv (every name: README, 'Scorer names'; default: %%(default)s)" % ", ".join(SCORERS))
    e.add_argument("--protocol", default="blockwise", choices=PROTOCOLS,
                   help="blockwise: evict after every prompt block; prefill: prefill, then evict once")
    e.add_argument("--block-size", type=int, default=128, help="prompt block size (default: %(default)s)")
    e.add_argument("--n-sink", type=int, default=4, help="first tokens never evicted (default: %(default)s)")
    e.add_argument("--window", type=int, help="most recent tokens never evicted (default: the scorer's)")
    e.add_argument("--obs-window", type=int, default=32, help="SnapKV observation window (default: %(default)s)")
    e.add_argument("--pool", choices=POOLS, help="pooling of scores along positions (default: the scorer's)")
    e.add_argument("--kernel", type=int, default=7, help="pooling kernel size (default: %(default)s)")
    e.add_argument("--aggregate", choices=AGGREGATES,
                   help="how the query heads of a KV head combine (default: sum for OBCache, else mean; "
                        "layer: mean over all heads of the layer, the same tokens kept in every KV head)")
    e.add_argument("--mi-batch", type=int, default=1,
                   help="MomentKV: tokens evicted per statistics update (1 = exact Algorithm 1; default: 1)")
    e.add_argument("--impl", choices=[i for i in IMPLS if i], default=None,
                   help="attention with scores: XLA, or the Pallas kernels (pallas: the platform's, interpreted "
                        "on CPU); default: XLA on CPU, the kernels on TPU and CUDA GPUs")
    e.add_argument("--evict-every", type=int, default=1, help="decode steps between evictions (default: 1)")
    e.add_argument("--no-decode-evict", action="store_true", help="do not evict while decoding")
    g.set_defaults(run=_generate)
    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as e:  # CheckpointError included: clear messages, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
