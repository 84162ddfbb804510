"""A soak of ``kvjax serve``: mixed traffic for a fixed time, checking every answer, that resident
memory and open files stay flat, that the context store keeps to its byte limit and that no
request waits forever.

    .venv/bin/python benchmarks/serve_soak.py --seconds 600 --out docs/results/serve/soak.json
    .venv/bin/python benchmarks/serve_soak.py --model random:tiny --seconds 20   # the tests' form

1. The server (``python -m kvjax serve`` in a subprocess on a free loopback port, contexts in a
   temporary directory) is started and warmed: every prompt of the pool answered once, plain and on
   each document's context, one at a time. Those answers are the references: greedy answers do not
   depend on what else the server is doing (docs/serving.md), so every later answer must equal
   its reference.
2. ``--clients`` clients send requests for ``--seconds`` (and at most ``--max-requests``), each
   draw one of: a chat (whole or streamed), a question on a context (whole or streamed), a context
   created again (the same document: its id, compressed anew when deleted before), a context
   deleted, a stream cancelled after its first chunk, and a bad request (each must get its
   documented 4xx).
   Every request has a deadline (``--timeout``); one that passes it counts as an error.
3. Every ``--sample`` seconds: the server's resident memory and open files (from /proc) and the
   store's bytes in memory against its limit (``GET /health``).

Pass: no error of any kind, resident memory at the end within 10% of its first sample a quarter
into the run, open files at the end no more than after warm-up plus the clients' connections, the
store within its limit at every sample. (The memory's reference is not the warm-up's, which asked
one question at a time: the first seconds of concurrent clients add to it once, e.g. 994 → 1,063
MiB in the first 8 s of a 20 s run on a loaded 2-core machine, then 8 MiB in the next 12; a leak
goes on growing.) Prints a table and writes the raw figures (every sample included) to ``--out``;
exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from kvjax.serving.launch import ServeProcess

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ("What is this about?", "Name one word it uses.", "Say it in five words.")
KINDS = {  # request kind: weight
    "chat": 4,
    "chat streamed": 4,
    "context question": 4,
    "context question streamed": 3,
    "context created": 1,
    "context deleted": 1,
    "stream cancelled": 2,
    "bad request": 2,
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def documents(n: int) -> list[str]:
    """``n`` short documents of English prose (the Python reference's, no download)."""
    from kvjax.eval.haystack import pydoc_prose

    text = pydoc_prose().split()
    return [" ".join(text[400 * i : 400 * i + 30 + 10 * i]) for i in range(n)]


def prompts(n: int) -> list[str]:
    return [f"Write a sentence about the number {i} and the sea." for i in range(n)]


class Server(ServeProcess):
    """``kvjax serve`` in a subprocess, its resident memory and open files from /proc."""

    def __init__(self, model: str, contexts_dir: str, extra: list[str]):
        args = ["--model", model, "--contexts-dir", contexts_dir, "--log-level", "warning", *extra]
        super().__init__(args, timeout=900, cwd=ROOT)

    def resident_mib(self) -> float:
        status = Path(f"/proc/{self.pid}/status").read_text()
        line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


class Soak:
    def __init__(self, server: Server, model: str, args):
        self.server, self.model, self.args = server, model, args
        self.http = httpx.Client(base_url=server.url, timeout=args.timeout)
        self.docs = documents(args.documents)
        self.prompts = prompts(args.prompts)
        self.expected: dict = {}  # (kind, prompt or (doc, question)) -> answer
        self.ids: dict[int, str] = {}  # document -> context id
        self.latency = collections.defaultdict(list)
        self.errors = collections.Counter()  # by error: timeout, wrong answer, an exception's type
        self.failed = collections.Counter()  # by request kind
        self.examples: dict[str, str] = {}
        self.count = collections.Counter()
        self.lock = threading.Lock()

    # one request of each kind; each returns what to compare with a reference, or None
    def chat(self, content: str, stream: bool, context: str | None = None, cancel=False):
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.args.max_tokens,
            "temperature": 0,
            "stream": stream,
        } | ({"context_id": context} if context else {})
        if not stream:
            reply = self.http.post("/v1/chat/completions", json=body)
            if reply.status_code == 404 and context:
                return "404"  # deleted by another client meanwhile
            reply.raise_for_status()
            return reply.json()["choices"][0]["message"]["content"]
        text = ""
        with self.http.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code == 404 and context:
                return "404"
            reply.raise_for_status()
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if cancel:
                    return None  # closes the connection after the first chunk
                event = json.loads(line[6:])
                if event["choices"]:
                    text += event["choices"][0]["delta"].get("content") or ""
        return text

    def create(self, doc: int) -> str:
        body = {"model": self.model, "document": self.docs[doc]}
        reply = self.http.post("/v1/contexts", json=body)
        if reply.status_code not in (200, 201):
            raise RuntimeError(f"POST /v1/contexts: {reply.status_code} {reply.text[:200]}")
        self.ids[doc] = reply.json()["id"]
        return self.ids[doc]

    def bad(self, rng: random.Random) -> None:
        user = [{"role": "user", "content": "x"}]
        cases = [
            ("/v1/chat/completions", {"model": "nope", "messages": user}, 404),
            ("/v1/chat/completions", {"model": self.model, "messages": []}, 422),
            ("/v1/completions", {"model": self.model, "prompt": "x", "max_tokens": 0}, 422),
            ("/v1/contexts", {"model": self.model, "document": ""}, 400),
            ("/v1/contexts", {"model": self.model, "document": "x", "budget": 0}, 400),
            (
                "/v1/chat/completions",
                {"model": self.model, "context_id": "../x", "messages": user},
                404,
            ),
        ]
        path, body, status = rng.choice(cases)
        reply = self.http.post(path, json=body)
        if reply.status_code != status:
            raise RuntimeError(f"{path} {body}: {reply.status_code}, expected {status}")

    def one(self, kind: str, rng: random.Random) -> None:
        """Send one request of ``kind``; errors are counted by the caller."""
        if kind.startswith("chat"):
            p = rng.randrange(len(self.prompts))
            got = self.chat(self.prompts[p], kind.endswith("streamed"))
            self.check(("chat", p), got)
        elif kind.startswith("context question"):
            doc, q = rng.randrange(len(self.docs)), rng.randrange(len(QUESTIONS))
            got = self.chat(QUESTIONS[q], kind.endswith("streamed"), self.ids[doc])
            for _ in range(3):  # deleted meanwhile by another client: made again, asked again
                if got != "404":
                    break
                got = self.chat(QUESTIONS[q], False, self.create(doc))
            self.check(("context", doc, q), got)
        elif kind == "context created":
            self.create(rng.randrange(len(self.docs)))
        elif kind == "context deleted":
            doc = rng.randrange(len(self.docs))
            reply = self.http.delete(f"/v1/contexts/{self.ids[doc]}")
            if reply.status_code not in (200, 404):
                raise RuntimeError(f"DELETE: {reply.status_code} {reply.text[:200]}")
            if reply.status_code == 200 and rng.random() < 0.5:
                self.create(doc)
        elif kind == "stream cancelled":
            self.chat(self.prompts[rng.randrange(len(self.prompts))], True, cancel=True)
        else:
            self.bad(rng)

    def check(self, key, got: str) -> None:
        if key not in self.expected:  # the warm-up's, one at a time
            self.expected[key] = got
        elif got != self.expected[key]:
            raise ValueError(f"{key}: {got!r} != {self.expected[key]!r}")

    def warm(self) -> None:
        for p in range(len(self.prompts)):
            self.one_kind(
                "chat", lambda p=p: self.check(("chat", p), self.chat(self.prompts[p], False))
            )
        for doc in range(len(self.docs)):
            self.create(doc)
            for q in range(len(QUESTIONS)):
                got = self.chat(QUESTIONS[q], False, self.ids[doc])
                self.check(("context", doc, q), got)

    def one_chat(self, p: int) -> None:
        self.check(("chat", p), self.chat(self.prompts[p], False))

    def one_kind(self, kind: str, call) -> None:
        start = time.perf_counter()
        try:
            call()
        except httpx.TimeoutException:
            self.fail("timeout", kind, kind)
        except ValueError as e:
            self.fail("wrong answer", kind, f"{kind}: {e}")
        except Exception as e:  # noqa: BLE001 - every other failure is counted by its type
            self.fail(type(e).__name__, kind, f"{kind}: {e}")
        else:
            with self.lock:
                self.latency[kind].append(time.perf_counter() - start)
        with self.lock:
            self.count[kind] += 1

    def fail(self, error: str, kind: str, example: str) -> None:
        with self.lock:
            self.errors[error] += 1
            self.failed[kind] += 1
            self.examples.setdefault(error, example[:300])

    def client(self, seed: int, until: float, budget: list) -> None:
        rng = random.Random(seed)
        names, weights = zip(*KINDS.items(), strict=True)
        while time.monotonic() < until:
            with self.lock:
                if budget[0] <= 0:
                    return
                budget[0] -= 1
            kind = rng.choices(names, weights)[0]
            self.one_kind(kind, lambda kind=kind: self.one(kind, rng))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=300, help="seconds any request may take")
    parser.add_argument("--sample", type=float, default=10, help="seconds between samples")
    parser.add_argument("--context-memory-mb", type=float, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="raw figures as JSON")
    args = parser.parse_args()
    extra = ["--slots", "4", "--max-prompt", "128", "--max-tokens", str(args.max_tokens)]
    extra += ["--budget", "64", "--context-slots", "4", "--context-budget", "64"]
    extra += ["--context-max-prompt", "512", "--context-memory-mb", str(args.context_memory_mb)]
    with tempfile.TemporaryDirectory() as contexts_dir:
        server = Server(args.model, contexts_dir, extra)
        try:
            report = soak(server, args)
        finally:
            code = server.stop()
        leftover = sorted(n for n in os.listdir(contexts_dir) if n.startswith("."))
        report["checks"] |= {"exit 0 on SIGTERM": code == 0, "no temporaries left": not leftover}
        report |= {
            "exit code on SIGTERM": code,
            "leftover files in the contexts directory": leftover,
        }
        report["passed"] = all(report["checks"].values())
    text = table(report)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report | {"table": text}, f, indent=1)
    sys.exit(0 if report["passed"] else 1)


