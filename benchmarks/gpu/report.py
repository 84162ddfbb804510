"""The run's report: ``OUT/parts/*.json`` merged into ``OUT/results.json``, the tables and the
issue's targets (measured, met or not) in ``OUT/results.md``. Several runs (device calls) combine
into one report: a row that one run did not reach ("not run: ...") gives way to the same measurement
made in another.

    python benchmarks/gpu/report.py OUT                          # again, from one run's files
    # runs' results.json combined into one report:
    python benchmarks/gpu/report.py --dest FILE.md RUN1 RUN2 ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import kernels_part
import layers_part
import model_part
import serve_part
import server_part
from common import Results


def load(out: Path) -> dict:
    """One run: its parts' files, or (a committed run) its results.json."""
    if not (out / "parts").is_dir():
        return json.loads((out / "results.json").read_text())
    merged = {"meta": {}, "parts": {}}
    for path in sorted((out / "parts").glob("*.json")):
        data = json.loads(path.read_text())
        merged["meta"][path.stem] = data.get("meta", {})
        if path.stem == "peer":
            merged["parts"]["peer"] = data
        else:
            merged["parts"].update(data.get("parts", {}))
    return merged


LABELS = {
    "kernel_checks": ("op", "score", "shape", "dtype", "slots"),
    "kernel_times": ("op", "score", "slots", "batch", "impl"),
    "prefill": ("cache", "context", "impl"),
    "decode": ("cache", "impl", "context", "batch", "largest_batch"),
    "serve": ("slots",),
    "server": ("case",),
    "layers": ("variant", "layers", "dtype", "context", "batch"),
}


def combine(runs: list[dict], names: list[str]) -> dict:
    """Several runs' rows in one: each row tagged with its run; a "not run" row is dropped where
    another run measured (or failed) the same thing."""
    out = {"meta": {name: run["meta"] for name, run in zip(names, runs)}, "parts": {}}
    for name, run in zip(names, runs):
        for table, rows in run["parts"].items():
            if isinstance(rows, list):
                out["parts"].setdefault(table, []).extend({**r, "run": name} for r in rows)
            else:  # the peer's object
                out["parts"][table] = {**rows, "run": name}
    for table, rows in out["parts"].items():
        if not isinstance(rows, list):
            continue
        key = lambda r: tuple(r.get(k) for k in LABELS.get(table, ()))  # noqa: E731
        reached = {key(r) for r in rows if not str(r.get("error", "")).startswith("not run")}
        out["parts"][table] = [
            r
            for r in rows
            if not (str(r.get("error", "")).startswith("not run") and key(r) in reached)
        ]
    return out


def view(merged: dict) -> Results:
    """The merged rows as a ``Results`` (in memory) for the parts' table functions."""
    r = Results.__new__(Results)
    r.meta, r.parts = (
        merged["meta"],
        {k: v for k, v in merged["parts"].items() if isinstance(v, list)},
    )
    return r


