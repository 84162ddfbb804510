"""Load test of serving compressed contexts: compress each document once, answer many questions.

Run from the repository root (about 15 minutes on the 2-core development CPU):

    .venv/bin/python benchmarks/serve_contexts.py --out docs/results/serve/contexts
    .venv/bin/python benchmarks/serve_contexts.py --docs 2 --questions 16 --clients 8  # quick

1. Documents: ``--docs`` documents of about ``--tokens`` tokens of real English prose
   (``kvjax.eval.haystack``'s pydoc sentences), each holding ``NEEDLES`` needles ("The special magic
   number for NAME is NUMBER."); ``--questions`` questions in all ask for them, spread over the
   documents.
2. One server in this process (``kvjax.serving.server`` over loopback) with two engines of
   ``--slots`` slots each (the same count on both sides unless ``--context-slots`` says otherwise):
   the ordinary route (a full cache) and the contexts' (``kvzip`` at ``--budget`` by default).
3. Contexts: each document is posted once to ``/v1/contexts`` (timed), then ``--clients`` clients of
   the official ``openai`` client ask every question with its ``context_id`` (``extra_body``).
   Every answer must equal ``kvjax.decode(params, context, question_ids, evict=False)`` of the
   stored context alone.
4. Whole documents: the same clients ask the same questions through the ordinary route, each
   request carrying its whole document (the same tokens as the context, uncompressed).
5. The table: throughput (questions per second of the phase's wall time; for contexts also with
   the compressions counted), p50 / p99 latency per question, needle accuracy (the number in the
   answer as a whole number, ``kvjax.eval.niah.score``), and the cache memory of one active request
   (a slot's share of its engine's cache). With ``--out``, the table and the raw output (every
   question's answer, its seconds and score, each compression) are written there.

No request starts after ``--time-cap`` seconds from the start of a phase (those count as not
answered). The Markdown table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai

import kvjax
from kvjax.eval.haystack import sentences
from kvjax.eval.niah import score
from kvjax.loading import chat_parts
from kvjax.runtime.options import eviction_from, with_tokenizer
from kvjax.serving import Driver, Engine
from kvjax.serving.contexts import ContextService, ContextStore
from kvjax.serving.server import ServerThread, create_app

MODEL = "smollm2-135m-instruct"
NEEDLES = 8
NAMES = [
    "Amber Falcon",
    "Silent River",
    "Copper Lantern",
    "Velvet Orchard",
    "Hollow Summit",
    "Crimson Harbor",
    "Quiet Meadow",
    "Iron Willow",
]
ASKS = [
    "What is the special magic number for {name}?",
    "Which number is the special magic number for {name}? Answer with the number only.",
]
TARGET = 5.0  # contexts over whole documents, in throughput and in memory per active request


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_documents(tokenizer, n: int, tokens: int) -> list[tuple[str, dict[str, str]]]:
    """``n`` documents of about ``tokens`` tokens, each with its needles' numbers by name."""
    prose, rng, docs, at = sentences("pydoc"), np.random.default_rng(0), [], 0
    for _ in range(n):
        chosen = []
        while len(tokenizer(" ".join(chosen))["input_ids"]) < tokens - 20 * NEEDLES:
            chosen.append(prose[at % len(prose)])
            at += 1
        numbers = {name: str(rng.integers(1_000_000, 9_999_999)) for name in NAMES[:NEEDLES]}
        places = sorted(rng.choice(len(chosen), NEEDLES, replace=False), reverse=True)
        for place, (name, number) in zip(places, numbers.items(), strict=True):
            chosen.insert(int(place), f"The special magic number for {name} is {number}.")
        docs.append((" ".join(chosen), numbers))
    return docs


