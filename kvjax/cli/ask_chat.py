"""``python -m kvjax ask`` (compress a document once, answer many questions) and
``python -m kvjax chat`` (a multi-turn chat in a budgeted cache); ``read_text`` gives every text
argument curl's ``@FILE`` and ``-``."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

from kvjax.runtime.options import (
    add_arguments,
    eviction_from,
    from_arguments,
    with_tokenizer,
)

LONG_CONTEXT = 1024  # tokens from which compressing a context shows its progress


FROM_FILE = "@FILE: the file's text; -: standard input; either without one trailing newline"


def read_text(value: str, flag: str) -> str:
    """``value`` itself, or the contents of FILE for ``@FILE`` or standard input for ``-`` without
    one trailing newline (``\n`` or ``\r\n``; shell command substitution drops them too), so that a
    question written by ``echo`` is the prompt it would be typed inline."""
    if value == "-":
        return _chomp(sys.stdin.read())
    if value.startswith("@"):
        return _chomp(read_document(value[1:], f"{flag} {value}"))
    return value


def _chomp(text: str) -> str:
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def read_document(path: str, what: str | None = None) -> str:
    """The text of the file ``path``, or a ValueError naming ``what`` gave it (by default
    ``--context PATH``) and the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what or '--context ' + path}: cannot read {path!r}: {e}") from None


@contextlib.contextmanager
def elapsed(desc: str, enabled: bool):
    """A status line on stderr counting the seconds of a step that reports no progress of its
    own."""
    if not enabled:
        yield
        return
    from tqdm import tqdm

    bar = tqdm(desc=desc, bar_format="{desc}: {elapsed}", file=sys.stderr)
    done = threading.Event()
    ticker = threading.Thread(
        target=lambda: [bar.refresh() for _ in iter(lambda: done.wait(0.5), True)], daemon=True
    )
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


def _model_arguments(p) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model source, as generate's --model (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and activations",
    )
    p.add_argument("--system", help=f"system prompt ({FROM_FILE})")
    p.add_argument("--max-new-tokens", type=int, default=None, help="longest answer in tokens")


def _ask(args) -> int:
    import jax

    import kvjax
    from kvjax.loading import chat_parts
    from kvjax.runtime.conversation import context_stats
    from kvjax.runtime.saved_context import context_path, load_context, save_context

    eviction = from_arguments(args)
    if args.server is not None:
        return _ask_server(args, eviction)
    if (args.context is None) == (args.load is None):
        raise ValueError(
            "give the document with --context FILE, or a saved context with --load DIR "
            "(one of them)"
        )
    if args.load is not None and eviction:
        raise ValueError(
            f"--load: the saved context keeps the eviction settings it was compressed with; "
            f"{', '.join('--' + k.replace('_', '-') for k in eviction)} apply with --context only"
        )
    if args.context is not None and eviction.get("budget") is None:
        raise ValueError(
            "--budget is required with --context (tokens per layer and KV head, or a fraction)"
        )
    if args.context is not None:
        # bad settings and an unreadable document fail before the model loads
        eviction_from(**with_tokenizer(None, **eviction))
        document = read_document(args.context)
    questions = [read_text(q, "question") for q in args.questions]
    if not questions and args.save is None:
        raise ValueError(
            "no questions: give one or more, or --save DIR to keep the compressed context"
        )
    system = None if args.system is None else read_text(args.system, "--system")
    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    if args.load is not None:
        context = load_context(context_path(args.load), params)
        print(f"[loaded {args.load}: {context_stats(params, context)}]", file=sys.stderr)
    else:
        ids, _ = chat_parts(tokenizer, document + "\n\n", "", system=system)
        start = time.perf_counter()
        with elapsed(f"compressing {len(ids)} tokens", len(ids) >= LONG_CONTEXT and not args.quiet):
            context = kvjax.prefill(params, ids, **with_tokenizer(tokenizer, **eviction))
            jax.block_until_ready(context.logits)
        print(
            f"[compressed in {time.perf_counter() - start:.1f}s, compilation included: "
            f"{context_stats(params, context)}]",
            file=sys.stderr,
        )
        if args.save is not None:
            path = context_path(args.save)
            save_context(path, context, params)
            print(f"[saved to {path}]", file=sys.stderr)
    max_new = args.max_new_tokens or 64
    for question in questions:
        _, ids = chat_parts(tokenizer, "", question)
        start = time.perf_counter()
        answer = kvjax.decode(params, context, ids, max_new, evict=False)
        print(f"> {question}\n{tokenizer.decode(answer, skip_special_tokens=True).strip()}\n")
        print(f"[{len(answer)} tokens in {time.perf_counter() - start:.1f}s]", file=sys.stderr)
    return 0


