"""Contexts in serving: a compressed context continues in an engine's slot exactly as
``kvjax.decode(..., evict=False)`` alone, for dense and paged allocations; the HTTP resource
``/v1/contexts`` with the official ``openai`` client (``context_id`` in ``extra_body``), streaming,
deduplication, a restart, deletion while a request runs, and the errors."""

import dataclasses
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import openai
import pytest

import kvjax
from kvjax.eviction import RepeatPrompt
from kvjax.loading import chat_parts
from kvjax.runtime.options import eviction_from, with_tokenizer
from kvjax.serving import Driver, Engine
from kvjax.serving.contexts import ContextService, ContextStore
from kvjax.serving.server import ServerThread, create_app

DOCUMENT = (
    "The lighthouse keeper of Skerry Point kept a ledger of every ship that passed. In the spring "
    "of the storm year he wrote that the ferry Maribel carried forty-two passengers and a crate of "
    "oranges, that the wind turned north at noon, and that the password for the signal room was "
    "blue heron. The ledger also lists the price of lamp oil, the names of his three dogs, and the "
    "day the old bell cracked in the cold."
)
QUESTIONS = ["What was the password?", "How many passengers?", "Name the ferry.", "What cracked?"]
CONTEXTS = dict(budget=32, scorer="kvzip")  # the server's default contexts: paged (global)
MAX_NEW = 8


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama over SmolLM2's vocabulary (its tokenizer serves it); it never stops."""
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=49152,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=48,
        max_seq_len=1024,
        rope_theta=10000.0,
        norm_eps=1e-5,
        eos_token_ids=(),
        pad_token_id=0,
    )
    return kvjax.init_params(cfg, jax.random.key(0), scale=0.3)


def alone(params, context, question) -> list[int]:
    """kvjax.decode of the context alone, stopping at no id (as the slots are: stop_ids=())."""
    return [
        int(t) for t in kvjax.decode(params, context, question, MAX_NEW, evict=False, stop_ids=())
    ]


def through_slots(params, eviction, seed, question_lengths, evict):
    """Two contexts (60 and 45 random tokens) and three questions of ``question_lengths`` asked
    through two slots of an engine of contexts (``evict`` as ``Engine``'s): (context, question,
    greedy answer) for each pair asked."""
    rng = np.random.default_rng(seed)
    contexts = [
        kvjax.prefill(params, rng.integers(10, 97, n).astype(np.int32), **eviction)
        for n in (60, 45)
    ]
    questions = [rng.integers(10, 97, n).astype(np.int32) for n in question_lengths]
    engine = Engine(
        params,
        slots=2,
        max_prompt=16,
        max_new_tokens=MAX_NEW,
        contexts=contexts[0].ev,
        evict=evict,
    )
    driver = Driver(engine).start()
    try:
        pairs = [(0, 0), (1, 1), (0, 2)]
        requests = [
            driver.submit(questions[q], context=contexts[c], max_new_tokens=MAX_NEW, stop_ids=())
            for c, q in pairs
        ]
        outputs = [r.result(300) for r in requests]
    finally:
        driver.stop()
    return [(contexts[c], questions[q], out) for (c, q), out in zip(pairs, outputs, strict=True)]


@pytest.mark.parametrize(
    "eviction",
    [
        dict(budget=24, scorer="snapkv", obs_window=8),  # uniform: dense
        dict(budget=40, scorer="pyramidkv", obs_window=4, n_sink=0),  # per-layer budgets: paged
        dict(budget=24, scorer="adakv", obs_window=8),  # per-head budgets: paged
        # a state per query head, folded into the slots' one per KV head (``Eviction.fit``)
        dict(budget=24, scorer="snapkv+caote", obs_window=8),
        dict(budget=24, scorer="kvzip", repeat_prompt=RepeatPrompt((5, 6, 7), (5, 6, 8), (9,))),
    ],
)
def test_a_context_continues_in_a_slot_as_decode_alone(tiny_llama, eviction):
    """Two contexts (different lengths) and three questions through two slots of an engine of
    contexts: each greedy answer equals kvjax.decode(..., evict=False) of the context alone."""
    asked = through_slots(tiny_llama, eviction, seed=1, question_lengths=(5, 12, 3), evict=False)
    for context, question, out in asked:
        assert out == alone(tiny_llama, context, question)


