"""``python -m kvjax eval niah|ppl|fidelity``: the evaluation suite's command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvjax.eval.haystack import HAYSTACKS
from kvjax.eval.niah import TASKS
from kvjax.eval.sweep import SETTINGS
from kvjax.extras import require
from kvjax.runtime.inputs import check_count
from kvjax.runtime.options import DEFAULTS, NAMES, add_arguments, from_arguments

# The evaluations sweep these (--budgets, --scorers, --protocols).
SWEPT = ("budget", "scorer", "protocol")
# The eviction keywords every run shares.
SHARED = tuple(name for name in NAMES if name not in SWEPT)

# The tasks and haystacks on which SmolLM2-135M answers with the full cache (word values and the
# multi-value task defeat the full cache itself; see docs/results.md).
RELIABLE = dict(tasks=["single-number", "single-uuid", "multikey"], haystacks=["filler", "pydoc"])
# Seconds per unit of work, from which ``estimate`` and ``estimate_seconds`` predict a run's time
# (``--dry-run``): sample, per sample and 1K tokens, its shared full prefill and full-cache answer;
# answer, per answer under the prefill protocol; mi, the same with moment-informed eviction batched
# by 128; blockwise, per 1K tokens block-wise; kvzip_pass, per sample's KVzip scoring pass at 1K
# (scaled by length^1.53); compile, the first answer of each method; ppl_token, per token of
# decoding-time eviction (``eval ppl``); fidelity, per fidelity run (scorer, budget and prompt, with
# its share of the compilation). Where the figures come from: docs/performance.md.
COST = dict(
    sample=2.6,
    answer=0.75,
    mi=2.4,
    blockwise=2.3,
    kvzip_pass=4.3,
    compile=2.5,
    ppl_token=0.052,
    fidelity=4.0,
)


def _versus(paper: str, bases: dict, modifiers: tuple, protocol: str = "prefill") -> dict:
    """A preset's methods and claims: every base plain and with every modifier (the base's options
    for all, so a pair differs in the modifier alone), each modified method claimed better than its
    plain base."""
    tag = "" if protocol == "prefill" else f" ({protocol})"
    methods, claims = [], []
    for base, options in bases.items():
        names = [base] + [f"{base}+{m}" for m in modifiers]
        methods += [
            dict(name=name + tag, scorer=name, protocol=protocol, **options) for name in names
        ]
        claims += [
            (f"{paper}: {name}{tag} vs {base}{tag}", base + tag, name + tag) for name in names[1:]
        ]
    return dict(methods=methods, claims=claims)


# The seed papers' own claims, each method against its base on the same 24 samples per cell (3 tasks
# × 2 haystacks × 4 depths) at two budgets; <out>/paired.md holds the paired tables. ``eval seeds``
# runs all four with the perplexity and fidelity parts (``kvjax.eval.seeds``); ``--dry-run`` prints
# the count and estimate.
SEEDS = dict(budgets=[256, 512], lengths=[1024], samples=4, settings=["query-aware"], **RELIABLE)
H2O_16 = {"h2o-window": dict(obs_window=16)}  # OBCache's and CAOTE's H2O (docs/eviction.md)
# OBCache's prefill baselines (App. C.2.1): H2O and SnapKV score with the last 16 queries and keep
# them as the recent window, TOVA gives its whole budget to its scores; no sinks (C.2.1 names none:
# its 4 sinks are the decoding setup of C.2.2).
OBCACHE_BASES = {
    "h2o-window": dict(obs_window=16, n_sink=0),
    "tova": dict(n_sink=0),
    "snapkv": dict(obs_window=16, n_sink=0),
}
PRESETS = {
    # The standard sweep behind docs/results.md (MomentKV with its batched eviction: see README).
    "standard": dict(
        scorers=[
            "streamingllm",
            "h2o",
            "tova",
            "snapkv",
            "snapkv+obcache-value",
            "snapkv+obcache-key",
            "snapkv+obcache-joint",
            "snapkv+caote",
            "snapkv+fastcaote",
            "momentkv",
            "kvzip",
            "expected-attention",
        ],
        budgets=[64, 128, 256, 512, 1024],
        lengths=[1024, 2048, 4096],
        samples=1,
        protocols=["prefill"],
        mi_batch=128,
        **RELIABLE,
    ),
    # A few minutes: everything runs, the full cache answers, the budgets bite.
    "smoke": dict(
        scorers=["streamingllm", "tova", "snapkv"],
        budgets=[128, 512],
        lengths=[1024],
        samples=1,
        protocols=["prefill"],
        **RELIABLE,
    ),
    # KVzip's setting: the question arrives after compression. 24 samples per length (3 tasks × 2
    # haystacks × 4 depths); the non-uniform allocations and KVzip against SnapKV and the
    # layer-averaged TOVA.
    "kvzip": dict(
        methods=[
            dict(name="snapkv", scorer="snapkv"),
            dict(name="tova (layer)", scorer="tova", aggregate="layer"),
            dict(name="adakv", scorer="adakv"),
            dict(name="pyramidkv", scorer="pyramidkv", n_sink=0),
            dict(
                name="adakv+momentkv (paper)",
                scorer="adakv+snapkv+momentkv",
                n_sink=1,
                chunk=4,
                mi_batch=128,
            ),
            dict(name="kvzip (global)", scorer="kvzip"),
            dict(name="kvzip (layer-wise)", scorer="adakv+kvzip"),
            dict(name="kvzip (uniform)", scorer="uniform+kvzip"),
        ],
        budgets=[64, 128, 256, 512],
        lengths=[2048, 4096],
        samples=4,
        settings=["query-agnostic"],
        **RELIABLE,
    ),
    # Numbers that come back half right (docs/eviction.md): SnapKV with and without chunk-level
    # selection or a wide pooling kernel on 7-digit needles, the question inside the compressed
    # prompt; 24 samples per length (2 haystacks × 12 depths).
    "digits": dict(
        methods=[
            dict(name="snapkv", scorer="snapkv"),
            dict(name="snapkv chunk=8", scorer="snapkv", chunk=8),
            dict(name="snapkv chunk=16", scorer="snapkv", chunk=16),
            dict(name="snapkv kernel=31", scorer="snapkv", kernel=31),
        ],
        budgets=[128, 256],
        lengths=[1024, 2048],
        samples=12,
        settings=["query-aware"],
        tasks=["single-number"],
        haystacks=["filler", "pydoc"],
    ),
    # OBCache: its three saliencies over H2O (prefill variant), TOVA and SnapKV in its App. C.2.1
    # setting. 600 answers.
    "seeds-obcache": _versus(
        "OBCache", OBCACHE_BASES, ("obcache-value", "obcache-key", "obcache-joint")
    )
    | SEEDS,
    # CAOTE: its meta-score over the same bases, under its block-wise protocol. 456 answers.
    "seeds-caote": _versus(
        "CAOTE", H2O_16 | {"tova": {}, "snapkv": {}}, ("caote", "fastcaote"), "blockwise"
    )
    | SEEDS
    | dict(block_size=128),
    # MomentKV: each part of it over SnapKV (kvjax's defaults) and over AdaKV in the paper's setting
    # (n_sink=1, chunk=4), moment-informed eviction batched by 128 tokens; at 2K (AdaKV's compress
    # fails at 1K for a budget of 512: one head may take 3 × 512 slots, more than the 1K prompt's
    # cache). 504 answers.
    "seeds-momentkv": _versus(
        "MomentKV",
        {"snapkv": {}, "adakv+snapkv": dict(n_sink=1, chunk=4)},
        ("momentkv-mi", "momentkv-nc", "momentkv", "momentkv-zeroth"),
    )
    | SEEDS
    | dict(lengths=[2048], mi_batch=128),
    # KVzip: the question after compression, against SnapKV, TOVA and kvpress's TOVA, at 1K with
    # budgets of 1/8 and 1/4 of the prompt (KVzip reports by ratio; the kvzip preset runs 2K and
    # 4K). 216 answers.
    "seeds-kvzip": SEEDS
    | dict(
        methods=[
            dict(name="snapkv", scorer="snapkv"),
            dict(name="tova", scorer="tova"),
            dict(name="tova (layer)", scorer="tova", aggregate="layer"),
            dict(name="kvzip", scorer="kvzip"),
        ],
        claims=[
            (f"KVzip: kvzip vs {base}", base, "kvzip")
            for base in ("snapkv", "tova", "tova (layer)")
        ],
        budgets=[128, 256],
        settings=["query-agnostic"],
    ),
}


def preset_methods(preset: dict, budgets) -> list:
    """The methods of a preset that names its own (a name, a scorer, optionally a protocol, default
    "prefill", and eviction options each), at every budget."""
    from kvjax.eval.sweep import FULL, Method

    found = [Method(FULL, None, "-")]
    for spec in preset["methods"]:
        options = tuple(
            sorted((k, v) for k, v in spec.items() if k not in ("name", "scorer", "protocol"))
        )
        found += [
            Method(spec["scorer"], budget, spec.get("protocol", "prefill"), options, spec["name"])
            for budget in budgets
        ]
    return found


def estimate(methods: list, lengths, settings, per_length: int) -> tuple[int, float]:
    """(answers, seconds by ``COST``) of a sweep of ``methods`` over ``per_length`` samples at each
    length in every setting (the full cache once per sample; budgets that hold the prompt skipped,
    as ``sweep.run``)."""
    from kvjax.eval.sweep import FULL
    from kvjax.eviction import BASES, MODIFIERS, split_name

    def cost(m, length: int) -> float:
        modifier = split_name(m.scorer)[2]
        if m.protocol == "blockwise":
            return COST["blockwise"] * length / 1024
        return COST["mi"] if modifier and MODIFIERS[modifier].sequential_choice else COST["answer"]

    answers, seconds = 0, COST["compile"] * len(methods)
    full = sum(m.scorer == FULL for m in methods)
    for length in lengths:
        here = [m for m in methods if m.scorer != FULL and m.budget < length]
        passes = any(BASES[split_name(m.scorer)[1]].scoring_pass == "kvzip" for m in here)
        answers += per_length * (full + len(settings) * len(here))
        seconds += per_length * (
            COST["sample"] * length / 1024
            + len(settings)
            * (
                passes * COST["kvzip_pass"] * (length / 1024) ** 1.53
                + sum(cost(m, length) for m in here)
            )
        )
    return answers, seconds


def estimate_seconds(args) -> float:
    """Seconds by ``COST`` of the parsed ``eval`` command ``args`` (niah, ppl or fidelity)."""
    runs = len(args.scorers or []) * len(args.budgets or [])
    if args.evaluation == "ppl":
        return COST["ppl_token"] * args.length * runs + COST["compile"] * (runs + 1)
    if args.evaluation == "fidelity":
        return COST["fidelity"] * args.prompts * runs
    plan = _niah_plan(args)
    return estimate(plan["methods"], plan["lengths"], plan["settings"], plan["per_length"])[1]


def parse_eval(argv: list[str]):
    """The parsed arguments of ``python -m kvjax eval <argv>``."""
    parser = argparse.ArgumentParser(prog="python -m kvjax")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["eval", *argv])


def _shared_options(args, preset: dict | None = None) -> dict:
    """The shared eviction keywords: the preset's, overridden by those given on the command line."""
    return {
        name: value for name, value in (preset or {}).items() if name in SHARED
    } | from_arguments(args, SHARED)


