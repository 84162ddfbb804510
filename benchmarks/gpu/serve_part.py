"""Part "serve": the serving engine (``kvjax.serving``: ``Engine`` and its continuous-batching
``Driver``, no HTTP) on the 8B-shaped model with a budget, 32 slots against one slot (one request at
a time).

Every request is a prompt of random ids, greedy, no stop id, a fixed number of new tokens; the
driver prefills each at batch 1 into a free slot between decode calls (4 steps per call). Throughput
is new tokens over the wall time from the first submit to the last token; a warm-up request per
engine compiles everything first.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from common import Deadline, Results, guarded, log
from model_part import ModelRun

from kvjax.serving.driver import Driver
from kvjax.serving.engine import Engine


@dataclasses.dataclass(frozen=True)
class Load:
    prompt: int
    new: int
    budget: int
    slots: int
    requests_many: int  # requests sent to the many-slot engine
    requests_one: int  # requests sent to the one-slot engine


def load(smoke: bool) -> Load:
    return Load(64, 8, 48, 4, 8, 2) if smoke else Load(1024, 128, 256, 32, 64, 8)


def serve(params, ld: Load, slots: int, n_requests: int, vocab: int) -> dict:
    engine = Engine(
        params,
        slots=slots,
        max_prompt=ld.prompt,
        max_new_tokens=ld.new,
        steps=4,
        budget=ld.budget,
        scorer="snapkv",
    )
    driver = Driver(engine, queue_size=n_requests + 1).start()
    rng = np.random.default_rng(slots)
    try:
        t0 = time.perf_counter()
        driver.submit(rng.integers(10, vocab - 10, ld.prompt).astype(np.int32), stop_ids=()).result(
            1200
        )
        warmup_s = time.perf_counter() - t0
        prompts = [
            rng.integers(10, vocab - 10, ld.prompt).astype(np.int32) for _ in range(n_requests)
        ]
        t0 = time.perf_counter()
        requests = [driver.submit(p, stop_ids=()) for p in prompts]
        latencies = []
        for r in requests:
            tokens = r.result(1200)
            latencies.append(time.perf_counter() - t0)
            if len(tokens) != ld.new:
                raise RuntimeError(f"a request got {len(tokens)} tokens, not {ld.new}")
        wall = time.perf_counter() - t0
    finally:
        driver.stop(60)
    return {
        "tokens_per_s": n_requests * ld.new / wall,
        "wall_s": wall,
        "requests": n_requests,
        "p50_latency_s": float(np.median(latencies)),
        "warmup_s": warmup_s,
        "decode_calls": driver.counts["steps"],
    }


def run(results: Results, deadline: Deadline, model: ModelRun, smoke: bool) -> None:
    ld = load(smoke)
    vocab = model.sz.cfg.vocab_size
    for slots, n in ((ld.slots, ld.requests_many), (1, ld.requests_one)):
        label = {
            "slots": slots,
            "prompt": ld.prompt,
            "new_tokens": ld.new,
            "budget": ld.budget,
            "scorer": "snapkv",
        }
        if deadline.passed():
            results.add("serve", {**label, "error": "not run: the part's deadline passed"})
            continue
        log(f"serve: {slots} slots, {n} requests")
        guarded(
            results,
            "serve",
            label,
            lambda slots=slots, n=n: serve(model.params, ld, slots, n, vocab),
        )
        jax.clear_caches()


def tables(results: Results) -> list[str]:
    rows = results.rows("serve")
    if not rows:
        return []
    lines = [
        "### Serving engine (continuous batching, no HTTP)",
        "",
        "| slots | requests | prompt | new tokens | budget | tokens/s | wall s | p50 latency s | "
        "vs one slot |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    one = next((r for r in rows if r["slots"] == 1 and "tokens_per_s" in r), None)
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['slots']} | | {r['prompt']} | {r['new_tokens']} | {r['budget']} | "
                f"{r['error'][:200]} "
                "| | | |"
            )
            continue
        ratio = f"{r['tokens_per_s'] / one['tokens_per_s']:.1f}x" if one else ""
        lines.append(
            f"| {r['slots']} | {r['requests']} | {r['prompt']} | {r['new_tokens']} | {r['budget']} "
            "| "
            f"{r['tokens_per_s']:.0f} | {r['wall_s']:.2f} | {r['p50_latency_s']:.2f} | {ratio} |"
        )
    return lines + [""]