def soak(server: Server, args) -> dict:
    s = Soak(server, os.path.basename(os.path.normpath(args.model)), args)
    start = time.monotonic()
    s.warm()
    warm_s = time.monotonic() - start
    log(f"[warm in {warm_s:.0f} s: {len(s.expected)} references]")
    samples = []

    def sample():
        usage = s.http.get("/health").json()["contexts"]
        samples.append(
            dict(
                t=round(time.monotonic() - start, 1),
                resident_mib=round(server.resident_mib(), 1),
                open_files=server.open_files(),
                requests=sum(s.count.values()),
                **{f"store_{k}": v for k, v in usage.items()},
            )
        )

    sample()
    until, budget = time.monotonic() + args.seconds, [args.max_requests]
    clients = [
        threading.Thread(target=s.client, args=(args.seed * 1000 + i, until, budget))
        for i in range(args.clients)
    ]
    for c in clients:
        c.start()
    while any(c.is_alive() for c in clients):
        for c in clients:
            c.join(args.sample / len(clients))
        if time.monotonic() - start - samples[-1]["t"] >= args.sample:
            sample()
    sample()
    first, last = samples[0], samples[-1]
    settled = next((x for x in samples if x["t"] - first["t"] >= args.seconds / 4), last)
    checks = {
        "no errors": not s.errors,
        "resident memory within 10%": last["resident_mib"] <= 1.10 * settled["resident_mib"],
        "open files flat": last["open_files"] <= first["open_files"] + args.clients,
        "store within its limit": all(
            x["store_memory_bytes"] <= x["store_memory_limit"] for x in samples
        ),
    }
    all_latency = [t for ts in s.latency.values() for t in ts]
    return dict(
        model=args.model,
        seconds=args.seconds,
        clients=args.clients,
        settled_sample=samples.index(settled),
        warm_s=round(warm_s, 1),
        requests=dict(s.count),
        errors=dict(s.errors),
        failed=dict(s.failed),
        error_examples=s.examples,
        latency_s={
            k: dict(p50=float(np.percentile(v, 50)), p99=float(np.percentile(v, 99)), n=len(v))
            for k, v in sorted(s.latency.items())
        },
        p99_s=float(np.percentile(all_latency, 99)) if all_latency else None,
        samples=samples,
        checks=checks,
        passed=all(checks.values()),
    )


