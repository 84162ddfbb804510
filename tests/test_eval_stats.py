"""Wilson intervals, the exact sign test, paired tables joined from sweep rows, and the seed-paper
presets: their size, and their machinery (methods with their own protocol, claims, paired.md) on a
tiny model."""

import dataclasses
import itertools
import json
import math

import pytest

import kvjax
from kvjax.cli.main import main
from kvjax.eval import cli, report, seeds, sweep
from kvjax.eval.stats import paired, sign_test, wilson
from kvjax.runtime.options import eviction_from, with_tokenizer

SEEDS = ("seeds-obcache", "seeds-caote", "seeds-momentkv", "seeds-kvzip")


def wilson_by_hand(k, n, z=1.96):
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return center - half, center + half


@pytest.mark.parametrize(
    "k, expected", [(0, (0.0, 0.1380)), (12, (0.3143, 0.6857)), (24, (0.8620, 1.0))]
)
def test_wilson_interval_of_24_answers(k, expected):
    low, high = wilson(k, 24)
    assert (low, high) == pytest.approx(wilson_by_hand(k, 24), abs=1e-12)
    assert (low, high) == pytest.approx(expected, abs=1e-4)
    assert report.cell(100 * 14 / 24, 24) == "58.3 [38.8, 75.5]"


def test_wilson_rejects_impossible_counts():
    with pytest.raises(ValueError, match="n=0"):
        wilson(0, 0)
    with pytest.raises(ValueError, match="k=25"):
        wilson(25, 24)


def brute_force_sign_test(wins, losses):
    """The probability, over every equally likely sequence of m fair coin flips, of a count of heads
    at least as far from m/2 as ``wins``."""
    m = wins + losses
    if m == 0:
        return 1.0
    extreme = sum(
        abs(sum(flips) - m / 2) >= abs(wins - m / 2)
        for flips in itertools.product((0, 1), repeat=m)
    )
    return extreme / 2**m


@pytest.mark.parametrize(
    "wins, losses", [(0, 0), (1, 0), (6, 0), (5, 1), (3, 3), (2, 7), (9, 3), (0, 12)]
)
def test_sign_test_equals_the_binomial_sum(wins, losses):
    assert sign_test(wins, losses) == pytest.approx(brute_force_sign_test(wins, losses), abs=1e-12)
    assert sign_test(wins, losses) == sign_test(losses, wins)


def test_paired_counts_wins_losses_and_ties():
    baseline = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0, "e": 0.75, "f": 1.0}
    method = {
        "a": 1.0,
        "b": 1.0,
        "c": 0.0,
        "d": 0.0,
        "e": 1.0,
        "f": 0.5,
    }  # a partial score is not right
    result = paired(baseline, method)
    assert (result.wins, result.losses, result.ties) == (2, 2, 2) and result.p == 1.0
    assert paired(
        {str(i): 0.0 for i in range(6)}, {str(i): 1.0 for i in range(6)}
    ).p == pytest.approx(1 / 32)
    with pytest.raises(ValueError, match="same samples"):
        paired({"a": 1.0}, {"b": 1.0})
    with pytest.raises(ValueError, match="method: scores"):
        paired({"a": 1.0}, {"a": 2.0})


def row(sample, label, budget, score, setting="query-aware", length=1024):
    return sweep.Row(
        sample=f"{sample}/{length}",
        task="single-number",
        haystack="filler",
        length=length,
        depth=0.5,
        setting=setting,
        scorer=label.split(" ")[0],
        budget=budget,
        protocol="prefill",
        options="{}",
        prediction="",
        score=score,
        seconds=1.0,
        prefill_seconds=1.0,
        label=label,
    )


