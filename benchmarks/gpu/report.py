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
import re
from pathlib import Path

import kernels_part
import layers_part
import model_part
import serve_part
import server_part
from common import SPEC_GB_S, Results

PEERS = ("peer", "kvpress")  # parts whose file is one object of the peer script's, not rows


def load(out: Path) -> dict:
    """One run: its parts' files, or (a committed run) its results.json."""
    if not (out / "parts").is_dir():
        return json.loads((out / "results.json").read_text())
    merged = {"meta": {}, "parts": {}}
    for path in sorted((out / "parts").glob("*.json")):
        data = json.loads(path.read_text())
        merged["meta"][path.stem] = data.get("meta", {})
        if path.stem in PEERS:
            merged["parts"][path.stem] = data
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


def mode(row: dict) -> str:
    """A transformers row's mode ("eager" where the row has none: calls 1–4)."""
    return row.get("mode", "eager")


def ratio_cell(ours: dict | None, theirs: dict) -> tuple[str, str]:
    """kvjax's tokens/s and its ratio to the peer row's, or blanks."""
    if not ours or "tokens_per_s" not in theirs:
        return "", ""
    return f"{ours['tokens_per_s']:.0f}", f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}"


def peer_table(peer: dict, parts: dict) -> list[str]:
    """transformers' rows, eager then compiled, each beside kvjax's full cache at its shape."""
    if not peer:
        return []
    if "error" in peer and not peer.get("decode") and not peer.get("prefill"):
        return ["### transformers (torch) on the same card", "", f"not run: {peer['error']}", ""]
    prefill, decode = parts.get("prefill", []), parts.get("decode", [])
    compiled = (
        f"; compiled: `{peer['compile']}`, its warm-up (the compile, the CUDA graph's recording) "
        'in "compile s"'
        if "compile" in peer
        else " (no compiled rows before call 5)"
    )
    lines = [
        f"### transformers {peer.get('transformers')} (torch {peer.get('torch')}, sdpa, "
        f"StaticCache) on {peer.get('device_name')}, beside kvjax's full cache",
        "",
        f"eager: as in calls 1–4{compiled}. kvjax: the model part's full-cache row at the same "
        "shape.",
        "",
        "| what | mode | context | batch | tokens/s | ms/step | compile s | kvjax tokens/s | "
        "kvjax / transformers |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in peer.get("prefill", []):
        ours = find(prefill, cache="full", impl="default", context=r["context"])
        cell = r.get("error", "")[:200] or f"{r['tokens_per_s']:.0f}"
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else ""
        lines.append(
            f"| prefill | {mode(r)} | {r['context']} | 1 | {cell} | | {compile_s} | "
            + " | ".join(ratio_cell(ours, r))
            + " |"
        )
    for r in peer.get("decode", []):
        head = f"| decode | {mode(r)} | {r['context']} | {r['batch']} |"
        if "error" in r:
            lines.append(f"{head} {r['error'][:200]} | | | | |")
            continue
        ours = find(
            decode,
            cache="full",
            impl="default",
            context=r["context"],
            batch=r["batch"],
            largest_batch=None,
        )
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else ""
        lines.append(
            f"{head} {r['tokens_per_s']:.0f} | {r['ms_per_step']:.2f} | {compile_s} | "
            + " | ".join(ratio_cell(ours, r))
            + " |"
        )
    if "stopped" in peer:
        lines += ["", f"Stopped {peer['stopped']}."]
    if "error" in peer:
        lines += ["", f"The script: {peer['error']}."]
    return lines + [""]


def kvpress_table(kv: dict, parts: dict) -> list[str]:
    """kvpress's presses compressing a context, beside kvjax's prefills at the same budget."""
    if not kv:
        return []
    title = "### kvpress (KVzip, Expected Attention) on the same card"
    if "error" in kv and not kv.get("compress"):
        return [title, "", f"not run: {kv['error']}", ""]
    budget = kv.get("budget")
    lines = [
        f"### kvpress {kv.get('kvpress')} (transformers {kv.get('transformers')}, torch "
        f"{kv.get('torch')}, sdpa) on {kv.get('device_name')}: a context compressed to {budget} "
        "tokens per KV head",
        "",
        "One call `with press(model): model.model(ids, past_key_values=DynamicCache())`: the "
        'prefill and the press; its median over "timed" calls after a warm-up. '
        f"Stubbed (not installed, unused): {', '.join(kv.get('stubbed', [])) or 'none'}.",
        "",
        "| press | context | compression ratio | kept per head | s | tokens/s | timed | "
        "prefill alone s | press overhead s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in kv.get("compress", []):
        head = f"| {r['press']} | {r['context']} |"
        if "error" in r:
            lines.append(f"{head} {r['error'][:200]} | | | | | | |")
            continue
        prefill_s = f"{r['prefill_s']:.3f}" if "prefill_s" in r else ""
        overhead = f"{r['overhead_s']:.3f}" if "overhead_s" in r else ""
        lines.append(
            f"{head} {r['compression_ratio']:.5f} | {r['kept_per_head']:.1f} | "
            f"{r['seconds']:.3f} | {r['tokens_per_s']:.0f} | {r['timed']} | {prefill_s} | "
            f"{overhead} |"
        )
    # beside kvjax's: its KVzip and Expected Attention by kvjax.prefill at the same budget (the
    # model part's "compress" rows, from call 5 on), its full cache's prefill and block-wise SnapKV
    prefill, compress = parts.get("prefill", []), parts.get("compress", [])
    caches = ("full", f"snapkv {budget}")
    scorers = ("kvzip", "expected-attention")
    presses = sorted({r["press"] for r in kv.get("compress", [])}, reverse=True)
    lines += [
        "",
        "Tokens/s of context, kvjax (`kvjax.prefill` with KVzip and Expected Attention to the same "
        "budget; the model part's prefill of the full cache and block-wise SnapKV) beside "
        "kvpress's:",
        "",
        "| context | "
        + " | ".join(f"kvjax {c} {budget}" for c in scorers)
        + " | "
        + " | ".join(f"kvjax {c}" for c in caches)
        + " | transformers, no press | "
        + " | ".join(presses)
        + " |",
        "| ---: |" + " ---: |" * (len(scorers) + len(caches) + 1 + len(presses)),
    ]
    for context in sorted({r["context"] for r in kv.get("compress", [])}):
        ours = [find(compress, scorer=c, budget=budget, context=context) for c in scorers]
        ours += [find(prefill, cache=c, impl="default", context=context) for c in caches]
        plain = find(kv.get("prefill", []), context=context)
        theirs = [find(kv.get("compress", []), press=p, context=context) for p in presses]
        cells = [f"{r['tokens_per_s']:.0f}" if r else "" for r in [*ours, plain, *theirs]]
        lines.append(f"| {context} | " + " | ".join(cells) + " |")
    if "stopped" in kv:
        lines += ["", f"Stopped {kv['stopped']}."]
    if "error" in kv:
        lines += ["", f"The script: {kv['error']}."]
    return lines + [""]


def add(lines: list[str], name: str, measured: str, met: bool | None) -> None:
    """A target's row of a Targets table: met, not met, or not measured (None)."""
    lines.append(
        f"| {name} | {measured} | {'yes' if met else 'no' if met is not None else 'not measured'} |"
    )


def add_ratio(
    lines: list[str],
    name: str,
    ours: dict | None,
    theirs: dict | None,
    at_least: float,
    digits: int = 1,
    key: str = "tokens_per_s",
) -> None:
    """A target that ``ours[key]`` is at least ``at_least`` times ``theirs[key]`` (tokens/s), the
    measured cell "a vs b tokens/s = r x" (``digits`` decimals); not measured without both rows."""
    ratio = ours[key] / theirs[key] if ours and theirs else None
    add(
        lines,
        name,
        f"{ours[key]:.0f} vs {theirs[key]:.0f} tokens/s = {ratio:.{digits}f}x" if ratio else "",
        ratio >= at_least if ratio else None,
    )


def find(rows, **match):
    return next(
        (r for r in rows if all(r.get(k) == v for k, v in match.items()) and "error" not in r), None
    )


def targets(merged: dict) -> list[str]:
    """The targets of issues 33, 59 and 56, each with the figures it was judged on."""
    parts = merged["parts"]
    decode, serve, peer = parts.get("decode", []), parts.get("serve", []), parts.get("peer", {})
    contexts = sorted({r["context"] for r in decode if "context" in r})
    lines = ["### Targets", "", "| target | measured | met |", "| --- | --- | --- |"]

    if not contexts:
        add(lines, "decode", "no decode rows", None)
        return lines + server_targets(parts.get("server", [])) + [""]
    c4, c32 = contexts[0], contexts[-1]
    snaps = sorted(  # "snapkv N" itself, not its variants ("snapkv N int8", "… every 16", …)
        {r["cache"] for r in decode if re.fullmatch(r"snapkv \d+", r.get("cache", ""))},
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
            # judged on the copy rate's floor; the read rate's beside it (absent before call 5)
            read = (
                f" (read floor {r['read_floor_ms']:.2f} ms: {r['step_over_read_floor']:.2f}x)"
                if r and "read_floor_ms" in r
                else ""
            )
            add(
                lines,
                f"batch-1 decode within 1.3x of its floor ({cache}, {c4}{how})",
                f"{r['ms_per_step']:.2f} ms vs floor {r['floor_ms']:.2f} ms = "
                f"{r['step_over_floor']:.2f}x{read}"
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
        add_ratio(
            lines, f"batch-{big} decode throughput >= 20x batch 1 ({cache}, {c4})", many, one, 20
        )
    full = find(decode, cache="full", context=c32, largest_batch=True)
    budget = find(decode, cache=snap, context=c32, largest_batch=True)
    ratio = budget["tokens_per_s"] / full["tokens_per_s"] if full and budget else None
    add(
        lines,
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
    peer_decode = peer.get("decode", [])
    for how in ("eager", "compiled"):
        if how == "compiled" and not any(mode(r) == how for r in peer_decode):
            continue  # no compiled row before call 5
        theirs = find([r for r in peer_decode if mode(r) == how], context=c4, batch=mid)
        for cache in ("full", snap):
            ours = find(decode, cache=cache, impl="default", context=c4, batch=mid)
            add_ratio(
                lines,
                f"kvjax ({cache}) decode >= transformers ({how}) at batch {mid}, {c4}",
                ours,
                theirs,
                1,
                digits=2,
            )
    one = next((r for r in serve if r.get("slots") == 1 and "tokens_per_s" in r), None)
    many = next((r for r in serve if r.get("slots", 1) > 1 and "tokens_per_s" in r), None)
    add_ratio(
        lines,
        f"serving with {many['slots'] if many else 32} slots >= 8x one at a time",
        many,
        one,
        8,
    )
    lines += decode_targets(parts, snap, c4, c32, big)
    return lines + server_targets(parts.get("server", [])) + [""]


def decode_targets(parts: dict, snap: str, c4: int, c32: int, big: int | None) -> list[str]:
    """Issue 59's targets: each evicting decode near its floor at the largest batch of the plan
    (every step, and evicting every ``model_part.EVERY`` steps beside it: an option, not the
    target's default), SnapKV at its largest batch at 32K, batch 1 against the read rate's floor,
    block-wise prefill against the full cache's at 32K, compiled transformers at batch 1, and
    kvpress's compression at 32K."""
    lines = []

    decode, prefill = parts.get("decode", []), parts.get("prefill", [])
    budget = snap.split()[1]

    def over(r, key="step_over_floor", floor="floor_ms"):
        return f"{r['ms_per_step']:.2f} ms vs floor {r[floor]:.2f} ms = {r[key]:.2f}x" if r else ""

    for scorer in ("snapkv", "momentkv", "adakv", "expected-attention"):
        for every in ("", f" every {model_part.EVERY}"):
            cache = f"{scorer} {budget}{every}"
            r = find(decode, cache=cache, impl="default", context=c4, batch=big)
            add(
                lines,
                f"batch-{big} decode within 1.3x of its floor ({cache}, {c4})",
                over(r),
                r and r["step_over_floor"] <= 1.3,
            )
    r = find(decode, cache=snap, context=c32, largest_batch=True)
    add(
        lines,
        f"{c32}: {snap} at its largest batch within 1.5x of its floor",
        f"batch {r['batch']}: {over(r)}" if r else "",
        r["step_over_floor"] <= 1.5 if r else None,
    )
    for cache in ("full", snap):
        r = find(decode, cache=cache, impl="default", context=c4, batch=1)
        r = r if r and "read_floor_ms" in r else None
        add(
            lines,
            f"batch-1 decode within 1.2x of the read rate's floor ({cache}, {c4})",
            over(r, "step_over_read_floor", "read_floor_ms"),
            r["step_over_read_floor"] <= 1.2 if r else None,
        )
    full = find(prefill, cache="full", impl="default", context=c32)
    blockwise = [
        r
        for r in prefill
        if r.get("context") == c32
        and r.get("impl") == "default"
        and "error" not in r
        and (r["cache"] == snap or r["cache"].startswith(f"{snap} block "))
    ]
    best = max(blockwise, key=lambda r: r["tokens_per_s"], default=None)
    add(
        lines,
        f"{c32}: block-wise prefill ({snap}) >= the full cache's",
        ", ".join(f"{r['cache']} {r['tokens_per_s']:.0f}" for r in blockwise)
        + f" vs full {full['tokens_per_s']:.0f} tokens/s"
        if best and full
        else "",
        best["tokens_per_s"] >= full["tokens_per_s"] if best and full else None,
    )
    compiled = [r for r in parts.get("peer", {}).get("decode", []) if mode(r) == "compiled"]
    theirs = find(compiled, context=c4, batch=1)
    ours = find(decode, cache="full", impl="default", context=c4, batch=1)
    add_ratio(
        lines,
        f"kvjax (full) decode >= transformers (compiled) at batch 1, {c4}",
        ours,
        theirs,
        1,
        digits=2,
    )
    kv = parts.get("kvpress", {})
    for scorer, press in (
        ("kvzip", "KVzipPress"),
        ("expected-attention", "ExpectedAttentionPress"),
    ):
        ours = find(parts.get("compress", []), scorer=scorer, context=c32)
        theirs = find(kv.get("compress", []), press=press, context=c32)
        add_ratio(
            lines,
            f"{c32}: kvjax.prefill ({scorer}) compresses faster than kvpress's {press}",
            ours,
            theirs,
            1,
            digits=2,
        )
    return lines


def server_targets(server: list[dict]) -> list[str]:
    """Issue 56's targets, judged on the server part's rows."""
    lines = []

    busy = find(server, case="busy")
    share = busy["output_throughput"] / busy["raw_decode_tokens_per_s"] if busy else None
    add(
        lines,
        "server (busy): output throughput >= 85% of the raw decode of its slots",
        f"{busy['output_throughput']:.0f} vs {busy['raw_decode_tokens_per_s']:.0f} tokens/s = "
        f"{share:.0%}"
        if busy
        else "",
        share >= 0.85 if busy else None,
    )
    spread = busy["p99_itl_ms"] / busy["median_itl_ms"] if busy and busy["median_itl_ms"] else None
    add(
        lines,
        "server (busy): p99 inter-token latency <= 3x its median",
        f"{busy['p99_itl_ms']:.1f} vs {busy['median_itl_ms']:.1f} ms = {spread:.1f}x"
        if spread
        else "",
        spread <= 3 if spread else None,
    )
    full, snap = find(server, case="long-full"), find(server, case="long-snapkv")
    add_ratio(
        lines,
        "server, long prompts, the same cache memory: SnapKV >= 8x the full cache's output "
        "throughput",
        snap,
        full,
        8,
        key="output_throughput",
    )
    return lines


def meta_lines(meta: dict, run: str = "") -> list[str]:
    lines = []
    for part, m in meta.items():
        if part in PEERS or not isinstance(m, dict):
            continue
        lines.append(
            f"- {run}{part}: {m.get('device', '')} · jax {m.get('jax', '')} · "
            f"{m.get('started', '')} · "
            f"{m.get('seconds', 0):.0f} s{' · exit ' + m['exit'] if 'exit' in m else ''}"
        )
        if why := m.get("decode_attention"):
            lines.append(f"- {run}{part}'s decode attention: {why}")
        if ceilings := m.get("ceilings"):
            lines.append(f"- {run}ceilings: {ceilings_text(ceilings, m.get('device', ''))}")
    return lines


def ceilings_text(ceilings: dict, device: str) -> str:
    """The copy rate and the read rate (the floors' two divisors; the read rate absent before call
    5), the device's specified bandwidth where SPEC_GB_S knows it, and the matrix rate."""
    text = f"copy {ceilings['copy_gb_s']:.0f} GB/s counting bytes read and written, "
    read = ceilings.get("read_gb_s")
    if read:
        text += f"read {read:.0f} GB/s (a sum over the same array, bytes read)"
    else:
        text += "read rate not measured (before call 5)"
    name = next((n for n in SPEC_GB_S if n in device), None)
    if name:
        text += f"; the {name}'s specification: {SPEC_GB_S[name] / 1e3:.1f} TB/s"
        text += f" (read at {read / SPEC_GB_S[name]:.0%} of it)" if read else ""
    return text + f"; bf16 {ceilings['matmul_n']}³ matmul {ceilings['matmul_tflops']:.0f} TFLOP/s"


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
        + peer_table(merged["parts"].get("peer", {}), merged["parts"])
        + kvpress_table(merged["parts"].get("kvpress", {}), merged["parts"])
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