def table(r: dict) -> str:
    first, last = r["samples"][0], r["samples"][-1]
    settled = r["samples"][r["settled_sample"]]
    lines = [
        f"{r['model']}, {r['clients']} clients for {r['seconds']:g} s (after a warm-up of "
        f"{r['warm_s']:g} s)",
        "",
        "| kind | requests | errors | p50 s | p99 s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for kind, n in sorted(r["requests"].items()):
        lat = r["latency_s"].get(kind, {})
        errors = r["failed"].get(kind, 0)
        lines.append(
            f"| {kind} | {n} | {errors} | {lat.get('p50', float('nan')):.2f} | "
            f"{lat.get('p99', float('nan')):.2f} |"
        )
    lines += [
        f"| all | {sum(r['requests'].values())} | {sum(r['errors'].values())} | | "
        f"{r['p99_s'] or float('nan'):.2f} |",
        "",
        f"errors by kind: {r['errors'] or 'none'}",
        f"resident memory: {first['resident_mib']:.0f} MiB after warm-up, "
        f"{settled['resident_mib']:.0f} MiB a quarter into the run, "
        f"{last['resident_mib']:.0f} MiB at the end "
        f"({last['resident_mib'] / settled['resident_mib'] - 1:+.1%})",
        f"open files: {first['open_files']} after warm-up, {last['open_files']} at the end",
        f"context store in memory: at most "
        f"{max(x['store_memory_bytes'] for x in r['samples']) / 2**20:.1f} of "
        f"{last['store_memory_limit'] / 2**20:.2f} MiB; read back from disk "
        f"{last['store_loads_from_disk']} times",
        f"SIGTERM: exit {r['exit code on SIGTERM']}; leftover temporaries: "
        f"{r['leftover files in the contexts directory'] or 'none'}",
        "",
        "checks: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in r["checks"].items()),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
