"""Command line: ``python -m kvjax generate --model smollm2-135m-instruct --chat "..."``."""

from __future__ import annotations

import argparse
import socket
import sys
import time

from kvjax.cli.ask_chat import FROM_FILE, add_ask_chat_parsers, read_document, read_text
from kvjax.eval.cli import add_eval_parser
from kvjax.runtime.compilation_cache import enable as enable_compilation_cache
from kvjax.runtime.options import (
    add_arguments,
    eviction_from,
    from_arguments,
    memory_bytes,
    with_tokenizer,
)


def _generate(args) -> int:
    import kvjax

    eviction = from_arguments(args)
    eviction_from(**with_tokenizer(None, **eviction))  # bad settings fail before the model loads
    mesh = kvjax.make_mesh(args.mesh) if args.mesh else None
    message = (
        read_text(args.chat, "--chat")
        if args.chat is not None
        else read_text(args.prompt, "--prompt")
    )
    system = None if args.system is None else read_text(args.system, "--system")
    start = time.perf_counter()
    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    if args.chat is not None:
        ids = kvjax.chat_tokens(tokenizer, message, system=system)
    else:
        ids = tokenizer(message)["input_ids"]
    print(
        f"[{args.model}: loaded in {time.perf_counter() - start:.1f}s, prompt {len(ids)} tokens]",
        file=sys.stderr,
    )
    start, new = time.perf_counter(), []
    stream = kvjax.generate_stream(
        params,
        ids,
        max_new_tokens=args.max_new_tokens,
        every=args.stream_every,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        mesh=mesh,
        **with_tokenizer(tokenizer, **eviction),
    )
    printed = ""
    for (chunk,) in stream:
        new.extend(int(t) for t in chunk)
        text = tokenizer.decode(new, skip_special_tokens=True)
        print(text[len(printed) :], end="", flush=True)
        printed = text
    print()
    print(
        f"[{len(new)} tokens in {time.perf_counter() - start:.1f}s, compilation included]",
        file=sys.stderr,
    )
    return 0


def _kvzip_heads(args) -> int:
    import kvjax
    from kvjax.runtime.kvzip_pass import save_head_scores

    text = read_document(args.context)
    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.max_tokens]
    start = time.perf_counter()
    scores = kvjax.prefill_full(params, ids).kvzip_head_scores(
        kvjax.kvzip_prompt(tokenizer, "paper")  # raw text
    )
    save_head_scores(args.out, scores, params.config)
    print(
        f"[{len(ids)} context tokens scored in {time.perf_counter() - start:.1f}s; head scores "
        f"[{scores.shape[0]}, {scores.shape[1]}] written to {args.out}]",
        file=sys.stderr,
    )
    return 0


def _serve(args) -> int:
    import os
    import signal

    from kvjax.extras import require

    require("serve", "kvjax serve")
    import uvicorn

    import kvjax
    from kvjax.serving import Driver, Engine
    from kvjax.serving.server import create_app

    eviction = from_arguments(args)
    eviction_from(**with_tokenizer(None, **eviction))  # bad settings fail before the model loads
    if args.context_evict_slots and not args.context_slots:
        raise ValueError(
            f"--context-evict-slots={args.context_evict_slots} needs --context-slots >= 1 "
            "(the contexts' store and their slots without eviction)"
        )
    check_listen(args.host, args.port)
    mesh = kvjax.make_mesh(args.mesh) if args.mesh else None
    start = time.perf_counter()
    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    shape = dict(
        max_prompt=args.max_prompt,
        max_new_tokens=args.max_tokens,
        mesh=mesh,
        prefill_rows=args.prefill_rows,
    )
    if args.kv_memory is None:
        engine = Engine(params, slots=args.slots, **shape, **eviction)
    else:
        kv_memory = memory_bytes(args.kv_memory, "--kv-memory")
        engine = Engine.for_memory(params, kv_memory, **shape, **eviction)
    random = " (random weights)" if args.model.startswith("random:") else ""
    print(
        f"[{args.model}{random}: loaded in {time.perf_counter() - start:.1f}s; "
        f"{capacity_line(engine)}]",
        file=sys.stderr,
    )
    if args.warmup:
        start = time.perf_counter()
        engine.warmup()
        print(
            f"[compiled prompt chunks of {engine.chunk_size} tokens in {engine.prefill_rows} "
            f"rows and decoding in "
            f"{time.perf_counter() - start:.1f}s]",
            file=sys.stderr,
        )
    driver = Driver(engine, queue_size=args.queue).start()
    name = os.path.basename(os.path.normpath(args.model))
    contexts = None if args.context_slots == 0 else _context_service(args, params, tokenizer, name)
    # uvicorn shuts down gracefully on SIGTERM / Ctrl-C (the requests in flight finish first), then
    # raises the signal again: SIGTERM then ends the process with status 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(
            create_app(driver, name, tokenizer, contexts),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
        )
    finally:
        driver.stop()
        if contexts is not None:
            contexts.close()
            for running in (contexts.driver, contexts.evict_driver):
                if running is not None:
                    running.stop()
    return 0


