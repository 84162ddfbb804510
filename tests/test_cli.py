"""The command line: streamed generation with and without eviction, help, and clear errors."""

import pytest

from kvjax.cli.main import main


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--model",
        "--chat",
        "--prompt",
        "--max-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--dtype",
        "--budget",
        "--scorer",
        "--protocol",
        "--block-size",
        "--n-sink",
        "--window",
        "--obs-window",
        "--pool",
        "--kernel",
        "--aggregate",
        "--mi-batch",
        "--impl",
        "--evict-every",
        "--no-decode-evict",
    ):
        assert option in text


def test_bad_budget_is_a_clear_error_before_loading(capsys):
    assert main(["generate", "--model", "no-such-model", "--chat", "hi", "--budget", "8"]) == 2
    assert "budget=8 must be larger than n_sink + window" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, match",
    [
        ("--budget", "abc", "'abc' is neither a token count (512) nor a fraction of the prompt"),
        ("--budget-bytes", "1XB", "'1XB' is not a size (for example 123456, 64MiB, 1.5GiB)"),
        ("--budget-bytes", "-5", "'-5' is not a size"),
    ],
)
def test_unreadable_budgets_say_what_they_take(capsys, flag, value, match):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", "no-such-model", "--chat", "hi", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {match}" in capsys.readouterr().err


def test_unknown_scorer_lists_the_valid_names_before_loading(capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                "no-such-model",
                "--chat",
                "hi",
                "--budget",
                "64",
                "--scorer",
                "magic",
            ]
        )
        == 2
    )
    assert (
        "scorer='magic' is unknown; valid scorers: expected-attention, h2o, h2o+caote"
        in capsys.readouterr().err
    )


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["generate", "--model", "no-such-model", "--chat", "hi"]) == 2
    assert "source='no-such-model' is not a registry name" in capsys.readouterr().err


@pytest.mark.smollm2
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--budget", "64", "--scorer", "h2o"],
        ["--budget", "64", "--scorer", "snapkv+obcache-joint", "--obs-window", "8"],
    ],
)
def test_chat_streams_the_answer(capsys, extra):
    assert (
        main(
            ["generate", "--chat", "What is the capital of France?", "--max-new-tokens", "16"]
            + extra
        )
        == 0
    )
    assert "Paris" in capsys.readouterr().out