def test_a_global_context_continues_in_a_slot_as_decode_alone(tiny_llama):
    """global+kvzip puts no limit on one head (kvpress's KVzipPress()): contexts of 60 and 45
    tokens, one head holding more than n_kv_heads × budget, continue in slots (which hold a whole
    context in any head) as kvjax.decode alone."""
    cfg, layers = tiny_llama.config, tiny_llama.layers
    # layer 0's first KV head attends more sharply (its queries ×6), so its tokens score higher
    peaked = tiny_llama.replace(
        layers=layers.replace(wqkv=layers.wqkv.at[0, :, 0, : cfg.group_size].multiply(6))
    )
    eviction = dict(
        budget=5,
        n_sink=1,
        scorer="global+kvzip",
        repeat_prompt=RepeatPrompt((5, 6, 7), (5, 6, 8), (9,)),
    )
    asked = through_slots(peaked, eviction, seed=1, question_lengths=(5, 12, 3), evict=False)
    for context, question, out in asked:
        assert out == alone(peaked, context, question)
    held = max(int((np.asarray(c.cache.pos) >= 0).sum(-1).max()) for c, _, _ in asked)
    assert held > cfg.n_kv_heads * eviction["budget"]


@pytest.mark.parametrize(
    "eviction",
    [
        dict(budget=24, scorer="snapkv", obs_window=8),  # uniform: dense
        dict(budget=24, scorer="adakv", obs_window=8),  # per-head budgets: paged
    ],
)
def test_a_context_evicting_in_a_slot_answers_as_decode_alone(tiny_llama, eviction):
    """An engine of contexts with evict=True: the question and the answer are evicted under the
    context's budget, and each greedy answer equals kvjax.decode(..., evict=True) alone, which
    differs from the answer without eviction for at least one question."""
    asked = through_slots(tiny_llama, eviction, seed=3, question_lengths=(16, 12, 3), evict=True)
    kept = []
    for context, question, out in asked:
        evicted = kvjax.decode(tiny_llama, context, question, MAX_NEW, stop_ids=())
        assert out == [int(t) for t in evicted]
        kept.append(out == alone(tiny_llama, context, question))
    assert not all(kept)


def test_an_engine_of_contexts_refuses_what_does_not_fit(tiny_llama):
    rng = np.random.default_rng(2)
    ids = rng.integers(10, 97, 60).astype(np.int32)
    paged = kvjax.prefill(tiny_llama, ids, budget=24, scorer="adakv", obs_window=8)
    dense = kvjax.prefill(tiny_llama, ids, budget=24, scorer="snapkv", obs_window=8)
    driver = Driver(
        Engine(tiny_llama, slots=1, max_prompt=16, max_new_tokens=MAX_NEW, contexts=paged.ev)
    )
    with pytest.raises(
        ValueError, match=r"another slot geometry .*page_size=None \(the slots': 16\)"
    ):
        driver.submit(ids[:4], context=dense)
    with pytest.raises(ValueError, match="continues a stored context"):
        driver.submit(ids[:4])
    with pytest.raises(ValueError, match="exceed the model's context of 512"):
        long = kvjax.prefill(
            tiny_llama,
            rng.integers(10, 97, 500).astype(np.int32),
            budget=24,
            scorer="adakv",
            obs_window=8,
        )
        driver.submit(ids[:12], context=long, max_new_tokens=MAX_NEW)
    with pytest.raises(ValueError, match="contexts: an engine of contexts decodes under their"):
        Engine(tiny_llama, max_prompt=16, max_new_tokens=MAX_NEW, contexts=paged.ev, budget=24)
    evicting = Driver(
        Engine(tiny_llama, max_prompt=16, max_new_tokens=MAX_NEW, contexts=paged.ev, evict=True)
    )
    other = kvjax.prefill(tiny_llama, ids, budget=23, scorer="adakv", obs_window=8)
    driver.submit(ids[:4], context=other)  # the same slots without eviction (budget rounded up)
    with pytest.raises(ValueError, match=r"evicting context slots: budget=23 \(the slots': 24\)"):
        evicting.submit(ids[:4], context=other)
    kvzip = kvjax.prefill(
        tiny_llama, ids, budget=24, scorer="kvzip", repeat_prompt=RepeatPrompt((5,), (6,), (7,))
    )
    with pytest.raises(ValueError, match="scoring pass of their own and continue without"):
        Engine(tiny_llama, max_prompt=16, max_new_tokens=MAX_NEW, contexts=kvzip.ev, evict=True)
    with pytest.raises(ValueError, match="evict=True: an engine of contexts"):
        Engine(tiny_llama, max_prompt=16, max_new_tokens=MAX_NEW, evict=True, budget=24)


