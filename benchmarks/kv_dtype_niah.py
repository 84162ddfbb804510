"""Quantized KVzip and Expected Attention against the unquantized cache and kvpress's default
``KVzipPress()`` at equal memory, on the prose needles of docs/results.md ("KVzip's global mode").

    .venv/bin/python benchmarks/kv_dtype_niah.py                 # 86 minutes on 2 shared cores
    .venv/bin/python benchmarks/kv_dtype_niah.py --table-only    # the table and plot from the rows

The samples are those of ``prose_niah.py --length 2048 --haystacks licenses --samples 48`` (the
same ids, regenerated), both settings, whose kvjax rows (``kvzip (global)``: the model's float32
cache) and kvpress rows (``KVzipPress()``) are read from ``--baseline`` (docs/results/
kvzip_global_2k). Memory is counted as a GPU stores it: B "bfloat16 slots" per KV head are the
bytes of B tokens' keys and values in bfloat16; a kv_dtype cache keeps
``kvjax.budget_for_bytes`` slots in those bytes (int8: B × 128/66, int4: B × 128/34 at head_dim
64). kvpress (float32 on CPU, whose bytes we count as bfloat16's) and the float32 cache keep B.
Rows go to ``--out``/kvjax_rows.jsonl (resumable), the tables to table.md, the plot to
accuracy.png.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "kvpress_baseline"))
sys.path.insert(0, os.path.dirname(HERE))

import jax.numpy as jnp  # noqa: E402
from kvjax.kernels.quantized import bytes_per_token  # noqa: E402
from prose_niah import (  # noqa: E402
    SETTINGS,
    paired_rows,
    read_scores,
    right_cell,
    setting_ids,
    setting_samples,
)

import kvjax  # noqa: E402
from kvjax.eval import sweep  # noqa: E402
from kvjax.eval.niah import make_samples  # noqa: E402

SCORERS = {"kvzip": "global+kvzip", "expected attention": "expected-attention"}
DTYPES = (None, "int8", "int4")
BASELINE_KVZIP = "kvzip (global)"  # the float32 cache's KVzip in --baseline's kvjax rows
KVPRESS = "kvpress:kvzip_global"


def label(name: str, kv_dtype: str | None) -> str:
    return f"{name} {kv_dtype or 'float32'}"


def slots(cfg, bf16_slots: int, kv_dtype: str | None) -> int:
    """Slots per KV head that the bytes of ``bf16_slots`` bfloat16 slots hold in ``kv_dtype``."""
    nbytes = bf16_slots * cfg.n_layers * cfg.n_kv_heads * bytes_per_token(cfg.head_dim, 2, None)
    return kvjax.budget_for_bytes((cfg, jnp.bfloat16), nbytes, kv_dtype)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="docs/results/kv_dtype_niah")
    parser.add_argument("--baseline", default="docs/results/kvzip_global_2k")
    parser.add_argument("--bytes-of", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0, help="the samples' seed")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--scorers", nargs="+", choices=list(SCORERS), default=list(SCORERS))
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    scorers = {name: SCORERS[name] for name in args.scorers}
    os.makedirs(args.out, exist_ok=True)
    tokenizer = kvjax.load_tokenizer("smollm2-135m-instruct")
    cfg = kvjax.load("smollm2-135m-instruct").config if not args.table_only else None
    samples = setting_samples(
        make_samples(tokenizer, ["sentence-number"], ["licenses"], [2048], args.samples, args.seed),
        args.settings,
    )
    rows_path = os.path.join(args.out, "kvjax_rows.jsonl")
    if not args.table_only:
        params = kvjax.load("smollm2-135m-instruct")
        cfg = params.config
        methods = [
            sweep.Method(
                scorer,
                slots(cfg, b, kv),
                options=(("kv_dtype", kv),) if kv else (),
                name=label(name, kv),
            )
            for name, scorer in scorers.items()
            for kv in DTYPES
            if not (name == "kvzip" and kv is None)  # in --baseline's rows
            for b in args.bytes_of
        ]
        sweep.run(params, tokenizer, samples, methods, ["query-agnostic"], out=rows_path)
    cfg = cfg or kvjax.load("smollm2-135m-instruct").config
    found = read_scores(
        samples,
        os.path.join(args.baseline, "kvjax_rows.jsonl"),
        os.path.join(args.baseline, "kvpress_rows.jsonl"),
    )
    mine = read_scores(samples, rows_path, "/nonexistent")
    by_bytes = {}  # (label, bf16 slots) -> {sample: score}, and the texts
    for b in args.bytes_of:
        for name in scorers:
            for kv in DTYPES:
                source = found if (name == "kvzip" and kv is None) else mine
                key = BASELINE_KVZIP if source is found else label(name, kv)
                for part in ((), ("text",)):
                    got = source.get((key, slots(cfg, b, kv), *part))
                    if got:
                        by_bytes[(label(name, kv), b, *part)] = got
        for part in ((), ("text",)):
            if (KVPRESS, b, *part) in found:
                by_bytes[("kvpress KVzipPress()", b, *part)] = found[(KVPRESS, b, *part)]
    text = table(samples, by_bytes, args.bytes_of, cfg)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    plot(samples, by_bytes, args.bytes_of, os.path.join(args.out, "accuracy.png"))
    print(text)


LABELS = [label(n, kv) for n in SCORERS for kv in DTYPES] + ["kvpress KVzipPress()"]
PAIRS = [
    (label("kvzip", "int8"), "kvpress KVzipPress()"),
    (label("kvzip", "int4"), "kvpress KVzipPress()"),
    (label("kvzip", "int8"), label("kvzip", None)),
    (label("kvzip", "int4"), label("kvzip", None)),
    (label("kvzip", "int4"), label("kvzip", "int8")),
    (label("expected attention", "int8"), label("expected attention", None)),
    (label("expected attention", "int4"), label("expected attention", None)),
]


def table(samples, found: dict, budgets, cfg) -> str:
    """Markdown: right answers per setting, method and memory, the slots each keeps, and the paired
    sign tests."""
    ids = setting_ids(samples)
    head = " | ".join(f"bytes of {b} bf16 slots" for b in budgets)
    lines = [
        "Slots per KV head at each memory: "
        + "; ".join(
            f"{kv or 'float32/bfloat16'} " + ", ".join(str(slots(cfg, b, kv)) for b in budgets)
            for kv in DTYPES
        ),
        "",
    ]
    for st, wanted in ids.items():
        lines += [
            f"**{st}** ({len(wanted)} samples; right answers, Wilson 95% interval)",
            "",
            f"| method | {head} |",
            "| --- |" + " ---: |" * len(budgets),
        ]
        for name in LABELS:
            cells = [right_cell(found.get((name, b), {}), wanted) for b in budgets]
            if any(c != "–" for c in cells):  # methods not run (--scorers) have no row
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "**Paired** (same samples and memory: wins / losses of the first against the second, "
        "two-sided sign test)",
        "",
        "| first | second | setting | memory (bf16 slots) | wins / losses | p | same prediction |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += paired_rows(found, PAIRS, ids, budgets)
    return "\n".join(lines) + "\n"


def plot(samples, found: dict, budgets, path: str) -> None:
    """Right answers against memory, one panel per setting, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_setting = setting_ids(samples)
    fig, axes = plt.subplots(
        1, len(by_setting), figsize=(5.5 * len(by_setting), 4), sharey=True, squeeze=False
    )
    axes = axes[0]
    for ax, (st, wanted) in zip(axes, by_setting.items(), strict=True):
        for name in LABELS:
            ys = []
            for b in budgets:
                got = found.get((name, b), {})
                k = [got[i] for i in wanted if i in got]
                ys.append(100 * sum(k) / len(k) if len(k) == len(wanted) else None)
            if all(y is not None for y in ys):
                style = "--" if name.startswith("kvpress") else ":" if "float32" in name else "-"
                ax.plot(budgets, ys, style, marker="o", label=name)
        ax.set(title=st, xlabel="memory per KV head (bfloat16 slots' bytes)", xscale="log")
        ax.minorticks_off()
        ax.set(xticks=budgets, xticklabels=budgets)
    axes[0].set_ylabel("right answers %")
    axes[-1].legend(fontsize=7)
    fig.suptitle(
        "sentence-number NIAH on licenses prose, 2K tokens, SmolLM2-135M, equal memory", wrap=True
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
