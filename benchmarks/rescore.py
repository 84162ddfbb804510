"""Score every committed needle answer again with ``kvjax.eval.niah.score`` (a number counts only as
a whole number: "2049969999" does not answer 2049969) and name each answer whose score changed.

    .venv/bin/python benchmarks/rescore.py                # report only
    .venv/bin/python benchmarks/rescore.py --write        # also rewrite the rows' "score"

Rows are the JSONL files under ``docs/results`` with a ``prediction`` (kvpress's rows, which store
no ``score``, are compared with the substring rule their tables were first made with); their
samples are made again from their ids (``task/haystack/length/IofN/seedS``, plus a setting suffix
for the prose runs), which ``make_samples`` reproduces exactly. Prints, per file, each changed
answer (sample, method, old and new score) and the cells (method, budget, setting, length) whose
totals moved; writes the same as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvjax  # noqa: E402
from kvjax.eval.niah import make_sample, score  # noqa: E402


def answers_of(tokenizer, sample_id: str, cache: dict) -> tuple[str, ...]:
    base = "/".join(sample_id.split("/")[:5])
    if base not in cache:
        task, haystack, length, index, seed = base.split("/")
        i, n = index.split("of")
        cache[base] = make_sample(
            tokenizer, task, haystack, int(length), int(i), int(n), int(seed[4:])
        ).answers
    return cache[base]


def substring_score(prediction: str, answers) -> float:
    """The rule before whole numbers: an answer anywhere in the prediction (case-insensitive)."""
    return sum(a.lower() in prediction.lower() for a in answers) / len(answers)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default="docs/results")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--out", default="docs/results/rescore.json")
    args = parser.parse_args()
    tokenizer = kvjax.load_tokenizer("smollm2-135m-instruct")
    cache: dict = {}
    report = {}
    for path in sorted(glob.glob(os.path.join(args.root, "**", "*.jsonl"), recursive=True)):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not rows or "prediction" not in rows[0]:
            continue
        changed, cells = [], collections.Counter()
        stored = "score" in rows[0]  # kvpress's rows are scored when a table is made from them
        for row in rows:
            answers = answers_of(tokenizer, row["sample"], cache)
            new = score(row["prediction"], answers)
            old = row["score"] if stored else substring_score(row["prediction"], answers)
            if new != old:
                method = row.get("label") or row.get("press") or row["scorer"]
                changed.append(
                    dict(
                        sample=row["sample"],
                        method=method,
                        budget=row.get("budget"),
                        prediction=row["prediction"],
                        old=old,
                        new=new,
                    )
                )
                cell = (method, row.get("budget"), row.get("setting"), row.get("length"))
                cells[json.dumps(cell)] += new - old
                if stored:
                    row["score"] = new
        print(f"{path}: {len(rows)} answers, {len(changed)} scored differently", flush=True)
        for c in changed:
            print(f"  {c['sample']} {c['method']} {c['budget']}: {c['prediction']!r} "
                  f"{c['old']:g} -> {c['new']:g}")  # fmt: skip
        if changed:
            report[path] = dict(changed=changed, cells={k: v for k, v in cells.items() if v})
            if args.write and stored:
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    f.writelines(json.dumps(row) + "\n" for row in rows)
                os.replace(tmp, path)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