def test_paired_table_joins_rows_on_sample_budget_length_and_setting(tmp_path):
    rows = [row(s, "full", None, 1.0) for s in "abcdef"]
    # budget 128, query-aware: base right on a-c, method right on b-f -> wins d, e, f; losses a;
    # ties b, c
    rows += [row(s, "snapkv", 128, float(s in "abc")) for s in "abcdef"]
    rows += [row(s, "snapkv+x", 128, float(s in "bcdef")) for s in "abcdef"]
    # budget 256: the method has no answer for f (a run still going): five pairs, all ties
    rows += [row(s, "snapkv", 256, 1.0) for s in "abcdef"] + [
        row(s, "snapkv+x", 256, 1.0) for s in "abcde"
    ]
    # another setting and another length are other cells, not more pairs of the first
    rows += [row(s, "snapkv", 128, 0.0, setting="query-agnostic") for s in "ab"]
    rows += [row(s, "snapkv+x", 128, 1.0, setting="query-agnostic") for s in "ab"]
    rows += [row(s, "snapkv", 128, 0.0, length=2048) for s in "a"] + [
        row(s, "snapkv+x", 128, 0.0, length=2048) for s in "a"
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rows))

    table = report.paired_markdown(
        sweep.read_rows(str(path)), [("x helps snapkv", "snapkv", "snapkv+x")]
    )
    lines = table.splitlines()
    assert "### x helps snapkv" in lines and "baseline `snapkv`, method `snapkv+x`" in lines
    cells = [line for line in lines if line.startswith("| query-")]
    three_of_six, five_of_six = report.cell(50.0, 6), report.cell(100 * 5 / 6, 6)
    assert cells == [
        "| query-agnostic | 1024 | 128 | 2 | 0.0 [0.0, 65.8] | 100.0 [34.2, 100.0] | 2 | 0 | 0 | "
        "0.5 |",
        "| query-aware | 1024 | 128 | 6 | "
        + three_of_six
        + " | "
        + five_of_six
        + " | 3 | 1 | 2 | 0.625 |",
        "| query-aware | 1024 | 256 | 5 | 100.0 [56.6, 100.0] | 100.0 [56.6, 100.0] | 0 | 0 | 5 | "
        "1 |",
        "| query-aware | 2048 | 128 | 1 | 0.0 [0.0, 79.3] | 0.0 [0.0, 79.3] | 0 | 0 | 1 | 1 |",
    ]
    with pytest.raises(ValueError, match=r"no rows labelled 'snapkv\+y'"):
        report.paired_markdown(rows, [("typo", "snapkv", "snapkv+y")])


def test_accuracy_tables_show_wilson_intervals():
    rows = [row(str(i), "snapkv", 128, float(i < 14)) for i in range(24)] + [
        row(str(i), "full", None, 1.0) for i in range(24)
    ]
    table = report.markdown(rows)
    assert (
        "| snapkv | 58.3 [38.8, 75.5] |" in table
        and "full cache 100.0 [86.2, 100.0] (24 answers)" in table
    )


@pytest.mark.parametrize("name", SEEDS)
def test_seed_presets_give_24_answers_per_cell_within_90_minutes(name):
    preset = cli.PRESETS[name]
    methods = cli.preset_methods(preset, preset["budgets"])
    per_length = len(preset["tasks"]) * len(preset["haystacks"]) * preset["samples"]
    answers, seconds = cli.estimate(methods, preset["lengths"], preset["settings"], per_length)
    assert per_length >= 24 and seconds < 90 * 60
    assert answers == per_length * len(preset["lengths"]) * (
        1 + len(preset["settings"]) * (len(methods) - 1)
    )
    labels = {m.label for m in methods}
    assert preset["claims"] and all(
        {base, method} <= labels for _, base, method in preset["claims"]
    )
    for m in methods[1:]:  # every scorer, protocol and option is valid
        eviction_from(
            **with_tokenizer(
                None,
                budget=m.budget,
                scorer=m.scorer,
                protocol=m.protocol,
                **sweep.scorer_options(m.scorer, dict(m.options) | {"mi_batch": 128}),
            )
        )
    assert {m.protocol for m in methods[1:]} == (
        {"blockwise"} if name == "seeds-caote" else {"prefill"}
    )


