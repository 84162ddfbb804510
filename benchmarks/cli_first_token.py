"""Wall time from starting the CLI to its first answer token, cold and warm persistent compilation
cache.

    .venv/bin/python benchmarks/cli_first_token.py            # about 2 minutes on 2 cores

Runs ``python -m kvjax generate`` (SmolLM2, already converted) as a fresh process: first with an
empty compilation cache directory (every program compiled), then ``--repeats`` times with the cache
it filled (``KVJAX_COMPILATION_CACHE``; ``kvjax.runtime.compilation_cache``), and once with the
cache off. Reports the seconds until the first byte of the answer reaches stdout and until the
process exits.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

COMMAND = [
    sys.executable,
    "-m",
    "kvjax",
    "generate",
    "--chat",
    "What is the capital of France?",
    "--max-new-tokens",
    "16",
]
SHOWN = ["python -m kvjax generate", "--chat ...", "--max-new-tokens 16"]  # COMMAND, as printed


def timed_run(cache: str, extra: list[str]) -> tuple[float, float]:
    """(seconds to the first stdout byte, seconds to exit) of one CLI run."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        COMMAND + extra,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, KVJAX_COMPILATION_CACHE=cache),
    )
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(COMMAND + extra)} failed")
    return first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2, help="warm runs (default: %(default)s)")
    parser.add_argument(
        "--eviction",
        nargs="*",
        default=["--budget", "64", "--scorer", "snapkv"],
        help="eviction options passed to the CLI (default: %(default)s)",
    )
    args = parser.parse_args()
    print(
        f"`{' '.join(SHOWN + args.eviction)}`, "
        "SmolLM2-135M-Instruct (converted checkpoint present)\n"
    )
    print("| compilation cache | first token s | exit s |")
    print("| --- | ---: | ---: |")
    with tempfile.TemporaryDirectory() as cache:
        rows = [
            ("off", timed_run("off", args.eviction)),
            ("cold (empty)", timed_run(cache, args.eviction)),
        ]
        rows += [
            (f"warm, run {i + 1}", timed_run(cache, args.eviction)) for i in range(args.repeats)
        ]
    for name, (first, total) in rows:
        print(f"| {name} | {first:.1f} | {total:.1f} |", flush=True)


if __name__ == "__main__":
    main()
