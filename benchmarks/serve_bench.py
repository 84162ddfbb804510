"""Serving benchmark of an OpenAI-compatible server, with the semantics and names of vLLM's
``benchmark_serving``: requests arrive at ``--request-rate`` (Poisson; ``inf`` = all at once), at
most ``--max-concurrency`` at a time, each streamed; it reports time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency between streamed chunks (ITL), request and
token throughput and goodput under ``--goodput`` SLOs, prints them and saves them with every
request's figures (``--save-result``).

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 \\
        --model smollm2-135m-instruct --dataset-name random --random-input-len 1800 \\
        --random-output-len 64 --request-rate 2 --num-prompts 16 --ignore-eos \\
        --save-result --result-dir benchmarks/results/serve

Datasets:
- ``random``: prompts of random token ids (never special ones) of ``--random-input-len`` tokens
  (uniform within ``--random-range-ratio`` of it, as the output lengths), sent as token ids to the
  completions endpoint (``--backend openai``, exact lengths) or decoded to text for the chat
  endpoint (``openai-chat``, the default; the server counts the prompt);
- ``documents``: ``--num-documents`` documents of ``--document-len`` random tokens (as text) and
  ``--num-prompts`` short questions spread over them; ``--document-route contexts`` compresses each
  document once through ``/v1/contexts`` (kvjax's extension; the time is reported) and sends the
  questions with ``context_id``, ``whole`` sends every question with its whole document.

``--tokenizer`` (a kvjax model source, default ``--model``) makes the random prompts and counts
tokens where the server gives no usage. ``--verify SOURCE`` (greedy requests of the completions
backend only) generates each prompt with ``kvjax.generate`` on this machine, under
``--verify-eviction`` (the server's eviction keywords, ``budget=256,scorer=snapkv``), and counts the
answers whose text differs from the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import sys
import time
from datetime import datetime

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class Req:
    """One request: its prompt (token ids or text), lengths, and the context it continues."""

    prompt: list[int] | str
    input_len: int
    output_len: int
    document: int | None = None


@dataclasses.dataclass
class Out:
    """What one request measured."""

    success: bool = False
    error: str = ""
    text: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def random_ids(rng: np.random.Generator, tokenizer, n: int) -> list[int]:
    """n random token ids of ``tokenizer``'s vocabulary, no special ones."""
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
    return [int(i) for i in rng.choice(vocab, n)]


def random_text(rng: np.random.Generator, tokenizer, n: int) -> str:
    """Text of about n tokens of ``tokenizer``: random ids decoded, encoded again and cut to n (a
    decoded id may encode to several tokens), decoded."""
    text = tokenizer.decode(random_ids(rng, tokenizer, n))
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:n])


def lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """n lengths uniform in [mean (1 − ratio), mean (1 + ratio)] (``--random-range-ratio``)."""
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, n)


def make_requests(args, tokenizer) -> tuple[list[Req], list[str]]:
    """The requests of the dataset, and the documents (``documents`` only)."""
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    outs = lengths(rng, args.random_output_len, args.random_range_ratio, n)
    if args.dataset_name == "random":
        ins = lengths(rng, args.random_input_len, args.random_range_ratio, n)
        reqs = []
        for i, o in zip(ins, outs, strict=True):
            if args.backend == "openai":  # token ids: exactly i of them
                prompt = random_ids(rng, tokenizer, int(i))
            else:
                prompt = random_text(rng, tokenizer, int(i))
            reqs.append(Req(prompt, int(i), int(o)))
        return reqs, []
    docs = [random_text(rng, tokenizer, args.document_len) for _ in range(args.num_documents)]
    reqs = []
    for i, o in enumerate(outs):
        question = random_text(rng, tokenizer, args.question_len)
        reqs.append(Req(question, args.question_len, int(o), document=i % args.num_documents))
    return reqs, docs