class Served:
    """A server over the tiny model: whole prompts (full cache) and contexts under ``root``."""

    def __init__(self, params, tokenizer, root, slots=2, defaults=CONTEXTS, evict_slots=0):
        template = eviction_from(**with_tokenizer(tokenizer, **defaults))
        self.engine, *evicting = [
            Engine(
                params,
                slots=n,
                max_prompt=64,
                max_new_tokens=MAX_NEW,
                contexts=template,
                evict=evict,
            )
            for n, evict in ((slots, False), (evict_slots, True))
            if n
        ]
        self.store = ContextStore(params, str(root), 1 << 30)
        self.contexts = ContextService(
            self.store,
            Driver(self.engine).start(),
            tokenizer,
            defaults,
            *[Driver(engine).start() for engine in evicting],
        )
        self.driver = Driver(
            Engine(params, slots=1, max_prompt=256, max_new_tokens=MAX_NEW)
        ).start()
        self.server = ServerThread(
            create_app(self.driver, "tiny", tokenizer, self.contexts)
        ).start()
        self.http = httpx.Client(base_url=self.server.url, timeout=300)
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0)

    def close(self):
        self.server.stop()
        self.contexts.close()
        self.contexts.driver.stop()
        if self.contexts.evict_driver is not None:
            self.contexts.evict_driver.stop()
        self.driver.stop()

    def ask(self, id, question, stream=False, evict=False):
        kw = dict(
            model="tiny",
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=MAX_NEW,
            extra_body={"context_id": id} | ({"context_evict": True} if evict else {}),
        )
        if not stream:
            return self.client.chat.completions.create(**kw).choices[0].message.content
        chunks = self.client.chat.completions.create(stream=True, **kw)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def expected(params, tokenizer, context, question, evict=False) -> str:
    """What kvjax ask answers: the question's rest of the user turn after the document (evict: as
    kvjax.decode(..., evict=True))."""
    ids = chat_parts(tokenizer, "", question)[1]
    if evict:
        return tokenizer.decode(kvjax.decode(params, context, ids, MAX_NEW, evict=True))
    return tokenizer.decode(alone(params, context, ids))


