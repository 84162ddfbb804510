"""Long documents from the command line: @FILE and - for text arguments, ``ask`` (compress once,
answer many, save / load) and ``chat`` (turns appended to one budgeted cache), and ``kvjax.extend``
under them."""

import io
import re

import numpy as np
import pytest

import kvjax
from kvjax.cli.ask_chat import read_text
from kvjax.cli.main import main
from kvjax.eval.haystack import pydoc_prose
from kvjax.loading import chat_parts
from kvjax.runtime.conversation import Conversation
from kvjax.runtime.saved_context import META_FILE, load_context

ASK = dict(budget=96, scorer="snapkv", obs_window=8)
QUESTIONS = ["What is the passcode of the blue door?", "Which colour is the door?"]


def test_read_text_takes_files_and_standard_input_without_one_trailing_newline(
    tmp_path, monkeypatch
):
    text = "Héllo,\nworld — twice.\n"
    for written, read in (
        (text, text[:-1]),
        (text + "\n", text),
        ("a\r\n", "a"),
        ("a\n\r\n", "a\n"),
        ("no newline", "no newline"),
    ):
        (tmp_path / "m.txt").write_bytes(written.encode("utf-8"))
        assert read_text(f"@{tmp_path / 'm.txt'}", "--chat") == read
        monkeypatch.setattr("sys.stdin", io.StringIO(written))
        assert read_text("-", "--chat") == read
    assert read_text(text, "--chat") == text  # typed inline: as given
    with pytest.raises(ValueError, match="--chat @.*nope.txt.*cannot read"):
        read_text(f"@{tmp_path / 'nope.txt'}", "--chat")


@pytest.mark.smollm2
def test_generate_reads_the_message_from_a_file_and_from_standard_input(
    tmp_path, monkeypatch, capsys
):
    message = "What is the capital of France?"
    (tmp_path / "m.txt").write_text(message + "\n")  # as `echo` writes it
    outputs = []
    for arg in (message, f"@{tmp_path / 'm.txt'}", "-"):
        monkeypatch.setattr("sys.stdin", io.StringIO(message + "\n"))
        assert (
            main(
                [
                    "generate",
                    "--chat",
                    arg,
                    "--max-new-tokens",
                    "8",
                    "--budget",
                    "32",
                    "--scorer",
                    "tova",
                ]
            )
            == 0
        )
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and "Paris" in outputs[0]


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    """About 700 tokens of prose with one fact in the middle."""
    words = pydoc_prose().split()
    text = (
        " ".join(words[:250])
        + " The passcode of the blue door is 4417. "
        + " ".join(words[250:500])
    )
    path = tmp_path_factory.mktemp("doc") / "document.txt"
    path.write_text(text)
    return path


def answers_of(stdout: str) -> dict[str, str]:
    """``ask``'s stdout: "> question" then the answer, per question."""
    return {q: a.strip() for q, a in re.findall(r"^> (.*)\n(.*)\n", stdout, flags=re.M)}


@pytest.mark.smollm2
def test_ask_compresses_once_and_each_answer_equals_decode(
    smollm2, smollm2_tokenizer, document, tmp_path, monkeypatch, capsys
):
    calls = []
    real_prefill = kvjax.prefill
    monkeypatch.setattr(kvjax, "prefill", lambda *a, **k: calls.append(1) or real_prefill(*a, **k))
    saved = tmp_path / "context"
    flags = ["--budget", "96", "--scorer", "snapkv", "--obs-window", "8", "--max-new-tokens", "12"]
    assert main(["ask", "--context", str(document), *flags, "--save", str(saved), *QUESTIONS]) == 0
    out = capsys.readouterr()
    assert len(calls) == 1, "the context must be prefilled once for all questions"
    assert re.search(
        r"compressed in [0-9.]+s.*tokens seen, 96 kept per layer and KV head.*MiB for the full "
        r"cache",
        out.err,
    )
    got = answers_of(out.out)
    assert list(got) == QUESTIONS

    ids, _ = chat_parts(smollm2_tokenizer, document.read_text() + "\n\n", "")
    context = real_prefill(smollm2, ids, **ASK)
    for q in QUESTIONS:
        expected = kvjax.decode(
            smollm2, context, chat_parts(smollm2_tokenizer, "", q)[1], 12, evict=False
        )
        assert got[q] == smollm2_tokenizer.decode(expected, skip_special_tokens=True).strip()

    # A later process: load and ask again, without compressing.
    assert (
        main(["ask", "--load", str(saved), "--max-new-tokens", "12", QUESTIONS[1], QUESTIONS[0]])
        == 0
    )
    out = capsys.readouterr()
    assert len(calls) == 1
    assert answers_of(out.out) == got
    assert "loaded" in out.err and "96 kept" in out.err


