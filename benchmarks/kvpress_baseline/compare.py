"""kvjax and NVIDIA kvpress side by side on the same NIAH samples, the same SmolLM2 weights and
token budgets.

    bash benchmarks/kvpress_baseline/setup.sh          # once: kvpress in its own .venv
    .venv/bin/python benchmarks/kvpress_baseline/compare.py --samples 1 --out docs/results/kvpress
        # docs/results.md's run: 6 samples at 1K; kvpress's 144 answers took 51 minutes on 2
        # shared cores
    # a quick look
    .venv/bin/python benchmarks/kvpress_baseline/compare.py --budgets 128 --scorers tova

kvjax writes the samples (token ids) to ``samples.jsonl``; ``run_kvpress.py`` answers them inside
the kvpress environment; this script answers them with kvjax, scores both with the same exact match
and prints one table per setting: accuracy per budget for each pair of methods, and seconds per
answer. kvjax runs twice: with its paper defaults, and with options set to mirror kvpress's press
("matched"; see MATCHED). Results and tables go to ``--out`` (resumable: finished answers are not
redone).

Pairs (kvjax scorer / kvpress press; ``run_kvpress.py`` documents each press and how a budget maps
to its compression ratio): snapkv / snapkv, tova / tova, streamingllm / streamingllm, h2o /
observed_attention (the default ``--scorers``), and, opt-in with ``--scorers``, two head-adaptive
ones whose layer keeps n_kv_heads × budget in all, unevenly over its KV heads (kvpress's "fake"
eviction masks the evicted keys):

- kvzip / kvzip: KVzipPress, query-agnostic by construction (the context is scored by how much
  attention the model pays to it while repeating it after "Repeat the previous context exactly."; a
  key's score is its largest attention weight over the repeat queries and the query group), each
  layer's budget shared among its heads with no floor (``layerwise=True``;
  ``run_kvpress.py --presses kvzip_global`` has kvpress's default, one threshold over all layers).
  It costs a second pass over the context plus an eager attention per layer: 3–5 times SnapKV's
  seconds per answer on CPU.
- adakv+snapkv / adakv_snapkv: AdaKVPress around SnapKVPress, alpha_safeguard 0.2 (every head keeps
  at least a fifth of the budget: its top scores, i.e. SnapKV's protected window first).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import kvjax  # noqa: E402
from kvjax.eval import sweep  # noqa: E402
from kvjax.eval.cli import RELIABLE  # noqa: E402
from kvjax.eval.niah import TASKS, make_samples, score  # noqa: E402

# kvjax scorer <-> kvpress press, and the kvjax options that mirror the press's own defaults.
PAIRS = {
    "snapkv": "snapkv",
    "tova": "tova",
    "streamingllm": "streamingllm",
    "h2o": "observed_attention",
    "kvzip": "kvzip",
    "adakv+snapkv": "adakv_snapkv",
}
DEFAULT_SCORERS = (
    "h2o",
    "snapkv",
    "streamingllm",
    "tova",
)  # docs/results.md's run; the others are opt-in
MATCHED = {
    # kvpress SnapKVPress: window 64 (scoring queries, always kept), avg-pool kernel 5, no sinks,
    # group mean.
    "snapkv": dict(n_sink=0, obs_window=64, window=64, pool="avg", kernel=5),
    # kvpress TOVAPress: the last token's attention averaged over all heads of the layer (the same
    # tokens kept in every KV head), last token kept.
    "tova": dict(n_sink=0, window=1, aggregate="layer"),
    # kvpress StreamingLLMPress: 4 sinks and the most recent tokens (kvjax's defaults).
    "streamingllm": dict(n_sink=4),
    # kvpress ObservedAttentionPress: attention averaged over the queries that see a token; nothing
    # protected.
    "h2o": dict(n_sink=0, window=0),
    # kvpress KVzipPress(layerwise=True): kvjax's defaults (its repeat prompt, 4 sinks in the
    # softmax and never evicted, the chat template's head unscored, no recent window, each layer's
    # n_kv_heads × budget shared among its KV heads with no floor); tests/test_kvzip_kvpress.py
    # checks the kept positions against kvpress's.
    "kvzip": dict(repeat="kvpress", n_sink=4, window=0, allocation="adakv", floor=0.0),
    # kvpress AdaKVPress(SnapKVPress, alpha_safeguard=0.2): SnapKV as above inside; every head keeps
    # at least int(0.2 × budget) (its highest scores, the window included: floor_mode="kvpress").
    "adakv+snapkv": dict(
        n_sink=0, obs_window=64, window=64, pool="avg", kernel=5, floor=0.2, floor_mode="kvpress"
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument(
        "--samples", type=int, default=1, help="per task and haystack (needle depths spread)"
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=TASKS,
        default=RELIABLE["tasks"],
        help="default: the tasks SmolLM2 answers with the full cache",
    )
    parser.add_argument(
        "--scorers",
        nargs="+",
        choices=sorted(PAIRS),
        default=list(DEFAULT_SCORERS),
        help="kvjax scorers, each run against its kvpress press (PAIRS)",
    )
    parser.add_argument(
        "--settings", nargs="+", choices=sweep.SETTINGS, default=list(sweep.SETTINGS)
    )
    parser.add_argument("--out", default="benchmarks/results/kvpress")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    tokenizer = kvjax.load_tokenizer("smollm2-135m-instruct")
    samples = make_samples(tokenizer, args.tasks, RELIABLE["haystacks"], args.lengths, args.samples)
    samples_path = os.path.join(args.out, "samples.jsonl")
    with open(samples_path, "w") as f:
        for s in samples:
            f.write(
                json.dumps(
                    {
                        **dataclasses.asdict(s),
                        "context": list(s.context),
                        "question": list(s.question),
                    }
                )
                + "\n"
            )

    kvpress_python = os.path.join(HERE, ".venv", "bin", "python")
    if not os.path.exists(kvpress_python):
        sys.exit(f"{kvpress_python} is missing: run `bash {os.path.relpath(HERE)}/setup.sh` first")
    print("[kvpress]", file=sys.stderr, flush=True)
    start = time.perf_counter()
    kvpress_rows_path = os.path.join(args.out, "kvpress_rows.jsonl")
    subprocess.run(
        [
            kvpress_python,
            os.path.join(HERE, "run_kvpress.py"),
            "--samples",
            samples_path,
            "--out",
            kvpress_rows_path,
            "--budgets",
            *map(str, args.budgets),
            "--presses",
            *[PAIRS[s] for s in args.scorers],
            "--settings",
            *args.settings,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    kvpress_wall = time.perf_counter() - start

    print("[kvjax]", file=sys.stderr, flush=True)
    params = kvjax.load("smollm2-135m-instruct")
    start = time.perf_counter()
    rows_path = os.path.join(args.out, "kvjax_rows.jsonl")
    kvjax_rows = []
    for scorer in args.scorers:
        for flavour, options in (("paper", {}), ("matched", MATCHED[scorer])):
            rows = sweep.run(
                params,
                tokenizer,
                samples,
                [sweep.Method(scorer, b) for b in args.budgets],
                args.settings,
                out=rows_path,
                options=options,
            )
            kvjax_rows += [(flavour, r) for r in rows]
    kvjax_wall = time.perf_counter() - start

    answers = {s.id: s.answers for s in samples}
    table = collections.defaultdict(list)  # (setting, length, budget, method) -> [(score, seconds)]
    length_of = {s.id: s.length for s in samples}
    for flavour, r in kvjax_rows:
        table[(r.setting, r.length, r.budget, f"kvjax {r.scorer} ({flavour})")].append(
            (r.score, r.seconds)
        )
    with open(kvpress_rows_path) as f:
        for r in map(json.loads, f):
            if (
                r["sample"] in answers
                and r["budget"] in args.budgets
                and r["setting"] in args.settings
            ):
                table[(r["setting"], length_of[r["sample"]], r["budget"], r["scorer"])].append(
                    (score(r["prediction"], answers[r["sample"]]), r["seconds"])
                )
    text = render(table, args)
    text += (
        f"\nWall time of this run: kvpress {kvpress_wall:.0f} s, kvjax {kvjax_wall:.0f} s "
        "(finished answers "
        "of earlier runs are not redone).\n"
    )
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    print(text)


def render(table, args) -> str:
    """One Markdown table per setting and length: per budget, each kvjax/kvpress pair's accuracy."""
    lines = []
    for setting in args.settings:
        for length in args.lengths:
            lines += [
                f"**{setting}, {length} tokens** (accuracy %, seconds per answer in brackets)",
                "",
                "| scorer | kvjax (paper defaults) | kvjax (matched to kvpress) | kvpress press | "
                "budget |",
                "| --- | ---: | ---: | ---: | ---: |",
            ]
            for scorer in args.scorers:
                for budget in args.budgets:
                    cells = []
                    for method in (
                        f"kvjax {scorer} (paper)",
                        f"kvjax {scorer} (matched)",
                        f"kvpress:{PAIRS[scorer]}",
                    ):
                        got = table.get((setting, length, budget, method), [])
                        cells.append(
                            f"{100 * sum(s for s, _ in got) / len(got):.1f} "
                            f"[{sum(t for _, t in got) / len(got):.2f}]"
                            if got
                            else "–"
                        )
                    lines.append(
                        f"| {scorer} / {PAIRS[scorer]} | " + " | ".join(cells) + f" | {budget} |"
                    )
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
