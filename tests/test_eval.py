"""The evaluation suite: deterministic samples, exact-match scoring, a resumable sweep writing
JSONL, table and plot, perplexity and fidelity against their no-eviction limits, and the full cache
on SmolLM2."""

import functools
import json
import re

import numpy as np
import pytest

from kvjax.eval import report, sweep
from kvjax.eval.fidelity import run_fidelity
from kvjax.eval.haystack import licenses_prose, pydoc_prose, sentences
from kvjax.eval.niah import TASKS, make_sample, make_samples, score
from kvjax.eval.perplexity import (
    evicting_nll,
    full_cache_nll,
    run_perplexity,
    text_tokens,
)
from kvjax.runtime.options import eviction_from


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def test_real_text_haystack_is_prose_from_an_installed_package():
    text = pydoc_prose()
    assert len(text) > 150_000 and "assignment statement" in text
    assert not any(s.startswith((" ", ">>>")) for s in sentences("pydoc"))


@pytest.mark.parametrize("task", [t for t in TASKS if t != "sentence-number"])
@pytest.mark.parametrize("haystack", ["filler", "pydoc"])
def test_samples_are_deterministic_and_hold_their_needles(tokenizer, task, haystack):
    a = make_sample(tokenizer, task, haystack, 512, 1, 3, seed=7)
    assert a == make_sample(tokenizer, task, haystack, 512, 1, 3, seed=7)
    assert a.context != make_sample(tokenizer, task, haystack, 512, 1, 3, seed=8).context
    assert 512 - 64 <= len(a.prompt) <= 512
    context, question = tokenizer.decode(list(a.context)), tokenizer.decode(list(a.question))
    assert all(f"is: {answer}." in context for answer in a.answers)
    assert "<|im_start|>user" in context and question.rstrip().endswith(("is", "are"))
    assert "What" in question and "<|im_start|>assistant" in question
    if task == "multikey":
        assert context.count("One of the special magic") == 4 and len(a.answers) == 1
    if task == "multivalue":
        assert len(a.answers) >= 3


@pytest.mark.parametrize("haystack", ["pydoc", "licenses"])
def test_sentence_needles_read_as_prose(tokenizer, haystack):
    """sentence-number: the asked sentence and one distractor of the same form (two names sharing no
    word), real prose around them, no instruction, and the question ends the user turn with no
    answer prefix."""
    a = make_sample(tokenizer, "sentence-number", haystack, 1024, 2, 3, seed=7)
    assert a == make_sample(tokenizer, "sentence-number", haystack, 1024, 2, 3, seed=7)
    assert 1024 - 160 <= len(a.prompt) <= 1024 and a.max_new_tokens == 32
    context, question = tokenizer.decode(list(a.context)), tokenizer.decode(list(a.question))
    assert "magic" not in context + question and "\nWhat" in question or "\nAt what" in question
    assert question.endswith("<|im_start|>assistant\n")
    (answer,) = a.answers
    numbers = re.findall(r"\b\d{7}\b", context)
    assert len(numbers) == 2 and answer in numbers
    needle = next(s for s in re.split(r"(?<=[.:!?]) ", context) if answer in s)
    other = next(
        s for s in re.split(r"(?<=[.:!?]) ", context) if s != needle and re.search(r"\b\d{7}\b", s)
    )
    name = r"\b(?!The\b)[A-Z][a-z]+ [A-Z][a-z]+"
    asked, distractor = (re.search(name, s).group(0) for s in (needle, other))
    assert (
        asked in question
        and distractor not in question
        and not set(asked.split()) & set(distractor.split())
    )
    assert re.sub(name + r"|\d{7}", "X", needle) == re.sub(name + r"|\d{7}", "X", other)
    assert context.rindex(answer) / len(context) > 0.9  # index 2 of 3: the end of the context


def test_licenses_haystack_is_legal_prose():
    text = licenses_prose()
    assert len(text) > 100_000 and "GNU General Public License" in text
    assert not any(re.search(r"https?://|<.*>", s) for s in sentences("licenses"))


