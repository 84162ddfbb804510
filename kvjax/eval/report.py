"""Accuracy-versus-budget tables (Markdown) and plots (PNG) from sweep rows."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kvjax.eval.sweep import FULL, Row


def accuracy(rows: Sequence[Row]) -> dict[tuple, tuple[float, int]]:
    """(setting, length, method label, budget) -> (mean score × 100, number of answers). The full cache is
    filed under every setting (it does not depend on one)."""
    settings = sorted({r.setting for r in rows})
    scores = collections.defaultdict(list)
    for r in rows:
        label = r.method_label
        for setting in (settings if r.scorer == FULL else [r.setting]):
            scores[(setting, r.length, label, r.budget)].append(r.score)
    return {key: (100.0 * sum(v) / len(v), len(v)) for key, v in scores.items()}


def markdown(rows: Sequence[Row], title: str = "") -> str:
    """One table per (setting, length): methods down, budgets across, accuracy in percent."""
    acc = accuracy(rows)
    lines = [f"## {title}", ""] if title else []
    for setting in sorted({k[0] for k in acc}):
        for length in sorted({k[1] for k in acc if k[0] == setting}):
            here = {k: v for k, v in acc.items() if k[:2] == (setting, length)}
            budgets = sorted({k[3] for k in here if k[3] is not None})
            full = here.get((setting, length, FULL, None))
            full_text = f"; full cache {full[0]:.1f} ({full[1]} answers)" if full else ""
            lines += [f"**{setting}, {length} tokens**{full_text}", "",
                      "| method | " + " | ".join(str(b) for b in budgets) + " |",
                      "| --- |" + " ---: |" * len(budgets)]
            for label in sorted({k[2] for k in here if k[2] != FULL}):
                cells = [f"{here[(setting, length, label, b)][0]:.1f}" if (setting, length, label, b) in here
                         else "" for b in budgets]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def timing(rows: Sequence[Row]) -> str:
    """Seconds per answer by method (own work), and the shared full prefills."""
    per = collections.defaultdict(list)
    for r in rows:
        per[r.method_label].append(r.seconds)
    shared = {r.sample: r.prefill_seconds for r in rows if r.prefill_seconds}  # one prefill serves both settings
    lines = ["| method | answers | seconds per answer |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {len(v)} | {sum(v) / len(v):.2f} |" for k, v in sorted(per.items())]
    if shared:
        lines.append(f"| shared full prefills | {len(shared)} | {sum(shared.values()) / len(shared):.2f} |")
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str, title: str = "") -> None:
    """Accuracy against budget, one line per method, one panel per (setting, length); the full cache dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = accuracy(rows)
    settings = sorted({k[0] for k in acc})
    lengths = sorted({k[1] for k in acc})
    fig, axes = plt.subplots(len(settings), len(lengths), figsize=(4.2 * len(lengths), 3.4 * len(settings)),
                             squeeze=False, sharey=True)
    labels = sorted({k[2] for k in acc if k[2] != FULL})
    colors = {label: plt.get_cmap("tab20")(i % 20) for i, label in enumerate(labels)}
    for i, setting in enumerate(settings):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            for label in labels:
                points = sorted((k[3], v[0]) for k, v in acc.items() if k[:3] == (setting, length, label))
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=label, color=colors[label])
            full = acc.get((setting, length, FULL, None))
            if full:
                ax.axhline(full[0], color="black", linestyle="--", linewidth=1, label="full cache")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{setting}, {length} tokens", fontsize=10)
            ax.set_xlabel("budget (tokens per KV head)")
            ax.set_ylim(-5, 105)
            if j == 0:
                ax.set_ylabel("accuracy (%)")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
