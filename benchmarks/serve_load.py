"""Load test of ``python -m kvjax serve`` on loopback: concurrent clients against the same requests
one at a time.

Run from the repository root (the default run takes about 20-30 minutes on the 2-core development
CPU):

    .venv/bin/python benchmarks/serve_load.py
    # a quick look
    .venv/bin/python benchmarks/serve_load.py --requests 16 --clients 8 --max-tokens 16

1. References: each request's greedy answer from ``kvjax.generate`` of its prompt alone (batch 1,
   same budget and scorer), computed in this process before any server starts.
2. Concurrent: a server with ``--slots`` slots (``python -m kvjax serve`` in a subprocess, warm-up
   included, on a free loopback port) answers ``--requests`` requests (40 to 250 words of real
   English text; a quarter
   each: chat streamed, chat whole, completion streamed, completion whole) from ``--clients``
   concurrent clients using the official ``openai`` client.
3. One at a time: a server with one slot answers the same requests from one client, each after the
   previous one (a server of 8 slots decodes all 8 rows at every step, so it would be slower still
   for a lone client).
4. Every answer must equal its reference; latency is per request (sent to last token), tokens/s is
   completion tokens over the phase's wall time. Each server is stopped with SIGTERM and must exit
   with status 0.

No request starts after ``--time-cap`` seconds from the start of a phase (those count as not
answered). The Markdown table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai

import kvjax
from kvjax.eval.haystack import pydoc_prose
from kvjax.serving.launch import ServeProcess

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
TARGET = 4.0  # concurrent throughput over one at a time, with 8 slots


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_requests(n: int, tokenizer) -> list[dict]:
    """``n`` requests of mixed lengths: 40 to 250 words of the Python reference's prose (real
    English, no download), as a chat question or as a text to continue; a quarter each of chat /
    completion, streamed or not."""
    words = pydoc_prose().split()
    rng = np.random.default_rng(0)
    requests = []
    for i in range(n):
        start = int(rng.integers(len(words) - 400))
        text = " ".join(words[start : start + int(rng.integers(40, 251))])
        chat = i % 4 < 2
        if chat:
            text = f"{text}\n\nIn one sentence, what is the text above about?"
            ids = kvjax.chat_tokens(tokenizer, text)
        else:
            ids = tokenizer(text)["input_ids"]
        requests.append(dict(index=i, chat=chat, stream=i % 2 == 0, text=text, ids=ids))
    return requests


def ask(client: openai.OpenAI, request: dict, model: str, max_tokens: int) -> dict:
    """Send one request; returns its text, completion tokens and latency in seconds."""
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=request["stream"])
    if request["stream"]:
        common["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    if request["chat"]:
        reply = client.chat.completions.create(
            messages=[{"role": "user", "content": request["text"]}], **common
        )
    else:
        reply = client.completions.create(prompt=request["text"], **common)
    if request["stream"]:
        pieces, tokens = [], 0
        for chunk in reply:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                pieces.append((choice.delta.content if request["chat"] else choice.text) or "")
        text = "".join(pieces)
    else:
        choice = reply.choices[0]
        text, tokens = (
            choice.message.content if request["chat"] else choice.text,
            reply.usage.completion_tokens,
        )
    return dict(
        index=request["index"], text=text, tokens=tokens, latency=time.perf_counter() - start
    )


def run_phase(
    url: str, requests: list[dict], clients: int, model: str, max_tokens: int, cap: float
) -> dict:
    """Every request through ``clients`` concurrent clients; none starts after ``cap`` seconds."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    start = time.perf_counter()

    def one(request):
        if time.perf_counter() - start > cap:
            return None
        return ask(client, request, model, max_tokens)

    with ThreadPoolExecutor(clients) as pool:
        results = [r for r in pool.map(one, requests) if r is not None]
    return dict(results=results, wall=time.perf_counter() - start)


def start_server(args, slots: int) -> ServeProcess:
    """``python -m kvjax serve`` with ``slots`` slots on a free loopback port, once it answers
    /health."""
    cmd = ["--model", args.model, "--dtype", args.dtype, "--slots", str(slots)]
    cmd += ["--max-prompt", str(args.max_prompt), "--max-tokens", str(args.max_tokens)]
    cmd += ["--queue", str(args.requests), "--budget", str(args.budget), "--scorer", args.scorer]
    cmd += ["--log-level", "warning"]
    log("server: kvjax serve " + " ".join(cmd))
    return ServeProcess(cmd, timeout=1800, cwd=ROOT)


