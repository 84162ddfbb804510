"""Accuracy-versus-budget tables (Markdown, with 95% Wilson intervals), paired comparisons of
methods on the same samples, and plots (PNG), from sweep rows."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kvjax.eval.stats import paired, wilson
from kvjax.eval.sweep import FULL, Row


def accuracy(rows: Sequence[Row]) -> dict[tuple, tuple[float, int]]:
    """(setting, length, method label, budget) -> (mean score × 100, number of answers). The full
    cache is filed under every setting (it does not depend on one)."""
    settings = sorted({r.setting for r in rows})
    scores = collections.defaultdict(list)
    for r in rows:
        label = r.method_label
        for setting in settings if r.scorer == FULL else [r.setting]:
            scores[(setting, r.length, label, r.budget)].append(r.score)
    return {key: (100.0 * sum(v) / len(v), len(v)) for key, v in scores.items()}


def cell(percent: float, n: int) -> str:
    """An accuracy in percent over n answers with its 95% Wilson interval: "58.3 [38.8, 75.5]"."""
    # rounded: the percent's float error may pass n
    low, high = wilson(round(percent / 100 * n, 9), n)
    return f"{percent:.1f} [{100 * low:.1f}, {100 * high:.1f}]"


def markdown(rows: Sequence[Row], title: str = "") -> str:
    """One table per (setting, length): methods down, budgets across, accuracy in percent with its
    95% Wilson interval (a mean of partial scores counts as that proportion of the answers)."""
    acc = accuracy(rows)
    lines = [f"## {title}", ""] if title else []
    for setting in sorted({k[0] for k in acc}):
        for length in sorted({k[1] for k in acc if k[0] == setting}):
            here = {k: v for k, v in acc.items() if k[:2] == (setting, length)}
            budgets = sorted({k[3] for k in here if k[3] is not None})
            full = here.get((setting, length, FULL, None))
            full_text = f"; full cache {cell(*full)} ({full[1]} answers)" if full else ""
            lines += [
                f"**{setting}, {length} tokens**{full_text}",
                "",
                "| method | " + " | ".join(str(b) for b in budgets) + " |",
                "| --- |" + " ---: |" * len(budgets),
            ]
            for label in sorted({k[2] for k in here if k[2] != FULL}):
                cells = [
                    cell(*here[(setting, length, label, b)])
                    if (setting, length, label, b) in here
                    else ""
                    for b in budgets
                ]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def timing(rows: Sequence[Row]) -> str:
    """Seconds per answer by method (own work), and the shared full prefills."""
    per = collections.defaultdict(list)
    for r in rows:
        per[r.method_label].append(r.seconds)
    # one prefill serves both settings
    shared = {r.sample: r.prefill_seconds for r in rows if r.prefill_seconds}
    lines = ["| method | answers | seconds per answer |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {len(v)} | {sum(v) / len(v):.2f} |" for k, v in sorted(per.items())]
    if shared:
        lines.append(
            f"| shared full prefills | {len(shared)} | {sum(shared.values()) / len(shared):.2f} |"
        )
    return "\n".join(lines)


def _scores(rows: Sequence[Row], label: str) -> dict[tuple, float]:
    """(setting, length, budget, sample) -> score of the rows of one method label."""
    found = {}
    for r in rows:
        if r.method_label == label:
            key = (r.setting, r.length, r.budget, r.sample)
            if key in found:
                raise ValueError(f"claims: label {label!r} has two rows for {key}")
            found[key] = r.score
    if not found:
        raise ValueError(f"claims: no rows labelled {label!r}")
    return found


def paired_markdown(
    rows: Sequence[Row], claims: Sequence[tuple[str, str, str]], title: str = ""
) -> str:
    """One table per claim (claim name, baseline label, method label): the two methods' rows joined
    on (sample, budget, length, setting), and per (setting, length, budget) the pairs, each method's
    accuracy (answers fully right, score 1, in percent with the 95% Wilson interval), wins, losses,
    ties and the sign test's p."""
    lines = [f"## {title}", ""] if title else []
    lines += [
        "Wins: the method right and the baseline wrong; losses: the reverse; ties: both right or "
        "both wrong. p: two-sided exact sign test over the untied pairs.",
        "",
    ]
    for claim, baseline, method in claims:
        base_scores, method_scores = _scores(rows, baseline), _scores(rows, method)
        groups = collections.defaultdict(lambda: ({}, {}))
        for key in base_scores.keys() & method_scores.keys():
            base, mine = groups[key[:3]]
            base[key[3]], mine[key[3]] = base_scores[key], method_scores[key]
        lines += [
            f"### {claim}",
            "",
            f"baseline `{baseline}`, method `{method}`",
            "",
            "| setting | tokens | budget | pairs | baseline | method | wins | losses | ties | p |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for (setting, length, budget), (base, mine) in sorted(groups.items()):
            n, result = len(base), paired(base, mine)
            right = [cell(100 * sum(s == 1 for s in x.values()) / n, n) for x in (base, mine)]
            lines.append(
                f"| {setting} | {length} | {budget} | {n} | {right[0]} | {right[1]} | "
                f"{result.wins} | {result.losses} | {result.ties} | {result.p:.3g} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str, title: str = "") -> None:
    """Accuracy against budget, one line per method, one panel per (setting, length); the full cache
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = accuracy(rows)
    settings = sorted({k[0] for k in acc})
    lengths = sorted({k[1] for k in acc})
    fig, axes = plt.subplots(
        len(settings),
        len(lengths),
        figsize=(4.2 * len(lengths), 3.4 * len(settings)),
        squeeze=False,
        sharey=True,
    )
    labels = sorted({k[2] for k in acc if k[2] != FULL})
    colors = {label: plt.get_cmap("tab20")(i % 20) for i, label in enumerate(labels)}
    for i, setting in enumerate(settings):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            for label in labels:
                points = sorted(
                    (k[3], v[0]) for k, v in acc.items() if k[:3] == (setting, length, label)
                )
                if points:
                    ax.plot(
                        *zip(*points, strict=True), marker="o", label=label, color=colors[label]
                    )
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