def test_needle_depths_spread_over_the_context(tokenizer):
    samples = make_samples(tokenizer, ["single-number"], ["pydoc"], [1024], n=3)
    assert [s.depth for s in samples] == [0.0, 0.5, 1.0]
    places = []
    for s in samples:
        text = tokenizer.decode(list(s.context))
        places.append(text.index(f"is: {s.answers[0]}.") / len(text))
    assert places[0] < 0.2 and 0.35 < places[1] < 0.65 and places[2] > 0.9


def test_exact_match_scoring():
    assert score(" 7341295.", ("7341295",)) == 1.0
    assert score("The number is 734129", ("7341295",)) == 0.0
    assert score("Apricot!", ("apricot",)) == 1.0
    assert (
        score("1111111, 2222222 and 4444444", ("1111111", "2222222", "3333333", "4444444")) == 0.75
    )


def test_smoke_sweep_writes_jsonl_table_and_plot_and_resumes(
    tokenizer, tiny_smollm2_vocab, tmp_path
):
    samples = make_samples(tokenizer, ["single-number", "multivalue"], ["filler"], [256], n=1)
    methods = sweep.methods(["streamingllm", "snapkv"], [32, 96], ["prefill", "blockwise"])
    out = tmp_path / "rows.jsonl"
    answer = functools.partial(  # every method over the samples, appended to (and resumed from) out
        sweep.run,
        tiny_smollm2_vocab,
        tokenizer,
        samples,
        methods,
        out=str(out),
        options={"obs_window": 8},
        progress=False,
    )
    rows = answer(block_size=64)
    # Each sample: the full cache once, then 2 scorers × 2 budgets × 2 protocols in each of 2
    # settings.
    assert len(rows) == 2 * (1 + 2 * 2 * 2 * 2)
    lines = out.read_text().splitlines()
    assert len(lines) == len(rows) and all(json.loads(line)["sample"] for line in lines)
    assert {r.setting for r in rows} == set(sweep.SETTINGS) and all(0 <= r.score <= 1 for r in rows)
    again = answer(block_size=64)
    assert len(out.read_text().splitlines()) == len(lines) and sorted(again, key=str) == sorted(
        rows, key=str
    )
    table = report.markdown(rows, "smoke")
    assert "**query-agnostic, 256 tokens**" in table and "| snapkv (blockwise), block 64 |" in table
    # another block size is another method: its block-wise answers are made, the rest reused
    other = answer(block_size=32)
    blockwise = [r for r in other if r.protocol == "blockwise"]
    assert len(out.read_text().splitlines()) == len(lines) + len(blockwise) == len(lines) + 16
    assert {r.label for r in blockwise} == {
        "streamingllm (blockwise), block 32",
        "snapkv (blockwise), block 32",
    }
    assert all(json.loads(r.options)["block_size"] == 32 for r in blockwise)
    report.plot(rows, str(tmp_path / "accuracy.png"))
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batched_sweep_answers_as_one_sample_at_a_time(tokenizer, tiny_smollm2_vocab, tmp_path):
    """Samples of one length and task run as a batch (padded, uneven groups): the same predictions
    as batch 1, under both protocols and settings."""
    samples = make_samples(tokenizer, ["single-number"], ["filler", "pydoc"], [256], n=2)
    assert len({len(s.prompt) for s in samples}) > 1  # the batches are padded
    methods = [
        sweep.Method(sweep.FULL, None, "-"),
        sweep.Method("snapkv", 64),
        sweep.Method("tova", 64, "blockwise"),
    ]
    runs = {
        batch: sweep.run(
            tiny_smollm2_vocab,
            tokenizer,
            samples,
            methods,
            out=str(tmp_path / f"{batch}.jsonl"),
            options={"obs_window": 8},
            block_size=64,
            batch=batch,
            progress=False,
        )
        for batch in (1, 3)
    }
    assert [len(group) for group in sweep._batches(samples, 3)] == [3, 1]
    predictions = {batch: {r.key(): r.prediction for r in rows} for batch, rows in runs.items()}
    assert len(predictions[1]) == 4 * (1 + 2 * 2) and predictions[3] == predictions[1]
    with pytest.raises(ValueError, match="batch=0 must be an integer >= 1"):
        sweep.run(
            tiny_smollm2_vocab, tokenizer, samples, methods, out=str(tmp_path / "0.jsonl"), batch=0
        )