def test_contexts_over_http(tiny, smollm2_tokenizer, tmp_path):
    """POST a document once (twice: one compression), ask four questions from four clients at once
    and one streaming: each answer equals kvjax.decode alone; GET lists it; a restarted server
    finds it; DELETE removes it while a request on it still finishes."""
    served = Served(tiny, smollm2_tokenizer, tmp_path / "contexts")
    try:
        made = served.http.post("/v1/contexts", json={"model": "tiny", "document": DOCUMENT})
        assert made.status_code == 201, made.text
        card = made.json()
        again = served.http.post("/v1/contexts", json={"model": "tiny", "document": DOCUMENT})
        assert again.status_code == 200 and again.json()["id"] == card["id"]
        assert card["kept_slots"] < card["tokens"] * tiny.config.n_layers * tiny.config.n_kv_heads
        assert card["eviction"]["scorer"] == "kvzip" and "repeat_prompt" not in card["eviction"]
        context = served.store.get(card["id"])
        reference = kvjax.prefill(
            tiny,
            served.contexts.document_tokens(DOCUMENT),
            **with_tokenizer(smollm2_tokenizer, **CONTEXTS),
        )
        np.testing.assert_array_equal(context.logits, reference.logits)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda q: served.ask(card["id"], q), QUESTIONS))
        for question, answer in zip(QUESTIONS, answers, strict=True):
            assert answer == expected(tiny, smollm2_tokenizer, reference, question)
        assert served.ask(card["id"], QUESTIONS[0], stream=True) == answers[0]
        assert served.ask(card["id"], QUESTIONS[0], evict=True) == answers[0]  # kvzip: no eviction
        listed = served.http.get("/v1/contexts").json()["data"]
        assert [c["id"] for c in listed] == [card["id"]]
        assert served.http.get(f"/v1/contexts/{card['id']}").json() == card
    finally:
        served.close()

    restarted = Served(tiny, smollm2_tokenizer, tmp_path / "contexts", slots=1)
    try:
        assert restarted.http.get(f"/v1/contexts/{card['id']}").json() == card
        assert restarted.ask(card["id"], QUESTIONS[1]) == answers[1]
        started, chunks = threading.Event(), []

        def streaming():  # the one slot is busy with this request while the context is deleted
            kw = dict(
                model="tiny",
                messages=[{"role": "user", "content": QUESTIONS[2]}],
                temperature=0,
                max_tokens=MAX_NEW,
                stream=True,
                extra_body={"context_id": card["id"]},
            )
            for c in restarted.client.chat.completions.create(**kw):
                started.set()
                chunks.append(c.choices[0].delta.content or "" if c.choices else "")

        thread = threading.Thread(target=streaming)
        thread.start()
        assert started.wait(300)
        gone = restarted.http.delete(f"/v1/contexts/{card['id']}")
        assert gone.json() == {"id": card["id"], "object": "context.deleted", "deleted": True}
        thread.join(300)
        assert "".join(chunks) == answers[2]
        with pytest.raises(openai.NotFoundError) as missing:
            restarted.ask(card["id"], QUESTIONS[0])
        assert missing.value.code == "context_not_found"
        assert restarted.http.get(f"/v1/contexts/{card['id']}").status_code == 404
        assert restarted.http.delete(f"/v1/contexts/{card['id']}").status_code == 404
        assert restarted.http.get("/v1/contexts").json()["data"] == []
    finally:
        restarted.close()


def test_context_errors_over_http(tiny, smollm2_tokenizer, tmp_path):
    served = Served(tiny, smollm2_tokenizer, tmp_path / "contexts", slots=1)
    try:

        def post(**body):
            return served.http.post("/v1/contexts", json={"model": "tiny"} | body)

        bad = post(document=DOCUMENT, scorer="snapkv", obs_window=8)
        assert bad.status_code == 400 and "another slot geometry" in bad.json()["error"]["message"]
        assert "page_size=None (the slots': 16)" in bad.json()["error"]["message"]
        too_long = post(document="word " * 2000)
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        unknown = post(document=DOCUMENT, magic=3)
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "magic"
        assert post(document=DOCUMENT, budget=0).status_code == 400
        assert post().status_code == 400
        assert post(document=DOCUMENT, model="other").status_code == 404
        with pytest.raises(openai.NotFoundError, match="no context 'nope'"):
            served.ask("nope", "hi")
        made = post(document=DOCUMENT).json()
        with pytest.raises(openai.BadRequestError, match="one user message"):
            served.client.chat.completions.create(
                model="tiny",
                max_tokens=2,
                extra_body={"context_id": made["id"]},
                messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}],
            )
        with pytest.raises(openai.BadRequestError, match="exceed"):
            served.client.completions.create(
                model="tiny",
                prompt="word " * 70,
                max_tokens=2,
                extra_body={"context_id": made["id"]},
            )
        with pytest.raises(openai.BadRequestError, match="context_evict: applies to a question"):
            served.client.completions.create(
                model="tiny", prompt="hi", max_tokens=2, extra_body={"context_evict": True}
            )
        snapkv = post(document=DOCUMENT, scorer="snapkv", allocation="global", obs_window=8)
        assert snapkv.status_code == 201, snapkv.text
        assert served.ask(snapkv.json()["id"], "hi")  # the slots without eviction take it
        with pytest.raises(openai.BadRequestError, match="no slots that evict"):
            served.ask(snapkv.json()["id"], "hi", evict=True)
    finally:
        served.close()
    plain = Driver(Engine(tiny, slots=1, max_prompt=64, max_new_tokens=MAX_NEW)).start()
    with ServerThread(create_app(plain, "tiny", smollm2_tokenizer)) as server:
        answer = httpx.post(server.url + "/v1/contexts", json={"model": "tiny", "document": "x"})
        assert answer.status_code == 404 and "no contexts" in answer.json()["error"]["message"]
    plain.stop()