def test_seeds_runs_every_seed_preset_within_90_minutes_by_estimate():
    parts = [
        cli.parse_eval(seeds.part_argv(name, "out", "smollm2-135m-instruct", "float32"))
        for name in seeds.PARTS
    ]
    assert {p.preset for p in parts if p.evaluation == "niah"} == set(SEEDS)
    assert {p.evaluation for p in parts} == {"niah", "ppl", "fidelity"}
    assert sum(map(cli.estimate_seconds, parts)) < 90 * 60


def test_seeds_estimate_counts_the_measured_costs():
    """The estimate of one small niah run, recomputed by hand from ``COST``."""
    args = cli.parse_eval(
        [
            "niah",
            "--scorers",
            "snapkv",
            "snapkv+momentkv",
            "--budgets",
            "128",
            "--lengths",
            "2048",
            "--samples",
            "1",
            "--tasks",
            "single-number",
            "--haystacks",
            "filler",
            "--protocols",
            "prefill",
            "--settings",
            "query-aware",
        ]
    )
    c = cli.COST
    by_hand = 3 * c["compile"] + c["sample"] * 2 + c["answer"] + c["mi"]
    assert cli.estimate_seconds(args) == pytest.approx(by_hand)
    ppl = cli.parse_eval(
        ["ppl", "--scorers", "h2o", "tova", "--budgets", "256", "--length", "1000"]
    )
    assert cli.estimate_seconds(ppl) == pytest.approx(c["ppl_token"] * 1000 * 2 + 3 * c["compile"])


