"""Part "server": ``kvjax serve`` on the card (random weights of Llama-3.1-8B's shapes, bfloat16)
driven over HTTP by ``benchmarks/serve_bench.py`` (vLLM's benchmark_serving: TTFT, TPOT, ITL,
throughput), one server per case; this process only starts processes and reads their files, so each
server has the whole card.

- ``busy``: 32 slots, SnapKV 256, 128 requests of 1K-token prompts and 512 new tokens, all at once;
  its output throughput against the raw batch-32 decode of the same cache measured in the same call
  (``raw``: the engine's ``generate`` over 32 full slots, in a process of its own; its block-wise
  prefill rate too), and p99 ITL against its median;
- ``call4b``: call 4b's workload, 1K in and 128 out, the same way;
- ``long-full`` and ``long-snapkv``: 32K-token prompts, the full cache and SnapKV 1024, each server
  given the same cache memory (``--kv-memory``, so the slots follow), the same requests all at once:
  slots held, output throughput, p99 TPOT;
- ``documents``: 4 documents of 32K tokens compressed once (``/v1/contexts``, KVzip at 1024) and
  questions with ``context_id``, against the same questions sent with their whole documents to the
  full-cache slots of the same server (``documents-whole``).

The image lacks fastapi, uvicorn and pydantic: ``benchmarks/gpu/wheels.sh`` downloads them here into
``.whl``, which the call carries and ``device.sh`` installs. ``--smoke``: every case on the CPU with
``random:tiny`` and small loads.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from common import Deadline, Results, error_text, log

ROOT = Path(__file__).resolve().parents[2]
PORT = 8731


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    server: tuple[str, ...]  # kvjax serve's flags beside the model's
    bench: tuple[str, ...]  # serve_bench's flags beside the server's
    # (slots, budget, prompt) of the raw decode it is compared with
    raw: tuple[int, int, int] | None = None


def cases(smoke: bool) -> tuple[str, str, list[Case]]:
    """(model, dtype, cases)."""
    if smoke:
        model, dtype, n, prompt, long, memory = "random:tiny", "float32", 8, 96, 640, "64MiB"
        slots, out, docs = (
            4,
            16,
            ("--num-documents", "2", "--document-len", "400", "--num-prompts", "8"),
        )
    else:
        model, dtype, n, prompt, long, memory = (
            "random:llama-3.1-8b",
            "bfloat16",
            128,
            1024,
            32768,
            "60GiB",
        )
        slots, out, docs = (
            32,
            512,
            ("--num-documents", "4", "--document-len", "32000", "--num-prompts", "64"),
        )
    common = ("--backend", "openai", "--ignore-eos", "--random-range-ratio", "0")
    snap = ("--budget", str(48 if smoke else 256), "--scorer", "snapkv")
    shaped = lambda p, o: ("--max-prompt", str(p), "--max-tokens", str(o))  # noqa: E731
    run = []
    for name, new in (("busy", out), ("call4b", out // 4)):
        run.append(
            Case(
                name,
                ("--slots", str(slots), *shaped(prompt, new), *snap),
                (
                    *common,
                    "--random-input-len",
                    str(prompt),
                    "--random-output-len",
                    str(new),
                    "--num-prompts",
                    str(n),
                ),
                raw=(slots, int(snap[1]), prompt),
            )
        )
    long_new, long_n = (16, 8) if smoke else (512, 48)
    for name, budget in (
        ("long-full", ()),
        ("long-snapkv", ("--budget", str(64 if smoke else 1024), "--scorer", "snapkv")),
    ):
        run.append(
            Case(
                name,
                ("--kv-memory", memory, *shaped(long, long_new), *budget),
                (
                    *common,
                    "--random-input-len",
                    str(long),
                    "--random-output-len",
                    str(long_new),
                    "--num-prompts",
                    str(long_n),
                ),
            )
        )
    contexts = (
        "--kv-memory",
        memory,
        *shaped(long, 64),
        "--context-slots",
        str(slots),
        "--context-budget",
        str(64 if smoke else 1024),
        "--context-max-prompt",
        "128",
    )
    for route in ("contexts", "whole"):
        run.append(
            Case(
                f"documents-{route}" if route == "whole" else "documents",
                contexts,
                (
                    *common,
                    "--dataset-name",
                    "documents",
                    "--document-route",
                    route,
                    *docs,
                    "--random-output-len",
                    "64",
                ),
            )
        )
    return model, dtype, run


def serve_case(out: Path, model: str, dtype: str, case: Case, deadline: Deadline) -> dict:
    """Start the server, run the benchmark against it, stop the server: the benchmark's result and
    the server's capacity line."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve_bench

    from kvjax.serving.launch import ServeProcess  # httpx: the serving extra's

    log_path = out / "server" / f"{case.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args = ["--model", model, "--dtype", dtype, "--log-level", "warning", *case.server]
    with (
        open(log_path, "w") as logf,
        ServeProcess(
            args, timeout=max(deadline.left(), 1.0), cwd=ROOT, stdout=logf, port=PORT
        ) as server,
    ):
        url, ready_s = server.url, server.ready_s
        code = serve_bench.main(
            [
                "--base-url",
                url,
                "--model",
                model,
                *case.bench,
                "--save-result",
                "--result-dir",
                str(out / "server"),
                "--result-filename",
                f"{case.name}.json",
                "--label",
                "random weights",
                "--time-limit",
                str(max(deadline.left(), 30)),
            ]
        )
        result = json.loads((out / "server" / f"{case.name}.json").read_text())
    capacity = next(
        (line for line in log_path.read_text().splitlines() if "slots, each keeping" in line), ""
    )
    keep = (
        "completed",
        "failed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "context_seconds",
    )
    return {
        "exit": code,
        "ready_s": ready_s,
        "capacity": capacity.strip("[]"),
        **{k: result[k] for k in keep if k in result},
    }