def test_questions_evicted_under_their_context_budget_over_http(tiny, smollm2_tokenizer, tmp_path):
    """A server with evicting context slots (SnapKV): context_evict=true answers as
    kvjax.decode(..., evict=True), streaming too; without it, as evict=False; a context of other
    settings is refused by the evicting slots only."""
    defaults = dict(budget=24, scorer="snapkv", obs_window=8)
    served = Served(tiny, smollm2_tokenizer, tmp_path / "contexts", 1, defaults, evict_slots=1)
    try:
        card = served.http.post("/v1/contexts", json={"model": "tiny", "document": DOCUMENT})
        assert card.status_code == 201, card.text
        id, context = card.json()["id"], served.store.get(card.json()["id"])
        evicted = [served.ask(id, q, evict=True) for q in QUESTIONS]
        kept = [served.ask(id, q) for q in QUESTIONS]
        for question, a, b in zip(QUESTIONS, evicted, kept, strict=True):
            assert a == expected(tiny, smollm2_tokenizer, context, question, evict=True)
            assert b == expected(tiny, smollm2_tokenizer, context, question)
        assert evicted != kept
        assert served.ask(id, QUESTIONS[0], stream=True, evict=True) == evicted[0]
        other = served.http.post(
            "/v1/contexts", json={"model": "tiny", "document": DOCUMENT, "budget": 20}
        ).json()
        assert served.ask(other["id"], QUESTIONS[0])
        with pytest.raises(openai.BadRequestError, match="evicting context slots: budget=20"):
            served.ask(other["id"], QUESTIONS[0], evict=True)
    finally:
        served.close()


def test_ask_with_a_server(tiny, smollm2_tokenizer, tmp_path):
    """``kvjax ask --server URL --context FILE QUESTION`` (a process of its own, no model loaded):
    the server compresses the document once and the answer is the server's own for it."""
    document = tmp_path / "doc.txt"
    document.write_text(DOCUMENT)
    served = Served(tiny, smollm2_tokenizer, tmp_path / "contexts", slots=1)

    def ask(*flags):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "kvjax",
                "ask",
                "--server",
                served.server.url,
                "--context",
                str(document),
                QUESTIONS[0],
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )

    try:
        done = ask("--max-new-tokens", str(MAX_NEW))
        assert done.returncode == 0, done.stderr
        [card] = served.http.get("/v1/contexts").json()["data"]
        assert f"context {card['id']}" in done.stderr and done.stderr.startswith("[compressed")
        assert (
            done.stdout == f"> {QUESTIONS[0]}\n{served.ask(card['id'], QUESTIONS[0]).strip()}\n\n"
        )
        refused = ask("--budget", "9999")
        assert refused.returncode == 2 and "another slot geometry" in refused.stderr
    finally:
        served.close()


def exactly(contexts, n: int) -> str:
    """A document of exactly ``n`` tokens once rendered (the template's tokens included)."""
    words = n
    while (got := len(contexts.document_tokens("a " * words))) != n:
        words += n - got
    return "a " * words