def test_sweep_with_room_for_everything_answers_like_the_full_cache(
    tokenizer, tiny_smollm2_vocab, tmp_path
):
    samples = make_samples(tokenizer, ["single-word"], ["pydoc"], [256], n=1)
    rows = sweep.run(
        tiny_smollm2_vocab,
        tokenizer,
        samples,
        sweep.methods(["h2o", "tova+caote"], [300], ["prefill"]),
        out=str(tmp_path / "rows.jsonl"),
        progress=False,
    )
    full = [r.prediction for r in rows if r.scorer == sweep.FULL]
    assert len(full) == 1 and all(r.prediction == full[0] for r in rows)


def test_perplexity_with_room_for_everything_equals_the_full_cache(tiny_smollm2_vocab, tokenizer):
    tokens = text_tokens(tokenizer, 96)
    full = np.asarray(full_cache_nll(tiny_smollm2_vocab, tokens))
    roomy = np.asarray(
        evicting_nll(
            tiny_smollm2_vocab, tokens, eviction_from(budget=128, scorer="streamingllm").decoding()
        )
    )
    np.testing.assert_allclose(roomy, full, atol=1e-4)
    tight = np.asarray(
        evicting_nll(
            tiny_smollm2_vocab, tokens, eviction_from(budget=16, scorer="streamingllm").decoding()
        )
    )
    np.testing.assert_allclose(tight[:15], full[:15], atol=1e-4)  # nothing evicted yet
    assert np.abs(tight[20:] - full[20:]).max() > 1e-3
    result = run_perplexity(
        tiny_smollm2_vocab,
        tokenizer,
        ["streamingllm"],
        [16],
        length=96,
        window_edges=(32, 64),
        progress=False,
    )
    assert (
        result["edges"] == [32, 64, 96]
        and len(result["full"]) == 3
        and len(result["runs"][0]["ppl"]) == 3
    )
    np.testing.assert_allclose(result["full"][0], np.exp(full[:31].mean()), rtol=1e-5)


def test_fidelity_is_zero_without_eviction_and_grows_with_it(tiny_smollm2_vocab, tokenizer):
    result = run_fidelity(
        tiny_smollm2_vocab,
        tokenizer,
        ["snapkv", "streamingllm+momentkv-nc"],
        [16, 200],
        length=128,
        continuation=16,
        prompts=1,
        options={"obs_window": 8, "mi_batch": 4},
        progress=False,
    )  # mi_batch reaches the MomentKV scorers only (neither of these)
    runs = {(r["scorer"], r["budget"]): r for r in result["runs"]}
    for scorer in ("snapkv", "streamingllm+momentkv-nc"):
        assert runs[(scorer, 200)]["mean_error"] < 1e-5 and abs(runs[(scorer, 200)]["kl"]) < 1e-6
        assert runs[(scorer, 16)]["mean_error"] > 1e-3 and runs[(scorer, 16)]["kl"] > 1e-6
        assert len(runs[(scorer, 16)]["layer_errors"]) == tiny_smollm2_vocab.config.n_layers


@pytest.mark.smollm2
def test_full_cache_answers_every_smoke_sample_on_smollm2(smollm2, tokenizer, tmp_path):
    from kvjax.eval.cli import PRESETS

    smoke = PRESETS["smoke"]
    samples = make_samples(
        tokenizer, smoke["tasks"], smoke["haystacks"], smoke["lengths"], smoke["samples"]
    )
    rows = sweep.run(
        smollm2,
        tokenizer,
        samples,
        sweep.methods([], [], []),
        out=str(tmp_path / "rows.jsonl"),
        progress=False,
    )
    assert len(rows) == len(samples) == 6
    assert [r.score for r in rows] == [1.0] * 6, [
        (r.sample, r.prediction) for r in rows if r.score < 1
    ]