@pytest.mark.smollm2
def test_saved_context_is_checked_on_load(smollm2, smollm2_tokenizer, tiny_llama, tmp_path, capsys):
    from kvjax.checkpoint.errors import CheckpointError
    from kvjax.runtime.saved_context import save_context

    context = kvjax.prefill(smollm2, list(range(1, 200)), budget=64, scorer="tova")
    save_context(str(tmp_path / "c"), context, smollm2)
    loaded = load_context(str(tmp_path / "c"), smollm2)
    assert np.array_equal(np.asarray(loaded.cache.k), np.asarray(context.cache.k))
    assert loaded.ev == context.ev and list(loaded.lengths) == list(context.lengths)
    with pytest.raises(
        CheckpointError, match="compressed for another model: vocab_size: saved 49152, model 97"
    ):
        load_context(str(tmp_path / "c"), tiny_llama)
    with pytest.raises(CheckpointError, match="compressed with dtype=float32"):
        load_context(str(tmp_path / "c"), kvjax.load("smollm2-135m-instruct", dtype="bfloat16"))
    data = sorted(
        f for f in (tmp_path / "c" / "cache").rglob("*") if f.is_file() and f.parent.name == "d"
    )
    data[0].write_bytes(data[0].read_bytes()[:-1])
    with pytest.raises(
        CheckpointError,
        match=rf"cache is corrupt: cache/.*{data[0].name} holds \d+ bytes, \d+ when "
        "written; compress the context again",
    ):
        load_context(str(tmp_path / "c"), smollm2)
    meta = tmp_path / "c" / META_FILE
    meta.write_text(meta.read_text()[:40])
    with pytest.raises(CheckpointError, match="not a saved kvjax context"):
        load_context(str(tmp_path / "c"), smollm2)
    assert main(["ask", "--load", str(tmp_path / "nowhere"), "q"]) == 2
    assert "not a saved kvjax context" in capsys.readouterr().err
    assert main(["ask", "--load", str(tmp_path / "c"), "--budget", "32", "q"]) == 2
    assert "--budget apply with --context only" in capsys.readouterr().err
    assert main(["ask", "--context", "x.txt", "q"]) == 2
    assert "--budget is required with --context" in capsys.readouterr().err


@pytest.mark.smollm2
def test_a_conversation_with_room_for_everything_equals_generate_on_the_whole_of_it(
    smollm2, smollm2_tokenizer
):
    """Turn by turn in a budget that evicts nothing equals one full-cache generation of the whole
    conversation: what each turn feeds continues the cache exactly."""
    chat = Conversation(smollm2, smollm2_tokenizer, budget=512, scorer="snapkv", max_new_tokens=24)
    fed = []
    for message in ("Remember this: the secret word is banana.", "Name three colours."):
        ids = chat.turn_tokens(message)
        answer = chat.say(message)
        fed += ids
        alone = kvjax.generate(smollm2, fed, max_new_tokens=24)
        assert smollm2_tokenizer.decode(alone, skip_special_tokens=True) == answer
        fed += [int(t) for t in alone]
    assert chat.prefills == 1 and chat.stats().seen == len(fed)


@pytest.mark.smollm2
def test_chat_through_standard_input_keeps_the_budget_and_remembers_turn_one(monkeypatch, capsys):
    calls = []
    real_prefill = kvjax.prefill
    monkeypatch.setattr(kvjax, "prefill", lambda *a, **k: calls.append(1) or real_prefill(*a, **k))
    monkeypatch.setattr("kvjax.runtime.conversation.prefill", kvjax.prefill)
    script = (
        "Remember this: the secret word is banana.\n/stats\nName three colours.\n/stats\n"
        "What is the secret word?\n/stats\n/reset\n/stats\n"
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert (
        main(
            [
                "chat",
                "--budget",
                "48",
                "--scorer",
                "snapkv",
                "--obs-window",
                "8",
                "--max-new-tokens",
                "32",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    answers = [line for line in out.out.splitlines() if line.strip()]
    assert len(answers) == 3 and "banana" in answers[2].lower()
    stats = [
        (int(seen), int(kept))
        for seen, kept in re.findall(
            r"(\d+) tokens seen, (\d+) kept per layer and KV head", out.err
        )
    ]
    assert len(stats) == 3 and all(kept <= 48 for _, kept in stats)
    assert (
        stats[0][0] < stats[1][0] < stats[2][0] and stats[2][0] > 48
    )  # turns appended; eviction happened
    assert "[nothing yet]" in out.err.rstrip().splitlines()[-1]  # after /reset
    assert len(calls) == 1, "later turns continue the cache: one prefill"


def test_extend_answers_as_decode_and_refuses_contexts_it_cannot_keep_in_budget(tiny_llama):
    prompt = [int(t) for t in np.random.default_rng(1).integers(4, 97, 60)]
    context = kvjax.prefill(
        tiny_llama, prompt, budget=24, scorer="snapkv", obs_window=4, block_size=16
    )
    question = [5, 6, 7, 8, 9]
    expected = kvjax.decode(tiny_llama, context, question, 12, stop_ids=())
    streamed = []
    out, longer = kvjax.extend(
        tiny_llama,
        context,
        question,
        12,
        stop_ids=(),
        every=5,
        on_tokens=lambda rows: streamed.extend(rows[0]),
    )
    assert list(out) == list(expected) == streamed
    assert int(longer.lengths[0]) == 60 + 5 + 12
    assert int((np.asarray(longer.cache.pos) >= 0).sum(-1).max()) <= 24
    # ... and it is extended again from where it stopped.
    again, _ = kvjax.extend(tiny_llama, longer, [10, 11], 6, stop_ids=())
    assert len(again) == 6
    with pytest.raises(ValueError, match="evict_every=4"):
        kvjax.extend(
            tiny_llama,
            kvjax.prefill(tiny_llama, prompt, budget=24, scorer="tova", evict_every=4),
            None,
            4,
        )
    with pytest.raises(ValueError, match="every=0"):
        kvjax.extend(tiny_llama, context, None, 4, every=0)


def test_ask_and_chat_help_and_early_errors(capsys):
    for command in ("ask", "chat"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--context", "--save", "--load", "--budget", "--scorer", "--temperature"):
        assert option in text
    assert main(["ask", "q"]) == 2
    assert "--context FILE, or a saved context with --load DIR" in capsys.readouterr().err
    assert main(["chat", "--model", "no-such-model"]) == 2
    assert "--budget is required" in capsys.readouterr().err
    assert main(["chat", "--model", "no-such-model", "--budget", "0.5"]) == 2
    assert "give a token count" in capsys.readouterr().err