def _niah_plan(args) -> dict:
    """What ``eval niah`` will run: the preset's settings overridden by the command line's,
    checked."""
    from kvjax.eval import sweep
    from kvjax.runtime.options import eviction_from, with_tokenizer

    preset = PRESETS[args.preset] if args.preset else {}
    pick = lambda name, default: getattr(args, name) or preset.get(name, default)  # noqa: E731
    budgets = pick("budgets", [128, 512])
    if "methods" in preset and not args.scorers:
        methods = preset_methods(preset, budgets)
    else:
        methods = sweep.methods(
            pick("scorers", ["snapkv"]), budgets, pick("protocols", ["prefill"])
        )
    options = _shared_options(args, preset)
    block_size = options.pop("block_size", DEFAULTS["block_size"])  # the blockwise runs' block
    for m in methods[1:]:  # bad names and settings fail before the model loads
        eviction_from(
            **with_tokenizer(
                None,
                budget=min(budgets),
                scorer=m.scorer,
                protocol=m.protocol,
                **sweep.scorer_options(m.scorer, options | dict(m.options)),
            )
        )
    tasks, haystacks, n = (
        pick("tasks", list(TASKS)),
        pick("haystacks", list(HAYSTACKS)),
        pick("samples", 2),
    )
    return dict(
        methods=methods,
        options=options,
        block_size=block_size,
        tasks=tasks,
        haystacks=haystacks,
        n=n,
        per_length=len(tasks) * len(haystacks) * n,
        lengths=pick("lengths", [1024, 2048, 4096]),
        settings=pick("settings", list(SETTINGS)),
        claims=preset.get("claims", []) if "methods" in preset and not args.scorers else [],
    )


