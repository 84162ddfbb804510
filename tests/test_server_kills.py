"""Nothing acknowledged is lost when ``kvjax serve`` dies: real server processes on 127.0.0.1
(``random:tiny``, its byte-level tokenizer) killed with SIGKILL while contexts are compressed and
written, and while 8 clients stream; a new process on the same directory serves every context
acknowledged with 201 before the kill, answer for answer, and leaves nothing of a cut write. The
states a kill can cut a write in are also made one by one (tests/test_serving_contexts.py)."""

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import wait_for

from kvjax.serving.launch import ServeProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "random:tiny"
MAX_NEW = 6
STREAMED = 200  # tokens each streaming client asks for: still streaming when the kill comes
QUESTION = "Which word comes first?"


def document(i: int) -> str:
    """A document of about 300 bytes (tokens, for the byte-level tokenizer), distinct per i."""
    words = [f"w{(i * 7919 + j * 104729) % 100003}" for j in range(50)]
    return f"Document {i}: " + " ".join(words) + "."


class Server:
    """``python -m kvjax serve`` over ``random:tiny`` with contexts stored under ``root``."""

    def __init__(self, root: Path):
        port = free_port()
        self.log = open(root.parent / f"serve-{port}.log", "w")  # noqa: SIM115
        args = ["--model", MODEL, "--slots", "8", "--max-prompt", "64"]
        args += ["--max-tokens", str(STREAMED), "--budget", "64", "--context-slots", "8"]
        args += ["--context-budget", "32", "--context-max-prompt", "512"]
        args += ["--contexts-dir", str(root), "--log-level", "warning"]
        try:
            self.server = ServeProcess(args, timeout=300, cwd=ROOT, stdout=self.log, port=port)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}\n{self.output()}") from e
        self.url = self.server.url
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def post(self, i: int) -> httpx.Response:
        return self.http.post("/v1/contexts", json={"model": MODEL, "document": document(i)})

    def ask(self, id: str) -> str:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_NEW,
            "temperature": 0,
            "context_id": id,
        }
        reply = self.http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    def stop(self, sig=signal.SIGKILL) -> int:
        code = self.server.stop(sig)
        self.http.close()
        self.log.close()
        return code


def stored_files(root: Path) -> list[str]:
    return sorted(os.listdir(root))


@pytest.fixture
def root(tmp_path, monkeypatch):
    """The contexts' directory. The servers share a compilation cache, as a user's restarts do
    (the CLI's default, kvjax.runtime.compilation_cache): later servers load what the first
    compiled."""
    monkeypatch.setenv("KVJAX_COMPILATION_CACHE", str(tmp_path / "jax-cache"))
    return tmp_path / "contexts"


def test_contexts_acknowledged_before_a_kill_are_served_after_it(root):
    """Contexts posted from 4 clients while the server is SIGKILLed mid-stream of compressions and
    writes (the kill comes while one is being written: its temporary directory exists); then 8
    streaming clients and a second SIGKILL; then SIGTERM with a stream in flight, which finishes.
    After each, a new process on the directory: every 201 before a kill answers as before; the
    context whose write was cut is absent; an unacknowledged one is absent or complete (its answer
    equals a fresh compression's); nothing but contexts and their records remains."""
    first = Server(root)
    acknowledged: dict[str, str] = {}  # id -> answer before the kill
    for i in range(2):
        made = first.post(i)
        assert made.status_code == 201, made.text
        acknowledged[made.json()["id"]] = first.ask(made.json()["id"])
    sent, replies, lock = threading.Event(), {}, threading.Lock()

    def post(i):
        try:
            reply = first.post(i)
        except httpx.TransportError:
            return
        with lock:
            replies[i] = reply
        sent.set()

    with ThreadPoolExecutor(4) as pool:  # 40 posts queue on the one compression worker
        for i in range(2, 42):
            pool.submit(post, i)
        assert sent.wait(120), first.output()  # at least one more acknowledged: compressions run
        writing = lambda: any(n.startswith(".") for n in stored_files(root))  # noqa: E731
        wait_for(writing, timeout=120, what="a context being written")
        first.stop()  # while that one is written and the next ones wait for the worker
    cut = {i for i in range(2, 42)} - set(replies)
    half_written = {n[1:25] for n in stored_files(root) if n.startswith(".")}
    assert cut, "the kill came after every compression: nothing was cut"
    for i, reply in replies.items():
        assert reply.status_code == 201, reply.text
        acknowledged[reply.json()["id"]] = None

    second = Server(root)
    assert not any(n.startswith(".") for n in stored_files(root)), stored_files(root)
    for id in half_written:  # absent, never half-read
        assert second.http.get(f"/v1/contexts/{id}").status_code == 404
    for id, answer in list(acknowledged.items()):
        got = second.ask(id)
        assert answer is None or got == answer, id
        acknowledged[id] = got
    listed = {c["id"] for c in second.http.get("/v1/contexts").json()["data"]}
    assert set(acknowledged) <= listed
    for i in sorted(cut)[:3]:  # one cut mid-write, if any, is absent or complete
        made = second.post(i)
        id = made.json()["id"]
        if made.status_code == 200:  # stored before the kill, never acknowledged
            kept = second.ask(id)
            assert second.http.delete(f"/v1/contexts/{id}").status_code == 200
            assert second.post(i).status_code == 201
            assert second.ask(id) == kept
        else:
            assert made.status_code == 201 and id not in listed
        acknowledged[id] = second.ask(id)
    started, done = threading.Barrier(9), []

    def stream(server, id):
        try:
            with httpx.stream(
                "POST", server.url + "/v1/chat/completions", json=streaming(id), timeout=120
            ) as reply:
                lines = reply.iter_lines()
                next(line for line in lines if line)
                started.wait(60)
                done.extend(line for line in lines if line == "data: [DONE]")
        except (httpx.TransportError, httpx.RemoteProtocolError):
            pass

    ids = list(acknowledged)
    readers = [threading.Thread(target=stream, args=(second, ids[k % len(ids)])) for k in range(8)]
    for reader in readers:
        reader.start()
    started.wait(120)
    assert second.stop() == -signal.SIGKILL
    for reader in readers:
        reader.join(60)
    assert len(done) < 8, "every stream ended before the kill"

    third = Server(root)
    for id, answer in acknowledged.items():
        assert third.ask(id) == answer, id
    started, done = threading.Barrier(2), []
    reader = threading.Thread(target=stream, args=(third, ids[0]))
    reader.start()
    started.wait(120)
    assert third.stop(signal.SIGTERM) == 0  # drains the stream in flight, then exits
    reader.join(60)
    assert done == ["data: [DONE]"]
    fourth = Server(root)
    for id, answer in acknowledged.items():
        assert fourth.ask(id) == answer, id
    assert fourth.stop(signal.SIGTERM) == 0
    names = stored_files(root)
    assert all(not n.startswith(".") for n in names), names
    assert {n for n in names if not n.endswith(".json")} == {n[:-5] for n in names if "." in n}


def streaming(id: str) -> dict:
    """A streamed greedy chat of STREAMED tokens on context ``id``."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": STREAMED,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "context_id": id,
    }