def _ask_server(args, eviction: dict) -> int:
    """``ask --server URL``: the server compresses the document (``POST /v1/contexts``; once for
    the same document and settings) and answers each question on it (``context_id``)."""
    from kvjax.extras import require

    require("serve", "kvjax ask --server")
    import httpx
    import openai

    if args.context is None or args.load is not None or args.save is not None:
        raise ValueError("--server: give the document with --context FILE (no --save / --load)")
    if any(k in eviction for k in ("repeat_prompt", "head_scores")):
        raise ValueError("--server: the server makes KVzip's repeat prompt; no --head-scores")
    document, url = read_document(args.context), args.server.rstrip("/")
    try:
        models = httpx.get(f"{url}/v1/models", timeout=30).raise_for_status().json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise ValueError(
            f"--server {url}: no OpenAI-compatible server answers there ({e})"
        ) from None
    model = models[0]["id"]
    body = {"model": model, "document": document} | eviction
    if args.system is not None:
        body["system"] = read_text(args.system, "--system")
    start = time.perf_counter()
    try:
        made = httpx.post(f"{url}/v1/contexts", json=body, timeout=None)
    except httpx.HTTPError as e:
        raise ValueError(f"--server {url}: {e}") from None
    if made.status_code == 404:
        raise ValueError(f"--server {url} keeps no contexts (POST /v1/contexts: 404): kvjax serve")
    if made.status_code >= 400:
        raise ValueError(f"--server {url}: {_error_message(made)}")
    card = made.json()
    print(
        f"[{'compressed' if made.status_code == 201 else 'already stored'}: context {card['id']}, "
        f"{card['tokens']} tokens kept in {card['kept_slots']} slots, "
        f"{time.perf_counter() - start:.1f}s]",
        file=sys.stderr,
    )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=None)
    for question in [read_text(q, "question") for q in args.questions]:
        try:
            answer = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": question}],
                temperature=0,
                max_tokens=args.max_new_tokens or 64,
                extra_body={"context_id": card["id"]},
            )
        except openai.APIError as e:
            raise ValueError(f"--server {url}: {e}") from None
        print(f"> {question}\n{answer.choices[0].message.content.strip()}\n")
    return 0


def _error_message(response) -> str:
    """An error response's message: OpenAI's error body, else its text."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code} {response.text[:200]}"


def _chat(args) -> int:
    import kvjax
    from kvjax.runtime.conversation import Conversation

    eviction = from_arguments(args)
    if eviction.get("budget") is None:
        raise ValueError(
            "--budget is required: the chat keeps its cache within it "
            "(tokens per layer and KV head)"
        )
    if isinstance(eviction["budget"], float):
        raise ValueError(
            f"--budget {eviction['budget']}: a chat has no prompt length to take a fraction of; "
            "give a token count"
        )
    eviction_from(**with_tokenizer(None, **eviction))
    system = None if args.system is None else read_text(args.system, "--system")
    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    chat = Conversation(
        params,
        tokenizer,
        system=system,
        max_new_tokens=args.max_new_tokens or 256,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        **eviction,
    )
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401 - line editing and history for input()

        print("[/reset starts over, /stats shows the cache, Ctrl-D quits]", file=sys.stderr)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            print(file=sys.stderr)
            return 0
        message = line.strip()
        if not message:
            continue
        if message == "/reset":
            chat.reset()
            print("[reset: a new conversation]", file=sys.stderr)
        elif message == "/stats":
            stats = chat.stats()
            print(f"[{'nothing yet' if stats is None else stats}]", file=sys.stderr)
        elif message.startswith("/"):
            print(
                f"[unknown command {message.split()[0]}: /reset, /stats; Ctrl-D quits]",
                file=sys.stderr,
            )
        else:
            chat.say(message, on_text=lambda text: print(text, end="", flush=True))
            print()


def add_ask_chat_parsers(sub) -> None:
    a = sub.add_parser(
        "ask",
        help="compress a document once, then answer questions about it",
        description="Prefill and compress a document once under a budget, then answer each "
        "question against the compressed context (the question arrives after compression: "
        "KVzip's query-agnostic setting). --save keeps the compressed context for a later "
        "--load. Questions accept @FILE and - (standard input), each read without one "
        "trailing newline.",
    )
    a.add_argument("questions", nargs="*", metavar="QUESTION", help="questions about the document")
    a.add_argument("--context", metavar="FILE", help="the document (a UTF-8 text file)")
    a.add_argument(
        "--save",
        metavar="NAME|DIR",
        help="write the compressed context there (Orbax; atomic): a bare NAME "
        "goes to contexts/NAME in kvjax's directory (README 'Where files go'), a path where it "
        "says",
    )
    a.add_argument(
        "--load",
        metavar="NAME|DIR",
        help="answer from a context saved with --save instead of --context",
    )
    a.add_argument("--quiet", action="store_true", help="no progress line while compressing")
    a.add_argument(
        "--server",
        metavar="URL",
        help="use a running kvjax server's contexts (kvjax serve --context-slots N): it "
        "compresses --context once and answers there; the eviction flags given are sent, the "
        "server's defaults fill the rest",
    )
    _model_arguments(a)
    add_arguments(
        a.add_argument_group(
            "eviction (kvjax.EvictionOptions; with --context, --budget is required; "
            "docs/eviction.md)"
        ),
        defaults=False,
    )
    a.set_defaults(run=_ask)
    c = sub.add_parser(
        "chat",
        help="an interactive chat whose cache stays within a budget",
        description="A multi-turn chat: every message and answer are appended to one budgeted "
        "cache and evicted under the scorer, never prefilled again. /reset starts over, /stats "
        "shows tokens seen vs kept and the cache's bytes, Ctrl-D quits. Reads standard "
        "input line by line, so it can be scripted.",
    )
    _model_arguments(c)
    g = c.add_argument_group("sampling")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    add_arguments(
        c.add_argument_group(
            "eviction (kvjax.EvictionOptions; --budget is required; docs/eviction.md)"
        ),
        defaults=False,
    )
    c.set_defaults(run=_chat)
