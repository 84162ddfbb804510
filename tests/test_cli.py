"""The command line: streamed generation with and without eviction, help, and clear errors."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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


def test_ask_names_an_unreadable_document_and_a_server_that_cannot_answer(tmp_path, capsys):
    """Before any model loads: a missing --context file; --server at a closed port; a server
    without kvjax's /v1/contexts (a 404 for it)."""
    missing = str(tmp_path / "nope.txt")
    assert main(["ask", "--context", missing, "--budget", "64", "hi"]) == 2
    assert f"--context {missing}: cannot read {missing!r}" in capsys.readouterr().err
    document = tmp_path / "doc.txt"
    document.write_text("The passcode is 4417.")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["ask", "--server", closed, "--context", str(document), "hi"]) == 2
    assert f"--server {closed}: no OpenAI-compatible server answers there" in (
        capsys.readouterr().err
    )

    class NoContexts(BaseHTTPRequestHandler):
        def do_GET(self):  # /v1/models
            body = json.dumps({"data": [{"id": "other"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NoContexts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["ask", "--server", url, "--context", str(document), "hi"]) == 2
        assert f"--server {url} keeps no contexts (POST /v1/contexts: 404)" in (
            capsys.readouterr().err
        )
    finally:
        server.shutdown()
        server.server_close()


def test_serve_and_kvzip_heads_fail_before_loading_where_they_cannot_run(tmp_path, capsys):
    """A port out of range or already listened on, a host that does not resolve, a missing
    calibration text: one line each, before the model loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, match in (
            (["--port", "99999"], "--port 99999 must be in [0, 65535]"),
            (["--port", str(port)], f"--host 127.0.0.1 --port {port}: cannot listen there"),
            (["--host", "no-such-host.invalid"], "--host no-such-host.invalid --port 8000: cannot"),
        ):
            assert main(["serve", "--model", "no-such-model", *args]) == 2
            assert match in capsys.readouterr().err
    missing = str(tmp_path / "nope.txt")
    assert main(["kvzip-heads", "--context", missing, "--out", str(tmp_path / "h.json")]) == 2
    assert f"--context {missing}: cannot read {missing!r}" in capsys.readouterr().err


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