def test_bad_input_at_the_contexts_resource(tiny, smollm2_tokenizer, tmp_path):
    """docs/serving.md's table of bad input at /v1/contexts, row by row: each a clear 4xx (or the
    documented behaviour), the server unharmed (it answers afterwards), nothing written outside
    its directory."""
    root = tmp_path / "contexts"
    outside = tmp_path / "victim"
    outside.mkdir()
    (tmp_path / "victim.json").write_text("{}")
    served = Served(tiny, smollm2_tokenizer, root, slots=1)
    try:
        made = served.http.post("/v1/contexts", json={"model": "tiny", "document": DOCUMENT})
        good = made.json()["id"]
        answer = served.ask(good, QUESTIONS[0])
        n_ctx = tiny.config.max_seq_len

        def post(content=None, **body):
            if content is not None:
                return served.http.post(
                    "/v1/contexts", content=content, headers={"content-type": "application/json"}
                )
            return served.http.post("/v1/contexts", json={"model": "tiny"} | body)

        def error(reply, status, param=None, code=None, says=""):
            assert reply.status_code == status, reply.text
            e = reply.json()["error"]
            assert (param is None or e["param"] == param) and (code is None or e["code"] == code)
            assert says in e["message"], e["message"]

        error(post(document=""), 400, "document", says="document: empty")
        error(post(document=" \n\t"), 400, "document", says="document: empty")
        error(post(messages=[{"role": "user", "content": ""}]), 400, "messages", says="empty")
        error(
            post(document=exactly(served.contexts, n_ctx + 1)),
            400,
            "document",
            "context_length_exceeded",
            f"{n_ctx + 1} tokens exceed the model's context of {n_ctx}",
        )
        assert post(document=exactly(served.contexts, n_ctx)).status_code == 201
        error(
            post(content=b'{"model": "tiny", "document": "\xff\xfe\x00"}'),
            400,
            says="parsing the body",
        )
        error(post(content=b"\x89PNG\r\n\x1a\n\x00\x00"), 400, says="parsing the body")
        lone = b'{"model": "tiny", "document": "ok \\udcff"}'  # JSON's escape of a lone surrogate
        error(post(content=lone), 400, "document", says="not valid Unicode")
        error(post(document=DOCUMENT, budget=0), 400, "budget", says="budget=0")
        whole = post(document=DOCUMENT, budget=200)  # more than the document: keeps every token
        assert whole.status_code == 201 and whole.json()["tokens"] < 200, whole.text
        kept = whole.json()["kept_slots"]
        assert kept == whole.json()["tokens"] * tiny.config.n_layers * tiny.config.n_kv_heads
        error(post(document=DOCUMENT, budget=10**5), 400, says="another slot geometry")
        error(post(document=DOCUMENT, scorer="magic"), 400, "scorer", says="magic")
        error(post(document=DOCUMENT, temperature=3), 400, "temperature")
        error(post(document=DOCUMENT, model="other"), 404, "model", "model_not_found")
        for id in ("nope", "../victim", "..%2Fvictim", "%2E%2E%2Fvictim", good + "/x"):
            assert served.http.get(f"/v1/contexts/{id}").status_code == 404, id
            assert served.http.delete(f"/v1/contexts/{id}").status_code == 404, id
        for id in ("../victim", "/etc/passwd", "nope"):
            with pytest.raises(openai.NotFoundError):
                served.ask(id, "hi")
        assert outside.is_dir() and (tmp_path / "victim.json").read_text() == "{}"
        with ThreadPoolExecutor(8) as pool:  # DELETE and asks on one id at once
            asks = [pool.submit(ask_or_404, served, good) for _ in range(6)]
            gone = pool.submit(served.http.delete, f"/v1/contexts/{good}")
            got = [a.result() for a in asks]
        assert gone.result().status_code == 200
        assert all(a in (answer, 404) for a in got), got
        error(served.http.get(f"/v1/contexts/{good}"), 404, code="context_not_found")
        with pytest.raises(openai.NotFoundError):
            served.ask(good, "hi")
        again = post(document=DOCUMENT)
        assert again.status_code == 201 and served.ask(again.json()["id"], QUESTIONS[0]) == answer
        assert sorted(os.listdir(tmp_path)) == ["contexts", "victim", "victim.json"]
    finally:
        served.close()

    other = dataclasses.replace(tiny.config, d_ff=tiny.config.d_ff * 2)  # another model, same dir
    served = Served(kvjax.init_params(other, jax.random.key(1), scale=0.3), smollm2_tokenizer, root)
    try:
        assert served.http.get("/v1/contexts").json()["data"] == []
        error(served.http.get(f"/v1/contexts/{again.json()['id']}"), 404)
        with pytest.raises(openai.NotFoundError):
            served.ask(again.json()["id"], "hi")
    finally:
        served.close()


def ask_or_404(served, id):
    try:
        return served.ask(id, QUESTIONS[0])
    except openai.NotFoundError:
        return 404