def _niah(args) -> int:
    import kvjax
    from kvjax.eval import report, sweep
    from kvjax.eval.niah import make_samples

    plan = _niah_plan(args)
    methods, settings, claims = plan["methods"], plan["settings"], plan["claims"]
    if args.dry_run:
        answers, seconds = estimate(methods, plan["lengths"], settings, plan["per_length"])
        print(
            f"{answers} answers ({plan['per_length']} per method, budget, setting and length), "
            f"about {seconds / 60:.0f} minutes by kvjax.eval.cli.COST (measured on 2 idle cores); "
            "nothing run"
        )
        return 0
    require("eval", "kvjax eval (its accuracy plot)")  # before the sweep, not after it
    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    samples = make_samples(
        tokenizer, plan["tasks"], plan["haystacks"], plan["lengths"], plan["n"], args.seed
    )
    longest = max(len(s.prompt) + s.max_new_tokens for s in samples)
    if longest > params.config.max_seq_len:
        raise ValueError(
            f"--lengths {max(plan['lengths'])}: a prompt and its answer take {longest} tokens, "
            f"beyond the model's context of {params.config.max_seq_len}"
        )
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    rows = sweep.run(
        params,
        tokenizer,
        samples,
        methods,
        settings,
        out=os.path.join(args.out, "rows.jsonl"),
        options=plan["options"],
        block_size=plan["block_size"],
        batch=args.batch,
    )
    wall = time.perf_counter() - start
    title = f"NIAH on {args.model}"
    table = (
        report.markdown(rows, title) + "\n### Seconds per answer\n\n" + report.timing(rows) + "\n"
    )
    written = ["rows.jsonl", "table.md", "accuracy.png"]
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table)
    report.plot(rows, os.path.join(args.out, "accuracy.png"), title)
    if claims:
        with open(os.path.join(args.out, "paired.md"), "w") as f:
            f.write(
                report.paired_markdown(rows, claims, f"{title}: paired comparisons ({args.preset})")
                + "\n"
            )
        written.append("paired.md")
    print(table)
    print(
        f"[{len(rows)} answers; this run took {wall:.0f}s; results in {args.out}/ "
        f"({', '.join(written)})]",
        file=sys.stderr,
    )
    return 0


