"""kvpress's KVzip and AdaKV next to kvjax's on the same query-agnostic samples (docs/results.md).

    # from the repository root, kvjax's .venv
    .venv/bin/python benchmarks/kvpress_baseline/kvzip_table.py

Joins ``docs/results/kvzip_kvpress/kvpress_rows.jsonl`` (run_kvpress.py's answers, scored here as
the sweep
scores: RULER's string_match_all against each sample's answers) with kvjax's answers to the same
samples in ``docs/results/kvzip/rows.jsonl`` (the ``kvzip`` preset). Prints per budget each method's
accuracy with its Wilson interval, and how often kvpress and kvjax agree answer for answer. Markdown
to stdout.
"""

from __future__ import annotations

import argparse
import json

from kvjax.eval.niah import score
from kvjax.eval.report import cell

PAIRS = {
    "kvpress:kvzip": "kvzip",
    "kvpress:adakv_snapkv": "adakv",
}  # kvpress press -> kvjax method label


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir", default="docs/results", help="results directory (default: %(default)s)"
    )
    args = parser.parse_args()
    samples = {s["id"]: s for s in map(json.loads, open(f"{args.dir}/kvzip_kvpress/samples.jsonl"))}
    theirs = {
        (r["sample"], r["scorer"], r["budget"]): score(
            r["prediction"], samples[r["sample"]]["answers"]
        )
        for r in map(json.loads, open(f"{args.dir}/kvzip_kvpress/kvpress_rows.jsonl"))
    }
    ours = {
        (r["sample"], r["label"], r["budget"]): r["score"]
        for r in map(json.loads, open(f"{args.dir}/kvzip/rows.jsonl"))
        if r["sample"] in samples and r["setting"] == "query-agnostic"
    }
    budgets = sorted({b for _, _, b in theirs})
    print("| method | " + " | ".join(f"budget {b}" for b in budgets) + " |")
    print("| --- |" + " ---: |" * len(budgets))

    def row(name: str, table: dict, label: str, budget_of=lambda b: b) -> None:
        cells = []
        for b in budgets:
            got = [
                table[s, label, budget_of(b)] for s in samples if (s, label, budget_of(b)) in table
            ]
            cells.append(
                f"{sum(got):g}/{len(got)} ({cell(100 * sum(got) / len(got), len(got))})"
                if got
                else "-"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")

    row("full cache (kvjax)", ours, "full", lambda b: None)
    for press, label in PAIRS.items():
        row(f"kvpress `{press.split(':')[1]}`", theirs, press)
        row(f"kvjax `{label}`", ours, label)
    print(
        "\n| pair | budget | samples both answered | same score | kvpress only right | kvjax only "
        "right |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for press, label in PAIRS.items():
        for b in budgets:
            both = [
                (theirs[s, press, b], ours[s, label, b])
                for s in samples
                if (s, press, b) in theirs and (s, label, b) in ours
            ]
            print(
                f"| {press} vs kvjax {label} | {b} | {len(both)} | {sum(x == y for x, y in both)} "
                "| "
                f"{sum(x > y for x, y in both)} | {sum(y > x for x, y in both)} |"
            )


if __name__ == "__main__":
    main()
