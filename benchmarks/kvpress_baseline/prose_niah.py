"""kvjax's KVzip and AdaKV against NVIDIA kvpress's on needles written as ordinary prose
(docs/results.md).

    bash benchmarks/kvpress_baseline/setup.sh     # once: kvpress in its own .venv
    .venv/bin/python benchmarks/kvpress_baseline/prose_niah.py --out docs/results/kvzip_global \
        --budgets 64 128 256 512 --methods "kvzip (layerwise)" "kvzip (global)" \
        --presses kvzip kvzip_global

The samples are kvjax's ``sentence-number`` NIAH form (``kvjax.eval.niah``): a 7-digit number in an
ordinary sentence ("The access code for the Amber Lantern gate is 8322358."), one distractor
sentence of the same form, real prose around them (``--haystacks``: ``pydoc`` and ``licenses``), the
question after the context in the chat template and no answer prefix; ``--samples`` per haystack,
needle depths spread over the context. Answers are scored from their text when the table is made
(``kvjax.eval.niah.score``: a number only as a whole number). Each sample runs in two settings,
kvpress's: query-agnostic (the context compressed, then the question appended uncompressed) and
query-aware (the prompt but its last token compressed, the last token appended).

kvjax answers with ``kvjax.eval.sweep`` (one shared prefill per sample; KVzip's scoring pass shared
by the methods with the same repeat prompt) while kvpress answers the same token ids in its own
environment (``run_kvpress.py``, one scoring pass per sample for all budgets), both at once; then
the table: accuracy per setting, budget and method, and the paired comparisons with their two-sided
sign tests.
Resumable: finished answers are not redone. ``--table-only`` rebuilds the table (``table.md``) and
the plot (``accuracy.png``) from the rows.
"""

from __future__ import annotations

import argparse
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
from kvjax.eval.niah import make_samples, score  # noqa: E402
from kvjax.eval.report import cell  # noqa: E402
from kvjax.eval.stats import paired  # noqa: E402

SETTINGS = ("query-agnostic", "query-aware")
ADAKV_MATCHED = dict(
    n_sink=0, obs_window=64, window=64, pool="avg", kernel=5, floor=0.2, floor_mode="kvpress"
)
METHODS = {  # label -> (scorer, options); the budget comes from --budgets
    # kvpress's repeat prompt, 4 sinks, no window; one layer's KV heads share its budget
    # (KVzipPress(layerwise=True))
    "kvzip (layerwise)": ("adakv+kvzip", {}),
    # one threshold over every layer and KV head, no limit on one head (KVzipPress(), kvpress's
    # default)
    "kvzip (global)": ("global+kvzip", {}),
    "kvzip (paper prompt)": ("adakv+kvzip", dict(repeat="paper")),  # the KVzip code's repeat prompt
    "adakv": ("adakv", {}),
    "adakv (kvpress's settings)": ("adakv", ADAKV_MATCHED),
}
PRESSES = {
    "kvpress:kvzip": "KVzipPress(layerwise=True)",
    "kvpress:kvzip_global": "KVzipPress()",
    "kvpress:adakv_snapkv": "AdaKVPress(SnapKVPress)",
}
PAIRS = (
    ("kvzip (layerwise)", "kvpress:kvzip"),
    ("kvzip (global)", "kvpress:kvzip_global"),
    ("kvzip (layerwise)", "kvpress:kvzip_global"),
    ("kvzip (global)", "kvzip (layerwise)"),
    ("kvzip (paper prompt)", "kvpress:kvzip"),
    ("adakv", "kvpress:adakv_snapkv"),
    ("adakv (kvpress's settings)", "kvpress:adakv_snapkv"),
)


def setting_samples(samples, settings=SETTINGS) -> list:
    """Each sample once per setting, split where kvpress splits it: (context, question) as made
    (query-agnostic), or the prompt but its last token and that token (query-aware)."""
    out = []
    for s in samples:
        if "query-agnostic" in settings:
            out.append(dataclasses.replace(s, id=f"{s.id}/query-agnostic"))
        if "query-aware" in settings:
            out.append(
                dataclasses.replace(
                    s, id=f"{s.id}/query-aware", context=s.prompt[:-1], question=s.prompt[-1:]
                )
            )
    return out