def serve(args, slots: int, requests: list[dict], clients: int) -> dict:
    """A phase: start a server of ``slots`` slots, send the requests from ``clients`` clients, stop
    it."""
    server = start_server(args, slots)
    try:
        phase = run_phase(
            server.url,
            requests,
            clients,
            os.path.basename(os.path.normpath(args.model)),
            args.max_tokens,
            args.time_cap,
        )
    finally:
        phase_code = server.stop()
    log(
        f"{clients} client(s), {slots} slot(s): {phase['wall']:.1f}s; server exited with "
        f"{phase_code}"
    )
    return phase | {"code": phase_code}


def row(name: str, phase: dict, requests: list[dict], references: dict) -> tuple[str, float]:
    results = phase["results"]
    equal = sum(r["text"] == references[r["index"]] for r in results)
    tokens = sum(r["tokens"] for r in results)
    latency = np.array([r["latency"] for r in results]) if results else np.zeros(1)
    rate = tokens / phase["wall"]
    return (
        f"| {name} | {len(results)}/{len(requests)} | {equal}/{len(results)} | {phase['wall']:.1f} "
        f"| {tokens} | "
        f"{rate:.2f} | {np.percentile(latency, 50):.2f} | {np.percentile(latency, 99):.2f} |"
    ), rate


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--scorer", default="snapkv")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--max-prompt", type=int, default=512, help="the server's longest prompt")
    parser.add_argument(
        "--time-cap",
        type=float,
        default=1800,
        help="seconds after which a phase sends nothing more",
    )
    args = parser.parse_args()

    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    requests = make_requests(args.requests, tokenizer)
    lengths = [len(r["ids"]) for r in requests]
    log(
        f"{len(requests)} requests, prompts of {min(lengths)}-{max(lengths)} tokens (median "
        f"{np.median(lengths):.0f}, "
        f"{sum(n > args.budget for n in lengths)} beyond the budget)"
    )
    eviction = dict(budget=args.budget, scorer=args.scorer)
    start, references = time.perf_counter(), {}
    for r in requests:
        out = kvjax.generate(params, r["ids"], max_new_tokens=args.max_tokens, **eviction)
        references[r["index"]] = tokenizer.decode(out, skip_special_tokens=True)
    log(f"references (kvjax.generate, batch 1): {time.perf_counter() - start:.1f}s")
    # the prompts' compression alone (and one token), one at a time as the driver admits
    for _ in range(2):
        start = (
            time.perf_counter()
        )  # them; the first pass compiles each prompt bucket's one-token program
        for r in requests:
            kvjax.generate(params, r["ids"], max_new_tokens=1, **eviction)
        prefill = time.perf_counter() - start
    del params

    concurrent = serve(args, args.slots, requests, args.clients)
    sequential = serve(args, 1, requests, 1)
    name = os.path.basename(os.path.normpath(args.model))

    print(
        f"{name}, {args.dtype}, budget {args.budget}, scorer {args.scorer}, {args.slots} slots, "
        "max_tokens "
        f"{args.max_tokens}, greedy; {len(requests)} requests, prompts of "
        f"{min(lengths)}-{max(lengths)} tokens "
        f"({sum(n > args.budget for n in lengths)} beyond the budget); "
        f"CPU with {os.cpu_count()} cores; server and clients on loopback\n"
    )
    print(
        "| mode | answered | equal to kvjax.generate alone | wall s | completion tokens | tokens/s "
        "| p50 latency s "
        "| p99 latency s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    line, rate = row(
        f"{args.clients} concurrent clients, {args.slots} slots", concurrent, requests, references
    )
    print(line)
    line, one = row("one at a time, 1 slot", sequential, requests, references)
    print(line)
    ratio = rate / one if one else float("nan")
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    print(
        f"\nthroughput: {ratio:.2f}x one at a time ({verdict}: target >= {TARGET:g}x with 8 slots)"
    )
    if sequential["wall"]:
        share = min(prefill / sequential["wall"], 1.0)
        print(
            "prefills alone (kvjax.generate with max_new_tokens=1, one at a time, as the server "
            "admits them): "
            f"{prefill:.1f} s, {100 * share:.0f}% of the one-at-a-time phase; with decoding "
            f"{args.slots}x cheaper "
            f"and nothing else, {args.slots} slots could reach at most "
            f"{1 / (share + (1 - share) / args.slots):.2f}x"
        )
    phases = (concurrent, sequential)
    answered = sum(len(p["results"]) for p in phases)
    equal = all(r["text"] == references[r["index"]] for p in phases for r in p["results"])
    return (
        0 if equal and answered == 2 * len(requests) and all(p["code"] == 0 for p in phases) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