def peer_table(peer: dict) -> list[str]:
    if not peer:
        return []
    if "error" in peer and not peer.get("decode"):
        return ["### transformers (torch) on the same card", "", f"not run: {peer['error']}", ""]
    lines = [
        f"### transformers {peer.get('transformers')} (torch {peer.get('torch')}, sdpa, "
        "StaticCache, eager) "
        f"on {peer.get('device_name')}",
        "",
        "| what | context | batch | tokens/s | ms/step |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in peer.get("prefill", []):
        cell = r.get("error", "")[:200] or f"{r['tokens_per_s']:.0f}"
        lines.append(f"| prefill | {r['context']} | 1 | {cell} | |")
    for r in peer.get("decode", []):
        if "error" in r:
            lines.append(f"| decode | {r['context']} | {r['batch']} | {r['error'][:200]} | |")
        else:
            lines.append(
                f"| decode | {r['context']} | {r['batch']} | {r['tokens_per_s']:.0f} | "
                f"{r['ms_per_step']:.2f} |"
            )
    return lines + [""]


def find(rows, **match):
    return next(
        (r for r in rows if all(r.get(k) == v for k, v in match.items()) and "error" not in r), None
    )


def targets(merged: dict) -> list[str]:
    """The issue's five targets, each with the figures it was judged on."""
    parts = merged["parts"]
    decode, serve, peer = parts.get("decode", []), parts.get("serve", []), parts.get("peer", {})
    contexts = sorted({r["context"] for r in decode if "context" in r})
    lines = ["### Targets", "", "| target | measured | met |", "| --- | --- | --- |"]

    def add(name, measured, met):
        lines.append(
            f"| {name} | {measured} | "
            f"{'yes' if met else 'no' if met is not None else 'not measured'} |"
        )

    if not contexts:
        add("decode", "no decode rows", None)
        return lines + server_targets(parts.get("server", [])) + [""]
    c4, c32 = contexts[0], contexts[-1]
    snaps = sorted(
        {r["cache"] for r in decode if r.get("cache", "").startswith("snapkv ")},
        key=lambda c: int(c.split()[1]),
    )
    snap = snaps[-1] if snaps else "snapkv 1024"  # the larger budget (1024 on the device)
    impls = ["default"] + (
        ["unstacked"] if any(r.get("impl") == "unstacked" for r in decode) else []
    )
    for impl in impls:
        for cache in ("full", snap):
            r = find(decode, cache=cache, impl=impl, context=c4, batch=1)
            how = "" if impl == "default" else ", kvjax.unstack_layers"
            add(
                f"batch-1 decode within 1.3x of its floor ({cache}, {c4}{how})",
                f"{r['ms_per_step']:.2f} ms vs floor {r['floor_ms']:.2f} ms = "
                f"{r['step_over_floor']:.2f}x"
                if r
                else "",
                r["step_over_floor"] <= 1.3 if r else None,
            )
    batches = sorted({r["batch"] for r in decode if "batch" in r and not r.get("largest_batch")})
    big = batches[-1] if batches else None
    for cache in ("full", snap):
        one, many = (
            find(decode, cache=cache, impl="default", context=c4, batch=1),
            find(decode, cache=cache, impl="default", context=c4, batch=big),
        )
        ratio = many["tokens_per_s"] / one["tokens_per_s"] if one and many else None
        add(
            f"batch-{big} decode throughput >= 20x batch 1 ({cache}, {c4})",
            f"{many['tokens_per_s']:.0f} vs {one['tokens_per_s']:.0f} tokens/s = {ratio:.1f}x"
            if ratio
            else "",
            ratio >= 20 if ratio else None,
        )
    full = find(decode, cache="full", context=c32, largest_batch=True)
    budget = find(decode, cache=snap, context=c32, largest_batch=True)
    ratio = budget["tokens_per_s"] / full["tokens_per_s"] if full and budget else None
    add(
        f"{c32}: budget {snap.split()[1]} >= 3x the full cache's tokens/s, each at its largest "
        "batch",
        f"{budget['tokens_per_s']:.0f} (batch {budget['batch']}) vs {full['tokens_per_s']:.0f} "
        f"(batch {full['batch']})"
        f" = {ratio:.1f}x"
        if ratio
        else "",
        ratio >= 3 if ratio else None,
    )
    mid = 32 if 32 in batches else big  # batch 32 on the device
    theirs = find(peer.get("decode", []), context=c4, batch=mid)
    for cache in ("full", snap):
        ours = find(decode, cache=cache, impl="default", context=c4, batch=mid)
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"] if ours and theirs else None
        add(
            f"kvjax ({cache}) decode >= transformers at batch {mid}, {c4}",
            f"{ours['tokens_per_s']:.0f} vs {theirs['tokens_per_s']:.0f} tokens/s = {ratio:.2f}x"
            if ratio
            else "",
            ratio >= 1 if ratio else None,
        )
    one = next((r for r in serve if r.get("slots") == 1 and "tokens_per_s" in r), None)
    many = next((r for r in serve if r.get("slots", 1) > 1 and "tokens_per_s" in r), None)
    ratio = many["tokens_per_s"] / one["tokens_per_s"] if one and many else None
    add(
        f"serving with {many['slots'] if many else 32} slots >= 8x one at a time",
        f"{many['tokens_per_s']:.0f} vs {one['tokens_per_s']:.0f} tokens/s = {ratio:.1f}x"
        if ratio
        else "",
        ratio >= 8 if ratio else None,
    )
    return lines + server_targets(parts.get("server", [])) + [""]


def server_targets(server: list[dict]) -> list[str]:
    """Issue 56's targets, judged on the server part's rows."""
    lines = []

    def add(name, measured, met):
        lines.append(
            f"| {name} | {measured} | "
            f"{'yes' if met else 'no' if met is not None else 'not measured'} |"
        )

    busy = find(server, case="busy")
    share = busy["output_throughput"] / busy["raw_decode_tokens_per_s"] if busy else None
    add(
        "server (busy): output throughput >= 85% of the raw decode of its slots",
        f"{busy['output_throughput']:.0f} vs {busy['raw_decode_tokens_per_s']:.0f} tokens/s = "
        f"{share:.0%}"
        if busy
        else "",
        share >= 0.85 if busy else None,
    )
    spread = busy["p99_itl_ms"] / busy["median_itl_ms"] if busy and busy["median_itl_ms"] else None
    add(
        "server (busy): p99 inter-token latency <= 3x its median",
        f"{busy['p99_itl_ms']:.1f} vs {busy['median_itl_ms']:.1f} ms = {spread:.1f}x"
        if spread
        else "",
        spread <= 3 if spread else None,
    )
    full, snap = find(server, case="long-full"), find(server, case="long-snapkv")
    ratio = snap["output_throughput"] / full["output_throughput"] if full and snap else None
    add(
        "server, long prompts, the same cache memory: SnapKV >= 8x the full cache's output "
        "throughput",
        f"{snap['output_throughput']:.0f} vs {full['output_throughput']:.0f} tokens/s = "
        f"{ratio:.1f}x"
        if ratio
        else "",
        ratio >= 8 if ratio else None,
    )
    return lines


def meta_lines(meta: dict, run: str = "") -> list[str]:
    lines = []
    for part, m in meta.items():
        if part == "peer" or not isinstance(m, dict):
            continue
        lines.append(
            f"- {run}{part}: {m.get('device', '')} · jax {m.get('jax', '')} · "
            f"{m.get('started', '')} · "
            f"{m.get('seconds', 0):.0f} s{' · exit ' + m['exit'] if 'exit' in m else ''}"
        )
        if why := m.get("decode_attention"):
            lines.append(f"- {run}{part}'s decode attention: {why}")
        if ceilings := m.get("ceilings"):
            lines.append(
                f"- {run}ceilings: copy {ceilings['copy_gb_s']:.0f} GB/s counting bytes read and "
                "written, "
                f"bf16 {ceilings['matmul_n']}³ matmul {ceilings['matmul_tflops']:.0f} TFLOP/s"
            )
    return lines


def render(merged: dict, runs: list[str] | None = None) -> str:
    head = ["## kvjax on a GPU", ""]
    if runs:
        for run in runs:
            head += meta_lines(merged["meta"][run], f"{run} · ")
    else:
        head += meta_lines(merged["meta"])
    r = view(merged)
    lines = (
        head
        + [""]
        + kernels_part.tables(r)
        + layers_part.tables(r)
        + model_part.tables(r)
        + serve_part.tables(r)
        + server_part.tables(r)
        + peer_table(merged["parts"].get("peer", {}))
        + targets(merged)
    )
    return "\n".join(lines)


def write(out: Path) -> str:
    """One run's report, from its parts' files."""
    merged = load(out)
    (out / "results.json").write_text(json.dumps(merged, indent=1, default=str))
    text = render(merged)
    (out / "results.md").write_text(text + "\n")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "runs", type=Path, nargs="+", help="run folders (OUT of run.py, or committed results)"
    )
    parser.add_argument(
        "--dest", type=Path, help="the combined report's Markdown file (several runs)"
    )
    args = parser.parse_args(argv)
    if len(args.runs) == 1 and args.dest is None:
        print(write(args.runs[0]))
        return 0
    names = [p.name for p in args.runs]
    merged = combine([load(p) for p in args.runs], names)
    text = render(merged, names)
    if args.dest:
        args.dest.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