def make_questions(docs, n: int) -> list[tuple[int, str, str]]:
    """``n`` (document, question, expected number) triples, over the documents in turn."""
    out = []
    for i in range(n):
        doc = i % len(docs)
        name = NAMES[(i // len(docs)) % NEEDLES]
        ask = ASKS[(i // (len(docs) * NEEDLES)) % len(ASKS)]
        out.append((doc, ask.format(name=name), docs[doc][1][name]))
    return out


def cache_bytes_per_slot(engine: Engine) -> int:
    """One slot's cache in bytes (``Engine.cache_bytes``: what ``--kv-memory`` counts)."""
    return engine.cache_bytes(1)


def run_phase(clients: int, jobs: list, ask, time_cap: float) -> tuple[list, float]:
    """Run ``ask(job)`` for every job from ``clients`` threads; returns (answer or None, seconds)
    per job and the wall time. No job starts after ``time_cap`` seconds."""
    start = time.perf_counter()

    def one(job):
        began = time.perf_counter()
        if began - start > time_cap:
            return None, None
        answer = ask(job)
        return answer, time.perf_counter() - began

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, jobs))
    return results, time.perf_counter() - start


def summary(name, results, wall, extra_seconds, expected, memory) -> dict:
    done = [(a, s) for a, s in results if a is not None]
    seconds = np.array([s for _, s in done]) if done else np.zeros(1)
    correct = sum(
        score(a, (e,)) for (a, _), e in zip(results, expected, strict=True) if a is not None
    )
    return dict(
        route=name,
        answered=len(done),
        of=len(results),
        wall=wall,
        qps=len(done) / wall,
        qps_all=len(done) / (wall + extra_seconds),
        p50=float(np.percentile(seconds, 50)),
        p99=float(np.percentile(seconds, 99)),
        accuracy=correct / max(len(done), 1),
        memory=memory,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=4, help="2 or more")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per document (about)")
    p.add_argument("--questions", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--scorer", default="kvzip")
    p.add_argument("--slots", type=int, default=16, help="slots of each route")
    p.add_argument("--context-slots", type=int, help="slots of contexts (default: --slots)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--time-cap", type=float, default=900.0, help="seconds per phase")
    p.add_argument("--out", help="a directory for table.md and raw.json")
    args = p.parse_args()
    args.context_slots = args.context_slots or args.slots

    params = kvjax.load(MODEL)
    tokenizer = kvjax.load_tokenizer(MODEL)
    docs = make_documents(tokenizer, args.docs, args.tokens)
    questions = make_questions(docs, args.questions)
    defaults = {"budget": args.budget, "scorer": args.scorer}
    template = eviction_from(**with_tokenizer(tokenizer, **defaults))
    longest = max(
        len(kvjax.chat_tokens(tokenizer, d + "\n\n" + q))
        for d, _ in docs
        for q in {q for _, q, _ in questions}
    )
    whole = Engine(params, slots=args.slots, max_prompt=longest, max_new_tokens=args.max_tokens)
    contexts = Engine(
        params,
        slots=args.context_slots,
        max_prompt=64,
        max_new_tokens=args.max_tokens,
        contexts=template,
    )
    log("warming up: prompt chunks and decoding of both routes")
    whole.warmup()
    contexts.warmup()
    with tempfile.TemporaryDirectory() as root:
        store = ContextStore(params, root, 1 << 32)
        service = ContextService(store, Driver(contexts).start(), tokenizer, defaults)
        driver = Driver(whole, queue_size=args.questions).start()
        server = ServerThread(create_app(driver, "smollm2", tokenizer, service)).start()
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=args.time_cap
        )
        try:
            ids, made_cards = [None] * len(docs), [None] * len(docs)

            def post(i):
                made = httpx.post(
                    server.url + "/v1/contexts",
                    timeout=args.time_cap,
                    json={"model": "smollm2", "document": docs[i][0]},
                )
                made.raise_for_status()
                ids[i], made_cards[i] = made.json()["id"], made.json()
                log(
                    f"  {made.json()['tokens']} tokens -> {made.json()['kept_slots']} slots in "
                    f"{made.json()['seconds']:.1f}s"
                )
                return made.json()["seconds"]

            def ask_context(job):
                doc, question, _ = job
                return (
                    client.chat.completions.create(
                        model="smollm2",
                        temperature=0,
                        max_tokens=args.max_tokens,
                        messages=[{"role": "user", "content": question}],
                        extra_body={"context_id": ids[doc]},
                    )
                    .choices[0]
                    .message.content
                )

            def ask_whole(job):
                doc, question, _ = job
                return (
                    client.chat.completions.create(
                        model="smollm2",
                        temperature=0,
                        max_tokens=args.max_tokens,
                        messages=[{"role": "user", "content": docs[doc][0] + "\n\n" + question}],
                    )
                    .choices[0]
                    .message.content
                )

            log(f"compressing {len(docs)} documents ({args.scorer}, budget {args.budget})")
            compress = post(0)
            # What a compression costs the running slots: the same 8 questions on the first
            # document from 4 clients, alone and while the second document is compressed.
            probe = [(0, q, e) for d, q, e in questions if d == 0][:4] * 2
            run_phase(4, probe, ask_context, args.time_cap)  # compiles fitting the contexts
            _, quiet = run_phase(4, probe, ask_context, args.time_cap)
            with ThreadPoolExecutor(1) as pool:
                second = pool.submit(post, 1)
                time.sleep(1.0)  # the compression is under way
                _, busy = run_phase(4, probe, ask_context, args.time_cap)
                compress += second.result()
            for i in range(2, len(docs)):
                compress += post(i)

            log(f"contexts: {len(questions)} questions from {args.clients} clients")
            on_contexts, wall_c = run_phase(args.clients, questions, ask_context, args.time_cap)
            log("checking every answer against kvjax.decode of its context alone")
            mismatches = 0
            for (doc, question, _), (answer, _) in zip(questions, on_contexts, strict=True):
                if answer is None:
                    continue
                q_ids = chat_parts(tokenizer, "", question)[1]
                alone = kvjax.decode(
                    params, store.get(ids[doc]), q_ids, args.max_tokens, evict=False
                )
                mismatches += answer != tokenizer.decode(alone, skip_special_tokens=True)
            log(f"whole documents: {len(questions)} questions from {args.clients} clients")
            on_whole, wall_w = run_phase(args.clients, questions, ask_whole, args.time_cap)
        finally:
            server.stop()
            service.close()
            service.driver.stop()
            driver.stop()
    expected = [e for _, _, e in questions]
    rows = [
        summary(
            "contexts", on_contexts, wall_c, compress, expected, cache_bytes_per_slot(contexts)
        ),
        summary("whole documents", on_whole, wall_w, 0.0, expected, cache_bytes_per_slot(whole)),
    ]
    c, w = rows
    lines = [
        f"{args.docs} documents of about {args.tokens} tokens, {args.questions} questions from "
        f"{args.clients} clients, SmolLM2-135M float32 on this machine; contexts compressed by "
        f"{args.scorer} at budget {args.budget} ({compress:.1f} s for all), "
        f"{args.context_slots} context slots; the ordinary route: a full cache, "
        f"{args.slots} slots.",
        "",
        "| route | answered | questions/s | questions/s, compression included | p50 s | p99 s "
        "| needle accuracy | cache MiB per active request |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['route']} | {r['answered']}/{r['of']} | {r['qps']:.2f} | {r['qps_all']:.2f} "
            f"| {r['p50']:.2f} | {r['p99']:.2f} | {r['accuracy']:.0%} "
            f"| {r['memory'] / 2**20:.1f} |"
        )
    speed, memory = c["qps"] / w["qps"], w["memory"] / c["memory"]
    lines += [
        "",
        f"While a document is compressed, {len(probe)} questions on another context take "
        f"{busy:.1f} s instead of {quiet:.1f} s ({busy / quiet:.1f}×).",
        "",
        f"Contexts over whole documents: {speed:.1f}× the throughput "
        f"({c['qps_all'] / w['qps']:.1f}× with the compressions counted), {memory:.1f}× less cache "
        f"memory per active request (target {TARGET:.0f}× each); answers differing from "
        f"kvjax.decode alone: {mismatches} of {c['answered']}.",
    ]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text + "\n")
        answers = [
            dict(route=route, doc=doc, question=q, expected=e, answer=a, seconds=sec,
                 score=None if a is None else score(a, (e,)))
            for route, results in (("contexts", on_contexts), ("whole documents", on_whole))
            for (doc, q, e), (a, sec) in zip(questions, results, strict=True)
        ]  # fmt: skip
        raw = dict(
            args=vars(args),
            compressions=made_cards,
            probe=dict(quiet_s=quiet, busy_s=busy, questions=len(probe)),
            rows=rows,
            mismatches=mismatches,
            answers=answers,
        )
        with open(os.path.join(args.out, "raw.json"), "w") as f:
            json.dump(raw, f, indent=1)
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
