"""kvjax on one GPU, in one call: every Pallas GPU kernel checked and timed, an 8B-shaped Llama's
prefill and decode against its memory floor, transformers and kvpress on the same card, and the
serving engine.

    python benchmarks/gpu/run.py --out $OUT  # on the device (bash benchmarks/gpu/device.sh)
    # every part on CPU, tiny shapes, under 2 minutes
    python benchmarks/gpu/run.py --smoke --out /tmp/gpu-smoke
    python benchmarks/gpu/run.py --parts kernels --seconds 200 --out $OUT

Parts, each in a process of its own (so that each has the whole card, and a crash ends only its
part): kernels (``kernels_part``), layers (one decode step of the layers, five ways: where its bytes
go, ``layers_part``), model (prefill and decode, ``model_part``; also measures the copy and the
read bandwidth and the bf16 matrix rate), serve (the engine's continuous batching, ``serve_part``),
server (``kvjax serve`` over HTTP against ``benchmarks/serve_bench.py``, ``server_part``), peer
(``peer_transformers``: eager, then compiled), kvpress (``peer_kvpress``: KVzip's and Expected
Attention's compression of a context). The two peers run under ``--peer-python`` (default: this
interpreter; it needs torch and transformers, and kvpress for its part) and write
``OUT/parts/<part>.json`` themselves. ``--seconds`` is the whole run's budget: each part gets a
share of what is left when it starts, stops starting new measurements at its deadline and is killed
60 s after it.
Every measurement is a row in ``OUT/parts/<part>.json`` (written as it is made, so a run cut short
keeps what it measured; a failure is a row naming its error); at the end ``OUT/results.json`` merges
them and ``OUT/results.md`` holds the tables, printed last (``report.py`` combines several runs). A
failed measurement's row holds its error's type and message; ``KVJAX_GPU_TRACEBACKS=1`` also prints
the traceback. Notes on method and on what was seen: NOTES.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = ("kernels", "layers", "model", "serve", "server", "peer", "kvpress")
# of the time left when the part starts (the last part named gets all of it)
SHARES = {
    "kernels": 0.32,
    "layers": 0.25,
    "model": 0.6,
    "serve": 0.4,
    "server": 0.8,
    "peer": 0.75,
    "kvpress": 1.0,
}
# the parts run by a script of their own, under --peer-python (torch, not JAX)
PEERS = {"peer": "peer_transformers.py", "kvpress": "peer_kvpress.py"}
GRACE_S = 60


def parse(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for results.json, results.md, parts/"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument(
        "--seconds",
        type=float,
        help="budget of the whole run (default 420; 900 with --smoke, "
        "where a loaded CPU slows the interpreter: the budget bounds, the work decides)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (the Pallas interpreter)"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="compile threads (default: CPU count - 2)"
    )
    parser.add_argument(
        "--no-kernel-timings", action="store_true", help="kernels: the checks alone"
    )
    parser.add_argument(
        "--f32-precision",
        choices=["highest"],
        help="kernels: trace the float32 kernels' checks "
        "under this matmul precision (default: JAX's, TF32 dots in Triton)",
    )
    parser.add_argument(
        "--kernel-ops", help="kernels: check only these ops, comma-separated (default: all)"
    )
    parser.add_argument(
        "--peer-python",
        default=os.environ.get("KVJAX_PEER_PYTHON", sys.executable),
        help="the interpreter of the peer and kvpress parts "
        "(default: $KVJAX_PEER_PYTHON, else this one)",
    )
    parser.add_argument("--part", help=argparse.SUPPRESS)  # run one part in this process
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (900.0 if args.smoke else 420.0)
    args.parts = [p for p in args.parts.split(",") if p]
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}")
    if args.kernel_ops:
        args.kernel_ops = tuple(args.kernel_ops.split(","))
        if not args.part:  # checked once, in the parent
            sys.path.insert(0, str(HERE))
            from kernels_part import OPS, PROMPT

            if unknown := set(args.kernel_ops) - {*OPS, PROMPT}:
                parser.error(
                    f"--kernel-ops: unknown {sorted(unknown)}; choose from {[*OPS, PROMPT]}"
                )
    return args


def run_part(args) -> int:
    """One part, in this process."""
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # starts servers: this process must leave the card to them (no JAX device)
    if args.part == "server":
        import server_part
        from common import Deadline, Results

        deadline = Deadline(args.seconds)
        meta = {
            "part": "server",
            "smoke": args.smoke,
            "device": "the servers' own (their logs: server/)",
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        results = Results(args.out / "parts" / "server.json", meta)
        server_part.run(results, deadline, args.out, args.smoke)
        meta["seconds"] = args.seconds - deadline.left()
        results.save()
        return 0
    import jax
    from common import (
        Compiler,
        Deadline,
        Results,
        device_text,
        log,
        measure_ceilings,
        memory_stats,
    )

    deadline = Deadline(args.seconds)
    meta = {
        "part": args.part,
        "device": device_text(),
        "jax": jax.__version__,
        "smoke": args.smoke,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    results = Results(args.out / "parts" / f"{args.part}.json", meta)
    compiler = Compiler(args.workers or max(2, (os.cpu_count() or 2) - 2))
    log(f"part {args.part} on {meta['device']}, jax {jax.__version__}, {deadline.left():.0f} s")
    try:
        if args.part == "kernels":
            import kernels_part

            kernels_part.run(
                results,
                deadline,
                compiler,
                args.smoke,
                timings=not args.no_kernel_timings,
                f32_precision=args.f32_precision,
                ops=args.kernel_ops,
            )
        elif args.part == "layers":
            import layers_part

            layers_part.run(results, deadline, compiler, args.smoke)
        elif args.part == "model":
            import model_part

            ceilings = measure_ceilings(args.smoke)
            meta["ceilings"] = ceilings.__dict__
            log(
                f"copy {ceilings.copy_gb_s:.0f} GB/s (read + written), "
                f"read {ceilings.read_gb_s:.0f} GB/s, "
                f"bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s"
            )
            model_part.run(results, deadline, compiler, ceilings, args.smoke)
        elif args.part == "serve":
            import model_part
            import serve_part

            model = model_part.ModelRun(results, deadline, compiler, None, args.smoke)
            serve_part.run(results, deadline, model, args.smoke)
        meta["memory_end"] = memory_stats()
        meta["seconds"] = args.seconds - deadline.left()
        results.save()
    finally:
        compiler.close()
    return 0


def run_peer(args, part: str, seconds: float) -> None:
    """A peer's script under ``--peer-python``: it stops starting rows at ``seconds`` and writes its
    object to ``OUT/parts/<part>.json`` after every row, so that a run killed GRACE_S after its
    deadline keeps its rows; an exit status, a kill or no file at all is added as its "error"."""
    path = args.out / "parts" / f"{part}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    cmd = [
        args.peer_python,
        str(HERE / PEERS[part]),
        "--seconds",
        f"{seconds:.0f}",
        "--out",
        str(path),
    ] + (["--smoke"] if args.smoke else [])
    error = None
    try:
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, timeout=seconds + GRACE_S)
        if done.returncode:
            error = f"exit status {done.returncode}"
    except subprocess.TimeoutExpired:
        error = f"killed {GRACE_S} s after its deadline of {seconds:.0f} s"
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        data, error = {}, error or f"no results: {type(e).__name__}: {e}"
    if error:
        data["error"] = error
        print(f"[run] {part}: {error}", file=sys.stderr, flush=True)
    path.write_text(json.dumps(data, indent=1))


def main(argv=None) -> int:
    args = parse(argv)
    if args.part:
        return run_part(args)
    args.out.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + args.seconds
    env = dict(os.environ)
    env.setdefault(
        "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94"
    )  # the largest-batch runs size themselves to the card
    for part in args.parts:
        left = end - time.monotonic()
        if left <= 5:
            print(f"[run] {part}: skipped, no time left", file=sys.stderr, flush=True)
            continue
        share = left * SHARES[part] if part != args.parts[-1] else left
        print(f"[run] {part}: {share:.0f} s of {left:.0f} s left", file=sys.stderr, flush=True)
        if part in PEERS:
            run_peer(args, part, share)
            continue
        cmd = [
            sys.executable,
            __file__,
            "--part",
            part,
            "--seconds",
            str(share),
            "--out",
            str(args.out),
        ]
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--workers", str(args.workers)] if args.workers else []
        cmd += ["--no-kernel-timings"] if args.no_kernel_timings else []
        cmd += ["--f32-precision", args.f32_precision] if args.f32_precision else []
        cmd += ["--kernel-ops", ",".join(args.kernel_ops)] if args.kernel_ops else []
        try:
            status = subprocess.run(cmd, env=env, timeout=share + GRACE_S).returncode
        except subprocess.TimeoutExpired:
            status = "killed after its deadline"
        if status:
            print(f"[run] {part}: exit status {status}", file=sys.stderr, flush=True)
            record_crash(args.out, part, status)
    import report

    text = report.write(args.out)
    print(text)
    return 0


def record_crash(out: Path, part: str, status) -> None:
    """A part whose process died keeps its rows; the exit status is added to its meta."""
    path = out / "parts" / f"{part}.json"
    data = json.loads(path.read_text()) if path.exists() else {"meta": {"part": part}, "parts": {}}
    data["meta"]["exit"] = str(status)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
