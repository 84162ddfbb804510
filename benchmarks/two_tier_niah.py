"""MiKV's second tier, measured before it is built: at equal memory, KVzip (global) keeping its
highest-ranked tokens in 8 bits and the next-ranked ones in 4 bits, against one tier (int8 or int4
alone) and kvpress's default ``KVzipPress()``, on the prose needles of kv_dtype_niah.py
(sentence-number, 2K tokens of license prose, 48 samples, query-agnostic).

    .venv/bin/python benchmarks/two_tier_niah.py                 # about 25 minutes on 2 cores
    .venv/bin/python benchmarks/two_tier_niah.py --table-only    # the table from the rows

A simulation of what a two-tier cache's attention reads: each batch of prompts is prefilled into a
float32 cache and compressed by kvjax's KVzip (global) to N1 + N2 slots per KV head (one tier of
N1 + N2 keeps the same tokens: the next-ranked N2 are those a second tier would hold). Each kept
token's key and value are then replaced by their round trip through the first tier's format (the
N1 · L · Hk highest eviction keys of the row over all layers and KV heads, as the global allocation
ranks them; the sinks and window among them) or the second's (``kvjax.kernels.quantized``: quantize,
then the values the quantized cache's attention reads), and the question is appended and answered
without eviction. Where that differs from a built cache: KVzip scores the float32 keys and values,
not the quantized ones, and the question's and answer's tokens stay in float32. The one-tier rows
("int8, simulated", "int4, simulated") against kv_dtype_niah.py's rows of the built cache
("… built") say what that changes. Memory is counted as in kv_dtype_niah.py: B bfloat16 slots per
KV head are the bytes of B tokens' keys and values in bfloat16, scales included for the quantized
tiers. Rows go to ``--out``/rows.jsonl (resumable), the table to table.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "kvpress_baseline"))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from kvjax.kernels.quantized import bytes_per_token, quantize, values  # noqa: E402
from prose_niah import paired_rows, read_scores, right_cell, setting_samples  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kvjax  # noqa: E402
from kvjax.eval.niah import make_samples, score  # noqa: E402
from kvjax.eviction.priority import eviction_keys  # noqa: E402
from kvjax.runtime.options import with_tokenizer  # noqa: E402

SETTING = "query-agnostic"
SCORER = "global+kvzip"
KVPRESS = "kvpress:kvzip_global"  # kvpress's KVzipPress() rows in --baseline
BATCH = 8


@dataclasses.dataclass(frozen=True)
class Tiers:
    """N1 tokens per KV head (on average over the row's heads) in ``first``, then N2 in
    ``second`` (None: one tier), ``share`` of the bytes in the first."""

    first: str
    n1: int
    second: str | None = None
    n2: int = 0
    share: str = "all"

    @property
    def label(self) -> str:
        """Its rows' label: formats and counts."""
        if self.second is None:
            return f"kvzip {self.first}, simulated"
        return f"kvzip {self.first} {self.n1} + {self.second} {self.n2}"

    @property
    def name(self) -> str:
        """Its name in the table: formats and shares of the bytes."""
        if self.second is None:
            return f"kvzip {self.first}, one tier (simulated)"
        return f"kvzip {self.first} + {self.second}, {self.share} of the bytes in {self.first}"


def tier_plans(head_dim: int, bf16_slots: int) -> list[Tiers]:
    """One tier of int8 and of int4 at the bytes of ``bf16_slots`` bfloat16 slots, and int8 + int4
    with a quarter, half and three quarters of the bytes in int8."""
    total = bf16_slots * bytes_per_token(head_dim, 2, None)
    b8, b4 = bytes_per_token(head_dim, 2, "int8"), bytes_per_token(head_dim, 2, "int4")
    plans = [Tiers("int8", total // b8), Tiers("int4", total // b4)]
    for share, text in ((0.25, "a quarter"), (0.5, "half"), (0.75, "three quarters")):
        n1 = int(share * total) // b8
        plans.append(Tiers("int8", n1, "int4", (total - n1 * b8) // b4, text))
    return plans


def two_tier(context, plan: Tiers):
    """``context`` (compressed to ``plan.n1 + plan.n2`` slots per head) with each kept token's key
    and value replaced by their round trip through its tier's format."""
    cache, policy = context.cache, context.ev.policy
    if policy.reads_kv or cache.stats is not None:
        raise ValueError(f"{policy.name}: the tiers are ranked by a scorer's state alone")
    seen = jnp.asarray(context.lengths)
    key = jax.vmap(lambda s, q, o: eviction_keys(policy, s, q, None, None, o, None, seen)[0])(
        cache.state, cache.pos, cache.order
    )
    L, B, Hk, C = cache.pos.shape
    valid = cache.pos >= 0
    flat = jnp.where(valid, key, -jnp.inf).transpose(1, 0, 2, 3).reshape(B, -1)
    rank = jnp.argsort(jnp.argsort(-flat, axis=-1, stable=True), axis=-1)  # 0 = highest key
    first = (rank < plan.n1 * L * Hk).reshape(B, L, Hk, C).transpose(1, 0, 2, 3) & valid
    if not (first.sum((0, 2, 3)) == jnp.minimum(plan.n1 * L * Hk, valid.sum((0, 2, 3)))).all():
        raise RuntimeError(f"{plan.label}: the first tier does not hold N1 · L · Hk tokens a row")

    P = cache.k_pages.shape[2]
    slot = jnp.arange(C)
    page = jnp.take_along_axis(cache.table, jnp.broadcast_to(slot // P, (L, B, Hk, C)), -1)
    offset = jnp.broadcast_to(slot % P, (L, B, Hk, C))
    row = jnp.arange(B)[None, :, None, None]

    def round_trip(pages):
        x = pages[row, page, offset]  # [L, B, Hk, C, K]
        new = values(quantize(x, plan.first))
        if plan.second is not None:
            new = jnp.where(first[..., None], new, values(quantize(x, plan.second)))
        dropped = jnp.where(valid, page, pages.shape[1])  # empty slots: out of range, not written
        return pages.at[row, dropped, offset].set(new.astype(pages.dtype), mode="drop")

    cache = cache.replace(k_pages=round_trip(cache.k_pages), v_pages=round_trip(cache.v_pages))
    return dataclasses.replace(context, cache=cache)


def run(params, tokenizer, samples, plans: dict, path: str) -> None:
    """Answer every (sample, plan) not in ``path`` yet; plans: bf16 slots -> [Tiers]."""
    done = set()
    if os.path.exists(path):
        done = {(r["sample"], r["label"], r["bf16_slots"]) for r in map(json.loads, open(path))}
    jobs = [(s, b, t) for b, ts in plans.items() for t in ts for s in samples]
    todo = [j for j in jobs if (j[0].id, j[2].label, j[1]) not in done]
    bar = tqdm(total=len(todo), desc="two tiers", unit="answer")
    with open(path, "a") as f:
        for i in range(0, len(samples), BATCH):
            group = samples[i : i + BATCH]
            mine = [j for j in todo if j[0] in group]
            if not mine:
                continue
            prefilled = kvjax.prefill_full(params, [list(s.prompt) for s in group])
            upto = [len(s.context) for s in group]
            questions = [list(s.question) for s in group]
            for b, ts in plans.items():
                for plan in ts:
                    if not any(j[1] == b and j[2] == plan for j in mine):
                        continue
                    eviction = with_tokenizer(tokenizer, scorer=SCORER, budget=plan.n1 + plan.n2)
                    context = prefilled.compress(upto=upto, **eviction)
                    context = two_tier(context, plan)
                    answers = kvjax.decode(
                        params, context, questions, group[0].max_new_tokens, evict=False
                    )
                    for sample, answer in zip(group, answers, strict=True):
                        text = tokenizer.decode(answer, skip_special_tokens=True)
                        row = dict(
                            sample=sample.id,
                            label=plan.label,
                            bf16_slots=b,
                            n1=plan.n1,
                            n2=plan.n2,
                            prediction=text,
                            score=score(text, sample.answers),
                        )
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        bar.update()
    bar.close()


def table(samples, path: str, plans: dict, baseline: str, quantized: str) -> str:
    """Markdown: the slots of each plan, right answers per plan and memory beside the built cache's
    and kvpress's rows, and the paired sign tests."""
    ids = [s.id for s in samples]
    answers = {s.id: s.answers for s in samples}
    names = {(t.label, b): t.name for b, ts in plans.items() for t in ts}
    found: dict = {}
    for r in map(json.loads, open(path)):
        name = names.get((r["label"], r["bf16_slots"]))
        if r["sample"] in answers and name:
            found.setdefault((name, r["bf16_slots"]), {})[r["sample"]] = r["score"]
            found.setdefault((name, r["bf16_slots"], "text"), {})[r["sample"]] = r["prediction"]
    built = read_scores(samples, quantized, "/nonexistent")
    press = read_scores(samples, "/nonexistent", baseline)
    budgets = list(plans)
    for b, ts in plans.items():
        for kind in ("int8", "int4"):
            n = next(t.n1 for t in ts if t.first == kind and t.second is None)
            for part in ((), ("text",)):
                if (f"kvzip {kind}", n, *part) in built:
                    found[(f"kvzip {kind}, built", b, *part)] = built[(f"kvzip {kind}", n, *part)]
        for part in ((), ("text",)):
            if (KVPRESS, b, *part) in press:
                found[("kvpress KVzipPress()", b, *part)] = press[(KVPRESS, b, *part)]
    first = plans[budgets[0]]
    labels = [t.name for t in first] + [
        "kvzip int8, built",
        "kvzip int4, built",
        "kvpress KVzipPress()",
    ]
    head = " | ".join(f"bytes of {b} bf16 slots" for b in budgets)
    lines = ["Slots per KV head (first tier + second tier) at each memory:", ""]
    lines += [
        f"- {t.name}: "
        + ", ".join(
            str(u.n1) + (f" + {u.n2}" if u.second else "")
            for b in budgets
            for u in plans[b]
            if u.name == t.name
        )
        for t in first
    ]
    lines += [
        "",
        f"**{SETTING}** ({len(ids)} samples; right answers, Wilson 95% interval)",
        "",
        f"| method | {head} |",
        "| --- |" + " ---: |" * len(budgets),
    ]
    for name in labels:
        cells = [right_cell(found.get((name, b), {}), ids) for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    one = [t.name for t in first if t.second is None]
    pairs = [(t.name, other) for t in first if t.second for other in one]
    pairs += [(t.name, "kvpress KVzipPress()") for t in first if t.second]
    pairs += [(t.name, t.name.replace("one tier (simulated)", "built")) for t in first]
    pairs = [(a, b) for a, b in pairs if a != b]
    lines += [
        "",
        "**Paired** (same samples and memory: wins / losses of the first against the second, "
        "two-sided sign test)",
        "",
        "| first | second | setting | memory (bf16 slots) | wins / losses | p | same prediction |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += paired_rows(found, pairs, {SETTING: ids}, budgets)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="docs/results/two_tier_niah")
    parser.add_argument("--baseline", default="docs/results/kvzip_global_2k/kvpress_rows.jsonl")
    parser.add_argument("--quantized", default="docs/results/kv_dtype_niah/kvjax_rows.jsonl")
    parser.add_argument("--bytes-of", type=int, nargs="+", default=[128])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tokenizer = kvjax.load_tokenizer("smollm2-135m-instruct")
    samples = [
        s
        for s in setting_samples(
            make_samples(tokenizer, ["sentence-number"], ["licenses"], [2048], args.samples)
        )
        if s.id.endswith(SETTING)
    ]
    params = kvjax.load("smollm2-135m-instruct")
    plans = {b: tier_plans(params.config.head_dim, b) for b in args.bytes_of}
    path = os.path.join(args.out, "rows.jsonl")
    if not args.table_only:
        run(params, tokenizer, samples, plans, path)
    text = table(samples, path, plans, args.baseline, args.quantized)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