def body_of(args, req: Req, docs: list[str], contexts: list[str]) -> tuple[str, dict]:
    """The endpoint and JSON body of one request."""
    body = {
        "model": args.model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    text = req.prompt
    if req.document is not None:
        if args.document_route == "contexts":
            body["context_id"] = contexts[req.document]
        else:
            text = docs[req.document] + "\n\n" + req.prompt
    if args.backend == "openai":
        return "/v1/completions", body | {"prompt": text}
    return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": text}]}


async def send(client, args, req: Req, docs, contexts) -> Out:
    """Stream one request; the time of every chunk that carries text."""
    import httpx

    endpoint, body = body_of(args, req, docs, contexts)
    out, start, last = Out(), time.perf_counter(), None
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                out.error = (
                    f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                )
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    out.prompt_tokens = event["usage"]["prompt_tokens"]
                    out.output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    piece = (
                        choice.get("text")
                        if args.backend == "openai"
                        else choice["delta"].get("content")
                    )
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last, out.text = now, out.text + piece
        out.latency, out.success = time.perf_counter() - start, True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def create_contexts(client, args, docs: list[str]) -> tuple[list[str], float]:
    """Each document compressed once through /v1/contexts: the ids and the seconds it took."""
    start, ids = time.perf_counter(), []
    for doc in docs:
        response = await client.post("/v1/contexts", json={"model": args.model, "document": doc})
        if response.status_code not in (200, 201):
            raise SystemExit(
                f"POST /v1/contexts: HTTP {response.status_code}: {response.text[:300]}"
            )
        ids.append(response.json()["id"])
    return ids, time.perf_counter() - start


async def run(args, reqs: list[Req], docs: list[str]) -> tuple[list[Out], float, float]:
    """Every request at its Poisson arrival time: (outputs, wall seconds, context seconds)."""
    import httpx

    rng = np.random.default_rng(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=args.timeout, limits=limits
    ) as client:
        contexts, context_s = [], 0.0
        if docs and args.document_route == "contexts":
            contexts, context_s = await create_contexts(client, args, docs)
        gate = asyncio.Semaphore(args.max_concurrency or len(reqs))

        async def limited(req):
            async with gate:
                return await send(client, args, req, docs, contexts)

        tasks, start = [], time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(limited(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        outs = await asyncio.wait_for(asyncio.gather(*tasks), args.time_limit)
        return outs, time.perf_counter() - start, context_s


def metrics(args, reqs: list[Req], outs: list[Out], wall: float, tokenizer) -> dict:
    """vLLM's names: completed, throughputs, mean / median / p99 of TTFT, TPOT, ITL, goodput."""
    for o in outs:
        if o.success and not o.output_tokens:  # no usage from the server: count the text
            o.output_tokens = len(tokenizer(o.text, add_special_tokens=False)["input_ids"])
    done = [(r, o) for r, o in zip(reqs, outs, strict=True) if o.success]
    ttft = [o.ttft * 1e3 for _, o in done]
    tpot = [
        (o.latency - o.ttft) * 1e3 / (o.output_tokens - 1) for _, o in done if o.output_tokens > 1
    ]
    itl = [x * 1e3 for _, o in done for x in o.itl]
    inputs = sum(o.prompt_tokens or r.input_len for r, o in done)
    output = sum(o.output_tokens for _, o in done)
    result = {
        "completed": len(done),
        "failed": len(outs) - len(done),
        "total_input_tokens": inputs,
        "total_output_tokens": output,
        "duration": wall,
        "request_throughput": len(done) / wall,
        "output_throughput": output / wall,
        "total_token_throughput": (inputs + output) / wall,
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for stat, fn in (
            ("mean", np.mean),
            ("median", np.median),
            ("p99", lambda x: np.percentile(x, 99)),
        ):
            result[f"{stat}_{name}_ms"] = float(fn(xs)) if xs else 0.0
    if args.goodput:
        slo = dict(g.split(":") for g in args.goodput)
        good = sum(
            all(
                {
                    "ttft": o.ttft * 1e3,
                    "tpot": (o.latency - o.ttft) * 1e3 / max(o.output_tokens - 1, 1),
                    "e2el": o.latency * 1e3,
                }[k]
                <= float(v)
                for k, v in slo.items()
            )
            for _, o in done
        )
        result["request_goodput"] = good / wall
    return result


def verify(args, reqs: list[Req], outs: list[Out]) -> dict:
    """The server's greedy answers against ``kvjax.generate`` of each prompt alone."""
    import kvjax
    from kvjax.runtime.options import budget_value

    eviction = {}
    for pair in filter(None, (args.verify_eviction or "").split(",")):
        key, value = pair.split("=")
        eviction[key] = (
            budget_value(value) if key == "budget" else (int(value) if value.isdigit() else value)
        )
    params, tokenizer = kvjax.load(args.verify), kvjax.load_tokenizer(args.verify)
    differ = 0
    for r, o in zip(reqs, outs, strict=True):
        stop = () if args.ignore_eos else None
        ids = kvjax.generate(
            params, r.prompt, max_new_tokens=r.output_len, stop_ids=stop, **eviction
        )
        differ += tokenizer.decode(ids, skip_special_tokens=True) != o.text
    return {"verified": len(reqs), "differ_from_generate": differ}


def report(args, result: dict) -> str:
    """vLLM's result table."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    rows = [
        ("Successful requests:", "completed"),
        ("Failed requests:", "failed"),
        ("Benchmark duration (s):", "duration"),
        ("Total input tokens:", "total_input_tokens"),
        ("Total generated tokens:", "total_output_tokens"),
        ("Request throughput (req/s):", "request_throughput"),
        ("Request goodput (req/s):", "request_goodput"),
        ("Output token throughput (tok/s):", "output_throughput"),
        ("Total token throughput (tok/s):", "total_token_throughput"),
        ("Context compression (s):", "context_seconds"),
    ]
    for label, key in rows:
        if key in result:
            value = result[key]
            lines.append(
                f"{label:<40}{value:<10.2f}"
                if isinstance(value, float)
                else f"{label:<40}{value:<10}"
            )
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
    ):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat in ("mean", "median", "p99"):
            lines.append(
                f"{f'{stat.capitalize()} {name.upper()} (ms):':<40}"
                f"{result[f'{stat}_{name}_ms']:<10.2f}"
            )
    if "differ_from_generate" in result:
        lines.append(
            f"{'Answers unlike kvjax.generate alone:':<40}{result['differ_from_generate']}/"
            f"{result['verified']}"
        )
    return "\n".join(lines + ["=" * 50])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["openai", "openai-chat"], default="openai-chat")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--model", required=True, help="the served model's name (and the default --tokenizer)"
    )
    parser.add_argument(
        "--tokenizer", help="a kvjax model source whose tokenizer makes the prompts"
    )
    parser.add_argument("--dataset-name", choices=["random", "documents"], default="random")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--num-documents", type=int, default=4)
    parser.add_argument("--document-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--document-route", choices=["contexts", "whole"], default="contexts")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument(
        "--time-limit", type=float, default=3600.0, help="seconds the whole run may take"
    )
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename")
    parser.add_argument(
        "--verify", metavar="SOURCE", help="check greedy answers against kvjax.generate"
    )
    parser.add_argument(
        "--verify-eviction", metavar="K=V,...", help="the server's eviction keywords"
    )
    parser.add_argument(
        "--label", default="", help="free text saved with the result (e.g. 'random weights')"
    )
    args = parser.parse_args(argv)
    for key in args.goodput or ():
        if key.split(":")[0] not in ("ttft", "tpot", "e2el") or len(key.split(":")) != 2:
            parser.error(f"--goodput {key!r}: give KEY:MS with KEY one of ttft, tpot, e2el")
    if args.verify and (
        args.backend != "openai" or args.temperature or args.dataset_name != "random"
    ):
        parser.error(
            "--verify: greedy requests (--temperature 0) of the random dataset on --backend openai"
        )

    import kvjax

    tokenizer = kvjax.load_tokenizer(args.tokenizer or args.model)
    reqs, docs = make_requests(args, tokenizer)
    outs, wall, context_s = asyncio.run(run(args, reqs, docs))
    result = metrics(args, reqs, outs, wall, tokenizer)
    if docs:
        result["context_seconds"] = context_s
    if args.verify:
        result |= verify(args, reqs, outs)
    print(report(args, result))
    errors = [o.error for o in outs if not o.success]
    for e in sorted(set(errors))[:5]:
        print(f"error ({errors.count(e)}x): {e}", file=sys.stderr)
    if args.save_result:
        now = datetime.now().strftime("%Y%m%d-%H%M%S")
        model = re.sub(r"[^\w.-]", "-", args.model)
        name = args.result_filename or f"{args.backend}-{args.request_rate}qps-{model}-{now}.json"
        os.makedirs(args.result_dir, exist_ok=True)
        record = {
            "date": now,
            "backend": args.backend,
            "model_id": args.model,
            "label": args.label,
            "tokenizer_id": args.tokenizer or args.model,
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "dataset_name": args.dataset_name,
            "argv": sys.argv[1:],
            **result,
            "input_lens": [o.prompt_tokens or r.input_len for r, o in zip(reqs, outs, strict=True)],
            "output_lens": [o.output_tokens for o in outs],
            "ttfts": [o.ttft for o in outs],
            "itls": [o.itl for o in outs],
            "errors": [o.error for o in outs],
        }
        with open(os.path.join(args.result_dir, name), "w") as f:
            json.dump(record, f)
        print(f"saved {os.path.join(args.result_dir, name)}", file=sys.stderr)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