def test_seeds_runs_its_parts_in_order_and_resumes(
    tiny_smollm2_vocab, smollm2_tokenizer, monkeypatch, tmp_path, capsys
):
    """Shrunk parts (a NIAH pair, a perplexity and a fidelity run) through
    ``python -m kvjax eval seeds``."""
    small = dict(
        cli._versus("OBCache", {"snapkv": {}}, ("obcache-value",)),
        budgets=[32],
        lengths=[256],
        samples=1,
        settings=["query-aware"],
        tasks=["single-number"],
        haystacks=["filler"],
        obs_window=8,
    )
    monkeypatch.setitem(cli.PRESETS, "seeds-obcache", small)
    monkeypatch.setattr(
        seeds,
        "PARTS",
        {
            "obcache": ["niah", "--preset", "seeds-obcache"],
            "caote-ppl": [
                "ppl",
                "--scorers",
                "tova+caote",
                "--budgets",
                "64",
                "--length",
                "160",
                "--edges",
                "160",
            ],
            "momentkv-fidelity": [
                "fidelity",
                "--scorers",
                "snapkv+momentkv",
                "--budgets",
                "64",
                "--length",
                "128",
                "--continuation",
                "8",
                "--prompts",
                "1",
            ],
        },
    )
    monkeypatch.setattr(kvjax, "load", lambda source, dtype=None: tiny_smollm2_vocab)
    monkeypatch.setattr(kvjax, "load_tokenizer", lambda source: smollm2_tokenizer)
    argv = ["eval", "seeds", "--out", str(tmp_path)]

    assert main(argv + ["--dry-run"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == [
        *seeds.PARTS,
        "all",
    ]
    assert not any(tmp_path.iterdir())
    assert main(argv + ["--parts", "obcache", "nope"]) == 2
    assert "--parts: unknown ['nope']" in capsys.readouterr().err

    assert main(argv) == 0
    assert (
        len(sweep.read_rows(str(tmp_path / "obcache" / "rows.jsonl"))) == 3
    )  # full, snapkv, snapkv+value
    assert (tmp_path / "obcache" / "paired.md").exists()
    ppl = json.loads((tmp_path / "caote-ppl" / "ppl.json").read_text())
    assert [r["scorer"] for r in ppl["runs"]] == ["tova+caote"]
    fidelity = json.loads((tmp_path / "momentkv-fidelity" / "fidelity.json").read_text())
    assert [r["scorer"] for r in fidelity["runs"]] == ["snapkv+momentkv"]
    capsys.readouterr()

    assert main(argv) == 0  # a rerun answers nothing again and skips the finished parts
    err = capsys.readouterr().err
    assert "caote-ppl/ppl.json exists, skipped" in err and "fidelity.json exists, skipped" in err
    assert len(sweep.read_rows(str(tmp_path / "obcache" / "rows.jsonl"))) == 3


def test_seed_preset_writes_paired_tables(
    tiny_smollm2_vocab, smollm2_tokenizer, monkeypatch, tmp_path, capsys
):
    """A shrunk seed preset (one prefill-protocol pair and one blockwise pair) through the command
    line."""
    obcache = cli._versus("OBCache", {"snapkv": {}}, ("obcache-value",))
    caote = cli._versus("CAOTE", {"tova": dict(n_sink=2)}, ("caote",), "blockwise")
    small = dict(
        methods=obcache["methods"] + caote["methods"],
        claims=obcache["claims"] + caote["claims"],
        budgets=[32, 96],
        lengths=[256],
        samples=2,
        settings=["query-aware"],
        tasks=["single-number"],
        haystacks=["filler"],
        block_size=64,
        obs_window=8,
    )
    monkeypatch.setitem(cli.PRESETS, "seeds-obcache", small)
    monkeypatch.setattr(kvjax, "load", lambda source, dtype=None: tiny_smollm2_vocab)
    monkeypatch.setattr(kvjax, "load_tokenizer", lambda source: smollm2_tokenizer)
    argv = ["eval", "niah", "--preset", "seeds-obcache", "--out", str(tmp_path)]

    assert main(argv + ["--dry-run"]) == 0
    assert capsys.readouterr().out.startswith(
        "18 answers (2 per method"
    )  # 2 × (1 + 4 methods × 2 budgets)
    assert not (tmp_path / "rows.jsonl").exists()

    assert main(argv) == 0
    rows = sweep.read_rows(str(tmp_path / "rows.jsonl"))
    assert len(rows) == 18
    assert {(r.label, r.protocol) for r in rows if r.scorer == "tova+caote"} == {
        ("tova+caote (blockwise)", "blockwise")
    }
    assert all(json.loads(r.options)["n_sink"] == 2 for r in rows if r.scorer.startswith("tova"))
    paired_md = (tmp_path / "paired.md").read_text()
    assert "### OBCache: snapkv+obcache-value vs snapkv" in paired_md
    assert "### CAOTE: tova+caote (blockwise) vs tova (blockwise)" in paired_md
    for budget in (32, 96):  # both claims, 2 pairs each
        assert paired_md.count(f"| query-aware | 256 | {budget} | 2 |") == 2
    assert "[" in (tmp_path / "table.md").read_text() and (tmp_path / "accuracy.png").exists()


def test_eval_counts_and_lengths_are_checked_before_running(
    tiny_smollm2_vocab, smollm2_tokenizer, monkeypatch, tmp_path, capsys
):
    """Counts below 1 are refused by the parser (a negative length had estimated "0+0j minutes");
    needle prompts beyond the model's context are refused before the sweep."""
    for flag in ("--lengths", "--samples", "--batch"):
        with pytest.raises(SystemExit):
            cli.parse_eval(["niah", flag, "0"])
        assert f"argument {flag}: '0' is not an integer >= 1" in capsys.readouterr().err
    monkeypatch.setattr(kvjax, "load", lambda source, dtype=None: tiny_smollm2_vocab)
    monkeypatch.setattr(kvjax, "load_tokenizer", lambda source: smollm2_tokenizer)
    context = tiny_smollm2_vocab.config.max_seq_len
    argv = ["eval", "niah", "--out", str(tmp_path), "--budgets", "64", "--samples", "1"]
    argv += ["--tasks", "single-number", "--haystacks", "filler", "--lengths", str(context)]
    assert main(argv) == 2
    assert f"--lengths {context}: a prompt and its answer take" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