def _save_json(results: dict, out: str, name: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(results, f, indent=1)


def _ppl(args) -> int:
    import kvjax
    from kvjax.eval.perplexity import perplexity_table, run_perplexity

    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    results = run_perplexity(
        params,
        tokenizer,
        args.scorers or ["streamingllm", "h2o", "tova"],
        args.budgets or [256, 1024],
        length=args.length,
        options=_shared_options(args),
        window_edges=args.edges,
    )
    _save_json(results, args.out, "ppl.json")
    print(perplexity_table(results))
    return 0


def _fidelity(args) -> int:
    import kvjax
    from kvjax.eval.fidelity import fidelity_table, run_fidelity

    params = kvjax.load(args.model, dtype=args.dtype)
    tokenizer = kvjax.load_tokenizer(args.model)
    results = run_fidelity(
        params,
        tokenizer,
        args.scorers or ["streamingllm", "h2o", "tova", "snapkv"],
        args.budgets or [128, 512],
        length=args.length,
        continuation=args.continuation,
        prompts=args.prompts,
        options=_shared_options(args),
    )
    _save_json(results, args.out, "fidelity.json")
    print(fidelity_table(results))
    return 0


def count(text: str) -> int:
    """A command-line count: an integer >= 1 (``check_count``)."""
    try:
        return check_count(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1") from None


def add_eval_parser(sub) -> None:
    """The ``eval`` command and its three evaluations."""
    e = sub.add_parser(
        "eval", help="evaluate eviction: needle retrieval, perplexity, output fidelity"
    )
    kinds = e.add_subparsers(dest="evaluation", required=True)

    def common(p, out):
        p.add_argument(
            "--model", default="smollm2-135m-instruct", help="model source (default: %(default)s)"
        )
        p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
        p.add_argument(
            "--scorers", nargs="+", metavar="SCORER", help="scorer names (README, 'Scorer names')"
        )
        p.add_argument(
            "--budgets", nargs="+", type=int, metavar="B", help="tokens kept per KV head"
        )
        p.add_argument("--out", default=out, help="results directory (default: %(default)s)")
        add_arguments(
            p.add_argument_group(
                "eviction keywords shared by every run (kvjax.EvictionOptions; "
                "unset: the preset's, else the default)"
            ),
            defaults=False,
            skip=SWEPT,
        )

    n = kinds.add_parser(
        "niah", help="RULER-style needle retrieval sweep (resumable: reruns skip done answers)"
    )
    common(n, "benchmarks/results/niah")
    n.add_argument(
        "--preset", choices=sorted(PRESETS), help="a named sweep; explicit options override it"
    )
    n.add_argument(
        "--protocols", nargs="+", choices=["prefill", "blockwise"], help="default: prefill"
    )
    n.add_argument("--settings", nargs="+", choices=SETTINGS, help="default: both")
    n.add_argument(
        "--lengths", nargs="+", type=count, help="prompt tokens (default: 1024 2048 4096)"
    )
    n.add_argument("--tasks", nargs="+", choices=TASKS, help="default: all")
    n.add_argument("--haystacks", nargs="+", choices=HAYSTACKS, help="default: all")
    n.add_argument(
        "--samples", type=count, help="samples per task, haystack and length (needle depths spread)"
    )
    n.add_argument("--seed", type=int, default=0, help="fixes every sample (default: %(default)s)")
    n.add_argument(
        "--batch",
        type=count,
        default=8,
        help="samples of one length and task answered together (default: %(default)s)",
    )
    n.add_argument(
        "--dry-run",
        action="store_true",
        help="check the options, print the number of answers and an estimate of the time, and stop",
    )
    n.set_defaults(run=_niah)

    p = kinds.add_parser("ppl", help="perplexity of a long real text under decoding-time eviction")
    common(p, "benchmarks/results/ppl")
    p.add_argument(
        "--length", type=count, default=4096, help="tokens of text (default: %(default)s)"
    )
    p.add_argument(
        "--edges",
        nargs="+",
        type=count,
        default=[256, 512, 1024, 2048, 4096],
        help="report perplexity over the tokens up to each of these positions",
    )
    p.set_defaults(run=_ppl)

    f = kinds.add_parser(
        "fidelity", help="attention-output error and next-token KL of compressed caches"
    )
    common(f, "benchmarks/results/fidelity")
    f.add_argument(
        "--length", type=count, default=2048, help="context tokens (default: %(default)s)"
    )
    f.add_argument(
        "--continuation", type=count, default=64, help="tokens compared after the context"
    )
    f.add_argument("--prompts", type=count, default=2, help="real-text prompts averaged over")
    f.set_defaults(run=_fidelity)

    from kvjax.eval import seeds

    d = kinds.add_parser(
        "seeds",
        help="every seed paper's comparison in its own setting: NIAH, perplexity and "
        "fidelity parts, run in order (resumable)",
    )
    d.add_argument(
        "--model", default="smollm2-135m-instruct", help="model source (default: %(default)s)"
    )
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    d.add_argument(
        "--out",
        default="docs/results/seeds",
        help="each part writes to OUT/PART (default: %(default)s)",
    )
    d.add_argument(
        "--parts",
        nargs="+",
        metavar="PART",
        help=f"run only these (default: all, in order: {' '.join(seeds.PARTS)})",
    )
    d.add_argument(
        "--dry-run", action="store_true", help="print each part's time estimate and stop"
    )
    d.set_defaults(run=_seeds)


def _seeds(args) -> int:
    """``eval seeds``: run (or, with ``--dry-run``, estimate) the chosen parts of
    ``kvjax.eval.seeds`` in order."""
    from kvjax.eval import seeds

    names = args.parts or list(seeds.PARTS)
    unknown = [n for n in names if n not in seeds.PARTS]
    if unknown:
        raise ValueError(f"--parts: unknown {unknown}; the parts are {list(seeds.PARTS)}")
    if args.dry_run:
        total = 0.0
        for name in names:
            seconds = estimate_seconds(
                parse_eval(seeds.part_argv(name, args.out, args.model, args.dtype))
            )
            total += seconds
            print(f"{name:26s} about {seconds / 60:4.0f} min")
        print(f"{'all':26s} about {total / 60:4.0f} min by kvjax.eval.cli.COST; nothing run")
        return 0
    start = time.perf_counter()
    for name in names:
        part = parse_eval(seeds.part_argv(name, args.out, args.model, args.dtype))
        done = seeds.OUTPUT.get(part.evaluation)
        if done and os.path.exists(os.path.join(part.out, done)):
            print(f"[{name}: {part.out}/{done} exists, skipped]", file=sys.stderr)
            continue
        print(
            f"[{name}: python -m kvjax eval {' '.join(seeds.PARTS[name])} --out {part.out}]",
            file=sys.stderr,
        )
        part_start = time.perf_counter()
        status = part.run(part)
        if status:
            return status
        print(f"[{name}: {time.perf_counter() - part_start:.0f}s]", file=sys.stderr)
    print(
        f"[seeds: {time.perf_counter() - start:.0f}s for {', '.join(names)}; "
        f"results in {args.out}/]",
        file=sys.stderr,
    )
    return 0