def raw_decode(
    out: Path, model: str, dtype: str, raw: tuple[int, int, int], deadline: Deadline
) -> dict:
    """The raw decode rate of ``raw`` = (slots, budget, prompt), in a process of its own (--raw)."""
    cmd = [sys.executable, __file__, "--raw", model, dtype, *map(str, raw)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=max(deadline.left(), 30), cwd=ROOT
    )
    if done.returncode:
        raise RuntimeError(f"raw decode: exit {done.returncode}: {done.stderr[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_raw(model: str, dtype: str, slots: int, budget: int, prompt: int) -> dict:
    """Every slot of an engine (SnapKV ``budget``) filled with a ``prompt``-token prompt
    (block-wise, through the engine's prompt rows: their rate is the prefill's bound), then its
    ``generate`` timed over full slots."""
    import jax
    import numpy as np

    import kvjax
    from kvjax.serving import Engine

    params = kvjax.load(model, dtype=dtype)
    engine = Engine(
        params,
        slots=slots,
        max_prompt=prompt,
        max_new_tokens=1024,
        steps=8,
        budget=budget,
        scorer="snapkv",
    )
    engine.warmup()
    state, filling = engine.init_state()
    inputs = engine.inputs(
        np.arange(prompt, dtype=np.int32) % 1000 + 10, max_new_tokens=1024, stop_ids=()
    )
    fill_s = 0.0
    for slot in range(slots):
        rows, fed = [None] * engine.prefill_rows, 0
        filling = engine.begin(filling, 0)
        while fed < prompt:
            rows[0] = (inputs, fed)
            chunk = engine.chunk(rows)
            start = time.perf_counter()
            filling, logits = engine.fill(filling, chunk)
            jax.block_until_ready(logits)
            fill_s += time.perf_counter() - start
            fed += int(chunk.n[0])
        state = engine.promote(filling, 0, logits, state, slot, inputs)
    state, _ = engine.generate(state)  # compiled at warm-up; one call to settle
    jax.block_until_ready(state.logits)
    calls, start = 8, time.perf_counter()
    for _ in range(calls):
        state, tokens = engine.generate(state)
    jax.block_until_ready(tokens)
    seconds = time.perf_counter() - start
    return {
        "decode_tokens_per_s": slots * engine.steps * calls / seconds,
        "prefill_tokens_per_s": slots * prompt / fill_s,
        "prompt_rows": engine.prefill_rows,
    }


def run(results: Results, deadline: Deadline, out: Path, smoke: bool) -> None:
    model, dtype, todo = cases(smoke)
    raw_rates = {}
    for case in todo:
        label = {"case": case.name, "model": f"{model} (random weights)"}
        if deadline.passed():
            results.add("server", {**label, "error": "not run: the part's deadline passed"})
            continue
        log(f"server: {case.name}")
        row = dict(label)
        try:
            if case.raw is not None:
                if case.raw not in raw_rates:
                    raw_rates[case.raw] = raw_decode(out, model, dtype, case.raw, deadline)
                row |= {f"raw_{k}": v for k, v in raw_rates[case.raw].items()}
            row |= serve_case(out, model, dtype, case, deadline)
        except Exception as e:  # noqa: BLE001 - reported as the case's row
            log(f"server {case.name}: FAILED {error_text(e, 300)}")
            row["error"] = error_text(e)
        results.add("server", row)


def tables(results: Results) -> list[str]:
    rows = results.rows("server")
    if not rows:
        return []
    lines = [
        "### Server over HTTP (serve_bench; random weights)",
        "",
        "| case | capacity | completed | out tok/s | vs raw decode | ITL p50 / p99 ms | TPOT p99 "
        "ms | "
        "TTFT p50 ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['error'][:200]} | | | | | | |")
            continue
        raw = r.get("raw_decode_tokens_per_s")
        vs = f"{r['output_throughput'] / raw:.0%} of {raw:.0f}" if raw else ""
        lines.append(
            f"| {r['case']} | {r['capacity'][:90]} | {r['completed']} | "
            f"{r['output_throughput']:.0f} | "
            f"{vs} | {r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {r['p99_tpot_ms']:.1f} | "
            f"{r['median_ttft_ms']:.0f} |"
        )
    return lines + [""]


if __name__ == "__main__" and sys.argv[1:2] == ["--raw"]:
    name, dt, *numbers = sys.argv[2:]
    print(json.dumps(measure_raw(name, dt, *map(int, numbers))))