def setting_ids(samples) -> dict[str, list[str]]:
    """The ids of ``samples`` (from ``setting_samples``) by setting, for the settings they hold, in
    SETTINGS' order."""
    ids = {st: [s.id for s in samples if s.id.endswith(st)] for st in SETTINGS}
    return {st: held for st, held in ids.items() if held}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/kvzip_prose")
    parser.add_argument(
        "--samples", type=int, default=24, help="per haystack (default: %(default)s)"
    )
    parser.add_argument(
        "--length", type=int, default=1024, help="prompt tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--haystacks", nargs="+", choices=["pydoc", "licenses"], default=["pydoc", "licenses"]
    )
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument(
        "--seed", type=int, default=0, help="the samples' seed (default: %(default)s)"
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=SETTINGS,
        default=list(SETTINGS),
        help="where the prompt is split (default: both)",
    )
    parser.add_argument(
        "--methods",
        nargs="*",
        choices=list(METHODS),
        default=list(METHODS)[:2],
        help="kvjax's methods besides the full cache (default: %(default)s)",
    )
    parser.add_argument(
        "--presses",
        nargs="*",
        choices=["kvzip", "kvzip_global", "adakv_snapkv"],
        default=["kvzip", "kvzip_global", "adakv_snapkv"],
        help="kvpress's presses (none: kvjax's answers only)",
    )
    parser.add_argument(
        "--table-only", action="store_true", help="the table from the rows already written"
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tokenizer = kvjax.load_tokenizer("smollm2-135m-instruct")
    samples = setting_samples(
        make_samples(
            tokenizer, ["sentence-number"], args.haystacks, [args.length], args.samples, args.seed
        ),
        args.settings,
    )
    samples_path, kvpress_path = (
        os.path.join(args.out, "samples.jsonl"),
        os.path.join(args.out, "kvpress_rows.jsonl"),
    )
    kvjax_path = os.path.join(args.out, "kvjax_rows.jsonl")
    if not args.table_only:
        with open(samples_path, "w") as f:
            for s in samples:
                f.write(
                    json.dumps(
                        dataclasses.asdict(s)
                        | {"context": list(s.context), "question": list(s.question)}
                    )
                    + "\n"
                )
        kvpress = None
        if args.presses:
            python = os.path.join(HERE, ".venv", "bin", "python")
            if not os.path.exists(python):
                sys.exit(f"{python} is missing: run `bash {os.path.relpath(HERE)}/setup.sh` first")
            kvpress = subprocess.Popen(
                [
                    python,
                    os.path.join(HERE, "run_kvpress.py"),
                    "--samples",
                    samples_path,
                    "--out",
                    kvpress_path,
                    "--budgets",
                    *map(str, args.budgets),
                    "--presses",
                    *args.presses,
                    "--settings",
                    "query-agnostic",
                    "--threads",
                    "1",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        params = kvjax.load("smollm2-135m-instruct")
        start = time.perf_counter()
        methods = [sweep.Method(sweep.FULL, None, "-")] + [
            sweep.Method(scorer, b, options=tuple(sorted(options.items())), name=label)
            for label in args.methods
            for scorer, options in [METHODS[label]]
            for b in args.budgets
        ]
        sweep.run(params, tokenizer, samples, methods, ["query-agnostic"], out=kvjax_path)
        print(f"[kvjax: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
        if kvpress is not None and kvpress.wait() != 0:
            sys.exit(
                f"run_kvpress.py failed (exit {kvpress.returncode}); its rows so far are in "
                f"{kvpress_path}"
            )
    found = read_scores(samples, kvjax_path, kvpress_path)
    text = table(samples, found, args.budgets)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    plot(samples, found, args.budgets, os.path.join(args.out, "accuracy.png"))
    print(text)


def plot(samples, found: dict, budgets, path: str) -> None:
    """Accuracy against budget (found: ``read_scores``), one panel per setting, one line per method
    (kvpress's
    dashed: where a kvjax line is hidden, kvpress's lies on it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_setting = setting_ids(samples)
    fig, axes = plt.subplots(
        1, len(by_setting), figsize=(5.5 * len(by_setting), 4), sharey=True, squeeze=False
    )
    axes = axes[0]
    for ax, (st, ids) in zip(axes, by_setting.items(), strict=True):
        for label in ["full", *METHODS, *PRESSES]:
            ys = []
            for b in budgets:
                got = found.get((label, None if label == "full" else b), {})
                k = [got[i] for i in ids if i in got]
                ys.append(100 * sum(k) / len(k) if len(k) == len(ids) else None)
            if all(y is not None for y in ys):
                ax.plot(
                    budgets,
                    ys,
                    "--" if label in PRESSES else "-",
                    marker="o",
                    label=PRESSES.get(label, label),
                )
        ax.set(title=st, xlabel="tokens kept per KV head", xscale="log")
        ax.minorticks_off()
        ax.set(xticks=budgets, xticklabels=budgets)
    axes[0].set_ylabel("right answers %")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"sentence-number NIAH on prose, {samples[0].length} tokens, SmolLM2-135M")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read_scores(samples, kvjax_path: str, kvpress_path: str) -> dict:
    """(label, budget) -> {sample id: score} for kvjax's methods (and "full") and kvpress's presses;
    the predictions too, under (label, budget, "text")."""
    answers = {s.id: s.answers for s in samples}
    found: dict = {}
    for r in sweep.read_rows(kvjax_path):
        if r.sample in answers:
            found.setdefault((r.method_label, r.budget), {})[r.sample] = score(
                r.prediction, answers[r.sample]
            )
            found.setdefault((r.method_label, r.budget, "text"), {})[r.sample] = r.prediction
    if os.path.exists(kvpress_path):
        for r in map(json.loads, open(kvpress_path)):
            if r["sample"] in answers:
                right = score(r["prediction"], answers[r["sample"]])
                found.setdefault((r["scorer"], r["budget"]), {})[r["sample"]] = right
                found.setdefault((r["scorer"], r["budget"], "text"), {})[r["sample"]] = r[
                    "prediction"
                ]
    return found


def right_cell(got: dict, ids) -> str:
    """Right answers of ``got`` (sample id -> score) among ``ids``, with their Wilson 95% interval;
    "–" when none of them was answered."""
    k = [got[i] for i in ids if i in got]
    return f"{sum(k):g}/{len(k)} ({cell(100 * sum(k) / len(k), len(k))})" if k else "–"


def paired_rows(found: dict, pairs, by_setting: dict, budgets) -> list[str]:
    """Markdown rows of the paired sign tests: for each (first, second) of ``pairs``, setting and
    budget, the first's wins / losses against the second on the samples both answered, p, and
    how many predictions were the same text."""
    rows = []
    for first, second in pairs:
        for st, ids in by_setting.items():
            for b in budgets:
                a, c = found.get((first, b), {}), found.get((second, b), {})
                both = [i for i in ids if i in a and i in c]
                if not both:
                    continue
                result = paired({i: c[i] for i in both}, {i: a[i] for i in both})
                ta, tc = found[(first, b, "text")], found[(second, b, "text")]
                same = sum(ta[i].strip() == tc[i].strip() for i in both)
                rows.append(
                    f"| {first} | {second} | {st} | {b} | {result.wins} / {result.losses} | "
                    f"{result.p:.3g} | {same}/{len(both)} |"
                )
    return rows


def table(samples, found: dict, budgets) -> str:
    """Markdown: accuracy (right answers of n, Wilson 95% interval) per setting, method and budget;
    the paired comparisons; kvjax's default against kvpress's KVzip answer for answer. found:
    ``read_scores``."""
    by_setting = setting_ids(samples)
    labels = (
        ["full"]
        + [m for m in METHODS if any((m, b) in found for b in budgets)]
        + [p for p in PRESSES if any((p, b) in found for b in budgets)]
    )
    lines = []
    for st, ids in by_setting.items():
        lines += [
            f"**{st}** ({len(ids)} samples; right answers, Wilson 95% interval)",
            "",
            "| method | " + " | ".join(f"budget {b}" for b in budgets) + " |",
            "| --- |" + " ---: |" * len(budgets),
        ]
        for label in labels:
            cells = []
            for b in budgets:
                cells.append(
                    right_cell(found.get((label, None if label == "full" else b), {}), ids)
                )
            name = f"kvpress `{PRESSES[label]}`" if label in PRESSES else f"kvjax `{label}`"
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "**Paired** (same samples: wins / losses of the first against the second, two-sided sign "
        "test)",
        "",
        "| first | second | setting | budget | wins / losses | p | same prediction |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += paired_rows(found, PAIRS, by_setting, budgets)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