def check_listen(host: str, port: int) -> None:
    """A ValueError, before the model loads, where the server could not listen (bound as uvicorn
    binds, with SO_REUSEADDR, then released)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} must be in [0, 65535]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # uvicorn's choice
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e})") from None


def capacity_line(engine) -> str:
    """The engine's capacity in one line: slots, what a slot keeps, bytes."""
    m = engine.memory()
    keeps = (
        f"{m['tokens_per_slot']} tokens per layer and KV head"
        if m["per_kv_head"]
        else f"a context of {m['tokens_per_slot']} tokens"
    )
    return (
        f"{m['slots']} slots, each keeping {keeps} ({m['slot_bytes'] / 2**20:.1f} MiB); caches "
        f"{m['cache_bytes'] / 2**30:.2f} GiB, {m['prompt_rows']} prompt rows "
        f"{m['prompt_bytes'] / 2**30:.2f} GiB"
    )


def _context_service(args, params, tokenizer, name: str):
    """The contexts of ``kvjax serve`` (``--context-*``): a store under ``--contexts-dir``,
    ``--context-slots`` slots of the geometry of ``--context-scorer`` at ``--context-budget`` (and
    the server's ``--kv-dtype``) and ``--context-evict-slots`` slots that evict under exactly those
    settings."""
    import os

    from kvjax.loading import checkpoint_root
    from kvjax.serving import Driver, Engine
    from kvjax.serving.contexts import ContextService, ContextStore

    defaults = {"budget": args.context_budget, "scorer": args.context_scorer}
    if getattr(args, "kv_dtype", None) is not None:  # contexts stored as the slots store tokens
        defaults["kv_dtype"] = args.kv_dtype
    template = eviction_from(**with_tokenizer(tokenizer, **defaults))
    engines = [
        Engine(
            params,
            slots=slots,
            max_prompt=args.context_max_prompt,
            max_new_tokens=args.max_tokens,
            contexts=template,
            evict=evict,
        )
        for slots, evict in ((args.context_slots, False), (args.context_evict_slots, True))
        if slots
    ]
    for engine in engines if args.warmup else ():
        engine.warmup()
    root = args.contexts_dir or os.path.join(checkpoint_root(), "served-contexts", name)
    store = ContextStore(params, root, int(args.context_memory_mb * 2**20))
    print(f"[contexts: {len(store.records())} stored in {root}]", file=sys.stderr)
    driver, *evicting = [Driver(engine, queue_size=args.queue).start() for engine in engines]
    return ContextService(store, driver, tokenizer, defaults, *evicting)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="generate text from a prompt or a chat message, streaming the answer",
        description="Generate text with a Llama/Qwen model, streaming tokens as they are decoded.",
    )
    g.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="registry name, .gguf file, Hugging Face directory or model id (owner/name, from the "
        "local Hugging Face cache), or kvjax checkpoint (default: %(default)s)",
    )
    text = g.add_mutually_exclusive_group(required=True)
    text.add_argument(
        "--chat",
        metavar="MESSAGE",
        help=f"a user message, wrapped in the model's chat template ({FROM_FILE})",
    )
    text.add_argument(
        "--prompt",
        metavar="TEXT",
        help="raw text to continue, no chat template (@FILE, - as --chat)",
    )
    g.add_argument("--system", help="system message for --chat (default: the template's own)")
    g.add_argument(
        "--max-new-tokens", type=int, default=128, help="new tokens at most (default: %(default)s)"
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    g.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = off"
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    g.add_argument(
        "--seed", type=int, default=0, help="PRNG seed for sampling (default: %(default)s)"
    )
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and activations",
    )
    g.add_argument(
        "--stream-every", type=int, default=4, help="decode steps between streamed outputs"
    )
    g.add_argument(
        "--mesh",
        metavar="AXES",
        help="run on a device mesh, e.g. data=2,model=4 (batch over data, heads "
        "and MLP over model; docs/sharding.md); default: one device",
    )
    add_arguments(
        g.add_argument_group(
            "eviction (kvjax.EvictionOptions; active with --budget; docs/eviction.md)"
        )
    )
    g.set_defaults(run=_generate)
    h = sub.add_parser(
        "kvzip-heads",
        help="calibrate kvzip-head: KVzip's head scores of a context, to a file",
        description="Score a calibration context with KVzip's repeat pass and save each KV head's "
        "largest score (the head scores that `--scorer kvzip-head --head-scores FILE` "
        "keeps whole heads by).",
    )
    h.add_argument(
        "--model", default="smollm2-135m-instruct", help="model source (default: %(default)s)"
    )
    h.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    h.add_argument(
        "--context", required=True, metavar="FILE", help="a text file: the calibration context"
    )
    h.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="tokens of the file used (default: %(default)s)",
    )
    h.add_argument(
        "--out", required=True, metavar="FILE", help="where to write the head scores (JSON)"
    )
    h.set_defaults(run=_kvzip_heads)
    s = sub.add_parser(
        "serve",
        help="serve a model over HTTP: OpenAI-compatible completions and chat",
        description="Serve a model with continuous batching over a fixed number of slots: "
        "OpenAI-compatible /v1/completions and /v1/chat/completions (streaming as "
        "server-sent events), /v1/models and /health (docs/serving.md).",
    )
    s.add_argument(
        "--model", default="smollm2-135m-instruct", help="model source (default: %(default)s)"
    )
    s.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and activations",
    )
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    s.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default: %(default)s)"
    )
    size = s.add_mutually_exclusive_group()
    size.add_argument(
        "--slots", type=int, default=8, help="requests decoded together (default: %(default)s)"
    )
    size.add_argument(
        "--kv-memory",
        metavar="SIZE",
        help="instead of --slots: the memory for the caches (60GiB, 512MiB, or a fraction of the "
        "device memory free after the weights, 0.9); the slots are as many as it holds, printed "
        "at start",
    )
    s.add_argument(
        "--max-prompt",
        type=int,
        default=1024,
        help="longest prompt in tokens (default: %(default)s)",
    )
    s.add_argument(
        "--prefill-rows",
        type=int,
        help="prompts prefilled together, a chunk each per decode step (default: up to 4 with a "
        "budget, else 1; docs: Serving, 'Long prompts arriving while others decode')",
    )
    s.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="the largest max_tokens a request may ask for (default: %(default)s)",
    )
    s.add_argument(
        "--queue",
        type=int,
        default=64,
        help="requests that may wait for a slot; more are answered 429 (default: %(default)s)",
    )
    s.add_argument(
        "--mesh",
        metavar="AXES",
        help="run on a device mesh, e.g. data=2,model=4 (slots over data; "
        "docs/sharding.md); default: one device",
    )
    s.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile prompt chunks and decoding before serving (default: %(default)s)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's log level (default: %(default)s)",
    )
    add_arguments(
        s.add_argument_group(
            "eviction (kvjax.EvictionOptions, fixed for the server; active with "
            "--budget; docs/eviction.md)"
        )
    )
    c = s.add_argument_group(
        "contexts (/v1/contexts: documents compressed once, questions with context_id; "
        "docs/serving.md)"
    )
    c.add_argument(
        "--context-slots",
        type=int,
        default=0,
        help="slots answering questions on contexts (default: 0, no contexts)",
    )
    c.add_argument(
        "--context-evict-slots",
        type=int,
        default=0,
        help="slots answering questions that ask to be evicted under their context's budget "
        "(context_evict); they take contexts of exactly --context-scorer at --context-budget, "
        "a scorer that evicts as it decodes (default: 0, none)",
    )
    c.add_argument(
        "--context-budget",
        type=int,
        default=256,
        help="a context's default budget; with the scorer it sets the slots' geometry "
        "(default: %(default)s)",
    )
    c.add_argument(
        "--context-scorer",
        default="kvzip",
        help="a context's default scorer (default: %(default)s)",
    )
    c.add_argument(
        "--context-max-prompt",
        type=int,
        default=256,
        help="longest question appended to a context, in tokens (default: %(default)s)",
    )
    c.add_argument(
        "--context-memory-mb",
        type=float,
        default=1024,
        help="contexts held in memory; the least recently used leave it, not the disk "
        "(default: %(default)s)",
    )
    c.add_argument(
        "--contexts-dir",
        help="where contexts are stored and found again after a restart (default: "
        "served-contexts/MODEL in the kvjax directory)",
    )
    s.set_defaults(run=_serve)
    add_ask_chat_parsers(sub)
    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    enable_compilation_cache()
    try:
        return args.run(args)
    except (ValueError, TypeError, ImportError) as e:
        # CheckpointError and a missing extra: clear messages
        print(f"error: {e}", file=sys.stderr)
        return 2
