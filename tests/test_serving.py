"""Serving: slots equal each request alone (SmolLM2 with eviction; a tiny model sampling, with the
full and the paged cache), nothing compiles after warm-up, the OpenAI-compatible server (official
client, streaming and not, concurrent), malformed requests, a full queue, a client that disconnects,
the CLI and SIGTERM, and a mesh of two devices."""

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
from helpers import wait_for, xla_env

import kvjax
from kvjax.serving import Driver, Engine, QueueFull
from kvjax.serving.launch import ServeProcess
from kvjax.serving.server import ServerThread, create_app

TESTS = Path(__file__).resolve().parent
# SmolLM2: prompts of 37-120 tokens kept to 32 per layer and KV head, evicting after every 32-token
# block and every decode step.
SMOL = dict(budget=32, scorer="snapkv", obs_window=8, block_size=32)
SMOL_ENGINE = dict(slots=3, max_prompt=128, max_new_tokens=16)
QUESTIONS = [
    "What is the capital of France?",
    "The grass is green. The sky is blue. The sun is yellow. Name the three colours you just read "
    "about.",
    "I am planning a trip to Europe next summer. I would like to visit museums, eat good food, "
    "walk along "
    "rivers and see old churches, and I will travel by train between the cities. Before I book "
    "anything, "
    "I have a simple geography question. What is the capital of Italy?",
    "Write a haiku about the sea, the wind, the salt and the boats that come home in the evening.",
    "List the first five prime numbers, then explain in one sentence what makes a number prime, "
    "and give "
    "an example of a number that is not prime because it has more than two divisors, such as "
    "twelve.",
]
TINY = dict(budget=24, scorer="snapkv", obs_window=8, block_size=16)
TINY_ENGINE = dict(
    slots=4, max_prompt=64, max_new_tokens=24
)  # the vocabulary-97 model's (shared compilations)
SERVE_ENGINE = dict(slots=1, max_prompt=64, max_new_tokens=3000)  # the HTTP tests' tiny engine


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama over SmolLM2's vocabulary (so its tokenizer serves it) that never stops
    by itself."""
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=49152,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=48,
        max_seq_len=4096,
        rope_theta=10000.0,
        norm_eps=1e-5,
        eos_token_ids=(),
        pad_token_id=0,
    )
    return kvjax.init_params(cfg, jax.random.key(0), scale=0.3)


@pytest.mark.smollm2
def test_each_slot_equals_generate_alone(smollm2, smollm2_tokenizer):
    """Five prompts of 37-120 tokens through three slots, admitted at different decode steps (two at
    once, a third while they decode, two more as slots free up): each greedy answer equals
    kvjax.generate alone (MomentKV's slots, whose sums move with their rows:
    test_paged_and_moment_slots_equal_generate_alone)."""
    kw = SMOL
    prompts = [kvjax.chat_tokens(smollm2_tokenizer, q) for q in QUESTIONS]
    limits = [12, 6, 10, 8, 9]
    assert all(kw["budget"] < len(p) <= 128 for p in prompts)
    driver = Driver(Engine(smollm2, **SMOL_ENGINE, **kw)).start()
    try:
        requests = [driver.submit(p, max_new_tokens=n) for p, n in zip(prompts[:2], limits[:2])]
        wait_for(lambda: len(requests[0].tokens) >= 2, what="the first tokens")
        requests += [driver.submit(p, max_new_tokens=n) for p, n in zip(prompts[2:], limits[2:])]
        outputs = [r.result(300) for r in requests]
    finally:
        driver.stop()
    for prompt, n, out, r in zip(prompts, limits, outputs, requests):
        reference = [int(t) for t in kvjax.generate(smollm2, prompt, max_new_tokens=n, **kw)]
        assert out == reference, (
            len(prompt),
            smollm2_tokenizer.decode(out),
            smollm2_tokenizer.decode(reference),
        )
        assert r.finish_reason == ("stop" if reference[-1] == 2 else "length")
    assert driver.counts["admitted"] == 5 and driver.counts["steps"] < sum(len(o) for o in outputs)
    assert "Paris" in smollm2_tokenizer.decode(outputs[0])


def test_sampling_and_full_cache_slots_equal_generate_alone(tiny_llama):
    """Greedy and sampled requests side by side (a seed draws what kvjax.generate draws with it,
    top-k and top-p included), with eviction and with the full cache (budget=None)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 97, n) for n in (5, 30, 27, 12, 20)]
    settings = [
        dict(),
        dict(temperature=0.8, seed=5),
        dict(temperature=1.5, top_k=5, seed=3),
        dict(temperature=0.8, seed=7),
        dict(temperature=1.2, top_p=0.8, seed=2),
    ]
    for eviction in (TINY, {}):
        driver = Driver(Engine(tiny_llama, **TINY_ENGINE, **eviction)).start()
        try:
            requests = [
                driver.submit(p, max_new_tokens=10 + i, **s)
                for i, (p, s) in enumerate(zip(prompts, settings))
            ]
            outputs = [r.result(120) for r in requests]
        finally:
            driver.stop()
        for i, (p, s, out) in enumerate(zip(prompts, settings, outputs)):
            assert out == [
                int(t)
                for t in kvjax.generate(tiny_llama, p, max_new_tokens=10 + i, **s, **eviction)
            ], i


@pytest.mark.parametrize("scorer", ["adakv", "momentkv", "expected-attention"])
def test_paged_and_moment_slots_equal_generate_alone(tiny_llama, scorer):
    """AdaKV's allocation runs on the paged cache (page pools per row, page tables per head): insert
    writes its rows like the dense cache's. MomentKV's slots carry the sums of what they evicted;
    Expected Attention's, the statistics of their queries beside RoPE's frequencies, which every
    row shares (no "batch" axis)."""
    eviction = TINY | dict(scorer=scorer)
    prompts = [np.random.default_rng(2).integers(4, 97, n) for n in (30, 9, 27, 31)]
    driver = Driver(Engine(tiny_llama, **(TINY_ENGINE | dict(slots=2)), **eviction)).start()
    try:
        outputs = [r.result(120) for r in [driver.submit(p, max_new_tokens=12) for p in prompts]]
    finally:
        driver.stop()
    for p, out in zip(prompts, outputs):
        assert out == [int(t) for t in kvjax.generate(tiny_llama, p, max_new_tokens=12, **eviction)]


@pytest.mark.parametrize(
    ("eviction", "kv_dtype"),
    [(TINY, "int8"), (TINY | dict(scorer="adakv"), "int4"), ({}, "float8_e4m3fn")],
    ids=["snapkv-int8", "adakv-int4", "full-float8"],
)
def test_quantized_slots_equal_generate_alone(tiny_llama, eviction, kv_dtype):
    """kv_dtype: a slot's cache (dense, paged, full) is quantized as kvjax.generate's, and the
    prompt rows' chunks give it the same codes."""
    eviction = eviction | dict(kv_dtype=kv_dtype)
    prompts = [np.random.default_rng(4).integers(4, 97, n) for n in (30, 9, 27)]
    driver = Driver(Engine(tiny_llama, **(TINY_ENGINE | dict(slots=2)), **eviction)).start()
    try:
        outputs = [r.result(120) for r in [driver.submit(p, max_new_tokens=8) for p in prompts]]
    finally:
        driver.stop()
    for p, out in zip(prompts, outputs):
        assert out == [int(t) for t in kvjax.generate(tiny_llama, p, max_new_tokens=8, **eviction)]


def test_a_long_prompt_is_prefilled_a_chunk_per_decode_step(tiny_llama):
    """A slot decoding while a prompt of 12 chunks arrives gets a token at every chunk (prefill and
    decode share each step: the running slot never waits for the whole prompt), and both answers
    equal kvjax.generate alone, with the full cache and with eviction."""
    rng = np.random.default_rng(3)
    short, long = rng.integers(4, 97, 9), rng.integers(4, 97, 190)
    for eviction in (TINY, {}):
        engine = Engine(
            tiny_llama,
            **(TINY_ENGINE | dict(max_prompt=200, max_new_tokens=40)),
            prefill_chunk=16,
            **eviction,
        )
        assert engine.chunk_size == 16 and -(-len(long) // 16) == 12
        events = []
        driver = Driver(engine).start()
        try:
            first = driver.submit(
                short,
                max_new_tokens=40,
                stop_ids=(),
                on_update=lambda t, _: events.extend(("short", x) for x in t),
            )
            wait_for(lambda: len(first.tokens) >= 2, what="the short prompt decoding")
            at_submit = len(events)
            second = driver.submit(
                long,
                max_new_tokens=5,
                stop_ids=(),
                on_update=lambda t, _: events.extend(("long", x) for x in t),
            )
            outputs = [first.result(120), second.result(120)]
        finally:
            driver.stop()
        during = [
            e for e in events[at_submit : events.index(("long", outputs[1][0]))] if e[0] == "short"
        ]
        assert len(during) >= 12 - 1, len(during)  # a token per chunk while the long prompt was fed
        for prompt, out, n in zip((short, long), outputs, (40, 5)):
            assert out == [
                int(t)
                for t in kvjax.generate(
                    tiny_llama, prompt, max_new_tokens=n, stop_ids=(), **eviction
                )
            ]


def test_a_prompt_promoted_into_a_cancelled_slot_gets_only_its_own_tokens(tiny_llama):
    """Two slots: A decodes, B is cancelled mid-decode (its row is not done, so the engine still
    decodes it), C takes B's slot, prefilled in chunks while A decodes and promoted in a step
    whose decode tokens for that slot were B's. C's tokens equal kvjax.generate alone (found by
    the soak: such a stale token was handed to C as its first)."""
    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(4, 97, n) for n in (9, 11, 40))
    for eviction in (TINY, {}):
        engine = Engine(
            tiny_llama,
            **(TINY_ENGINE | dict(slots=2, max_new_tokens=60)),
            prefill_chunk=16,
            **eviction,
        )
        driver = Driver(engine).start()
        try:
            first = driver.submit(a, max_new_tokens=60, stop_ids=())
            second = driver.submit(b, max_new_tokens=60, stop_ids=())
            wait_for(lambda: len(second.tokens) >= 2, what="both slots decoding")
            third = driver.submit(c, max_new_tokens=6, stop_ids=())  # waits for a free slot
            second.cancel()
            out = third.result(120)
            first.result(120)
        finally:
            driver.stop()
        assert driver.counts["cancelled"] == 1
        alone = kvjax.generate(tiny_llama, c, max_new_tokens=6, stop_ids=(), **eviction)
        assert out == [int(t) for t in alone]


def test_slots_from_memory(tiny_llama):
    """Engine.for_memory: as many slots as the bytes hold with the prompt rows (one more would not
    fit), the full cache's slots sized by its context, a budget cache's by its budget; too little
    memory is an error."""
    kw = dict(max_prompt=200, max_new_tokens=24)
    for eviction in (TINY, {}):
        engine = Engine.for_memory(tiny_llama, 8 << 20, **kw, **eviction)
        m = engine.memory()
        used = m["slot_bytes"] * m["slots"] + m["prompt_bytes"]
        assert (
            used <= 8 << 20 < used + m["slot_bytes"]
            and m["cache_bytes"] == m["slot_bytes"] * m["slots"]
        )
        # the full cache: 200 prompt tokens in chunks of 128 (256) and 24 new, rounded up to 256
        assert m["tokens_per_slot"] == (24 if eviction else 512) and m["per_kv_head"] == bool(
            eviction
        )
    with pytest.raises(ValueError, match="holds no slot"):
        Engine.for_memory(tiny_llama, 1000, **kw)
    # a size as --kv-memory reads it; a number that is not bytes is named
    assert Engine.for_memory(tiny_llama, "8MiB", **kw).slots == engine.slots  # the full cache
    with pytest.raises(ValueError, match="kv_memory 'lots': give bytes with a unit"):
        Engine.for_memory(tiny_llama, "lots", **kw)
    with pytest.raises(TypeError, match="kv_memory=0.5 must be bytes"):
        Engine.for_memory(tiny_llama, 0.5, **kw)
    assert Engine(tiny_llama, slots=np.int64(2), **kw).slots == 2  # a count from NumPy
    with pytest.raises(ValueError, match="slots: an engine sized by kv_memory"):
        Engine.for_memory(tiny_llama, 1 << 30, slots=3, **kw)


def test_kv_memory_sizes_and_random_shapes():
    """--kv-memory's sizes and their errors; random:<shape> models load with a byte-level tokenizer,
    and an unknown shape names the known ones."""
    from kvjax.runtime.options import memory_bytes

    assert (memory_bytes("60GiB"), memory_bytes("512MiB"), memory_bytes("2GB")) == (
        60 << 30,
        512 << 20,
        2 * 10**9,
    )
    for bad in ("lots", "-1GB", "0"):
        with pytest.raises(ValueError, match=f"--kv-memory '{bad}': give bytes with a unit"):
            memory_bytes(bad, "--kv-memory")
    with pytest.raises(ValueError, match="a fraction needs a device that reports its memory"):
        memory_bytes("0.5")  # the CPU reports none
    params, tokenizer = kvjax.load("random:tiny"), kvjax.load_tokenizer("random:tiny")
    assert params.config.vocab_size == 512 and params.layers.wqkv.shape[0] == 2
    ids = tokenizer("hi there", add_special_tokens=False)["input_ids"]
    assert ids == list(b"hi there") and tokenizer.decode(ids + [300]) == "hi there<|300|>"
    assert kvjax.chat_tokens(tokenizer, "hi")[-len("<|assistant|>") :] == list(b"<|assistant|>")
    with pytest.raises(ValueError, match="random:llama-3.1-8b"):
        kvjax.load("random:nope")


def test_nothing_compiles_after_warmup(tiny_llama, count_compiles):
    """50 requests of mixed lengths, limits, sampling settings and stop ids after warm-up: no
    compilation. Without warm-up the same count sees the compilations (the check can fail)."""
    rng = np.random.default_rng(0)
    samplings = [
        dict(),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=5),
        dict(stop_ids=(7, 9)),
    ]

    def serve(engine, n):
        driver = Driver(engine, queue_size=n).start()
        try:
            requests = [
                driver.submit(
                    rng.integers(0, 97, int(rng.integers(1, 201))),
                    max_new_tokens=int(rng.integers(1, 25)),
                    seed=i,
                    **samplings[i % 4],
                )
                for i in range(n)
            ]
            return [r.result(120) for r in requests]
        finally:
            driver.stop()

    engine = Engine(tiny_llama, **(TINY_ENGINE | dict(max_prompt=200)), prefill_rows=4, **TINY)
    assert (engine.chunk_size, engine.prefill_rows) == (16, 4)  # prompts of up to 13 chunks
    engine.warmup()
    with count_compiles() as after_warmup:
        outputs = serve(engine, 50)
    assert len(outputs) == 50 and all(outputs)
    assert after_warmup["n"] == 0
    with count_compiles() as cold:
        serve(Engine(tiny_llama, **(TINY_ENGINE | dict(slots=5, max_prompt=200)), **TINY), 3)
    assert cold["n"] > 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(slots=0), "slots=0 must be an integer >= 1"),
        (dict(max_prompt=4080), r"max_prompt=4080 must be an integer in \[1, 4072\]"),
        (dict(budget=0.5), "budget=0.5: an engine's budget is fixed"),
        (
            dict(budget=64, evict_every=2),
            "evict_every=2: the serving engine evicts after every decode step",
        ),
        (
            dict(budget=64, scorer="kvzip-head", head_scores="x.json"),
            "scores a whole prompt in a pass of its own",
        ),
    ],
)
def test_engine_settings_are_checked(tiny, kw, match):
    with pytest.raises(ValueError, match=match):
        Engine(tiny, **({"max_new_tokens": 24} | kw))


def test_request_settings_are_checked(tiny):
    engine = Engine(tiny, slots=1, max_prompt=64, max_new_tokens=8, **TINY)
    for kw, match in [
        (dict(tokens=np.arange(65)), "exceeds the engine's max_prompt=64"),
        (dict(max_new_tokens=9), r"max_new_tokens=9 must be in \[1, 8\]"),
        (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(seed=-3), "seed=-3 must be an integer"),
        (dict(stop_ids=range(9)), "at most 8 ids"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.inputs(**({"tokens": [5, 6]} | kw))


# --- the HTTP server


@pytest.fixture(scope="module")
def smol_server(smollm2, smollm2_tokenizer):
    driver = Driver(Engine(smollm2, **SMOL_ENGINE, **SMOL)).start()
    with ServerThread(create_app(driver, "smollm2", smollm2_tokenizer)) as server:
        yield server, driver
    driver.stop()


@pytest.mark.smollm2
def test_concurrent_http_requests_equal_generate_alone(smollm2, smollm2_tokenizer, smol_server):
    """Six requests at once from the official client (chat and completions, streamed and not)
    through three
    slots: each answer is kvjax.generate's alone, with the right finish reason and usage."""
    server, _ = smol_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    raw = (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
        "The grass "
        "is green. The sky is blue. The sun is yellow. Here we go. The colour of the grass is"
    )
    cases = [
        ("chat", QUESTIONS[0], 12, False),
        ("chat", QUESTIONS[1], 10, True),
        ("completion", raw, 8, False),
        ("completion", raw[:150], 11, True),
        ("chat", QUESTIONS[2], 9, True),
        ("chat", QUESTIONS[3], 16, False),
    ]

    def ask(case):
        kind, text, n, stream = case
        common = dict(model="smollm2", max_tokens=n, temperature=0, stream=stream)
        if stream:
            common["stream_options"] = {"include_usage": True}
        if kind == "chat":
            reply = client.chat.completions.create(
                messages=[{"role": "user", "content": text}], **common
            )
        else:
            reply = client.completions.create(prompt=text, **common)
        if not stream:
            choice = reply.choices[0]
            return (
                choice.message.content if kind == "chat" else choice.text,
                choice.finish_reason,
                reply.usage,
            )
        pieces, reason, usage = [], None, None
        for chunk in reply:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append((choice.delta.content if kind == "chat" else choice.text) or "")
                reason = choice.finish_reason or reason
        return "".join(pieces), reason, usage

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    for (kind, text, n, _), (answer, reason, usage) in zip(cases, answers):
        ids = (
            kvjax.chat_tokens(smollm2_tokenizer, text)
            if kind == "chat"
            else smollm2_tokenizer(text)["input_ids"]
        )
        assert len(ids) > SMOL["budget"]
        reference = kvjax.generate(smollm2, ids, max_new_tokens=n, **SMOL)
        assert answer == smollm2_tokenizer.decode(reference, skip_special_tokens=True)
        assert reason == ("stop" if reference[-1] == 2 else "length")
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(reference))
    assert "Paris" in answers[0][0]


MALFORMED = [  # (what, path, body, status, param)
    ("invalid JSON", "/v1/completions", '{"model": "smollm2", "prompt": ', 400, None),
    ("a body that is not an object", "/v1/completions", "[1, 2]", 422, None),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 422, "model"),
    ("missing prompt", "/v1/completions", {"model": "smollm2"}, 422, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "smollm2"}, 422, "messages"),
    (
        "max_tokens of the wrong type",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "max_tokens": "5"},
        422,
        "max_tokens",
    ),
    (
        "stream of the wrong type",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "stream": "yes"},
        422,
        "stream",
    ),
    (
        "a prompt of the wrong type",
        "/v1/completions",
        {"model": "smollm2", "prompt": 42},
        422,
        "prompt",
    ),
    (
        "an unknown role",
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "robot", "content": "x"}]},
        422,
        "messages",
    ),
    ("no messages", "/v1/chat/completions", {"model": "smollm2", "messages": []}, 422, "messages"),
    ("an unknown model", "/v1/completions", {"model": "gpt-7", "prompt": "hi"}, 404, "model"),
    (
        "a negative temperature",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "temperature": -0.5},
        422,
        "temperature",
    ),
    (
        "top_p of 0",
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "top_p": 0},
        422,
        "top_p",
    ),
    (
        "top_p above 1",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "top_p": 1.5},
        422,
        "top_p",
    ),
    (
        "max_tokens of 0",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "max_tokens": 0},
        422,
        "max_tokens",
    ),
    (
        "max_tokens above the server's limit",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "max_tokens": 17},
        400,
        "max_tokens",
    ),
    ("n of 2", "/v1/completions", {"model": "smollm2", "prompt": "hi", "n": 2}, 400, "n"),
    (
        "an unsupported field",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "logprobs": 3},
        422,
        "logprobs",
    ),
    (
        "a prompt beyond max_prompt",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hello " * 200},
        400,
        "prompt",
    ),
    ("an empty prompt", "/v1/completions", {"model": "smollm2", "prompt": ""}, 400, "prompt"),
    (
        "token ids outside the vocabulary",
        "/v1/completions",
        {"model": "smollm2", "prompt": [5, 10**6]},
        400,
        None,
    ),
    (
        "five stop strings",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "stop": list("abcde")},
        400,
        "stop",
    ),
    (
        "a negative seed",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "seed": -1},
        422,
        "seed",
    ),
    (
        "a seed past the engine's range",
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "seed": 2**40},
        422,
        "seed",
    ),
    ("an unknown route", "/v1/embeddings", {"model": "smollm2", "input": "hi"}, 404, None),
]


@pytest.mark.smollm2
def test_malformed_requests_are_openai_errors_and_the_server_keeps_serving(smol_server):
    server, driver = smol_server
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for what, path, body, status, param in MALFORMED:
            content = body if isinstance(body, str) else json.dumps(body)
            reply = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert reply.status_code == status, (what, reply.text)
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], (
                what,
                error,
            )
            assert error["param"] == param, (what, error)
        assert http.get("/v1/completions").status_code == 405
        assert http.get("/v1/models/gpt-7").json()["error"]["code"] == "model_not_found"
        assert http.get("/v1/models").json()["data"][0]["id"] == "smollm2"
        assert http.get("/health").json()["status"] == "ok"
        ok = http.post(
            "/v1/completions",
            json={
                "model": "smollm2",
                "prompt": "The capital of France is",
                "max_tokens": 4,
                "temperature": 0,
                "stop": " the",
            },
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in (
            "stop",
            "length",
        )
    assert driver.counts["error"] == 0


def test_stream_format_and_stop_strings(tiny, smollm2_tokenizer):
    """The raw server-sent events (OpenAI's chunks, then ``data: [DONE]``), and a stop string
    cutting the text."""
    driver = Driver(Engine(tiny, **SERVE_ENGINE, **TINY)).start()
    ids = smollm2_tokenizer("Once upon a time")["input_ids"]
    full = smollm2_tokenizer.decode(kvjax.generate(tiny, ids, max_new_tokens=20, **TINY))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    with (
        ServerThread(create_app(driver, "tiny", smollm2_tokenizer)) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        body = {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 20,
            "temperature": 0,
            "stream": True,
        }
        with http.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            events = [line for line in reply.iter_lines() if line]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert all(c["object"] == "text_completion" and c["model"] == "tiny" for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == full
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        for stream in (False, True):
            cut = openai.OpenAI(base_url=server.url + "/v1", api_key="-").completions.create(
                model="tiny",
                prompt="Once upon a time",
                max_tokens=20,
                temperature=0,
                stop=[stop],
                stream=stream,
            )
            choices = [c.choices[0] for c in cut] if stream else cut.choices
            assert "".join(c.text for c in choices) == full[: full.index(stop)]
            assert choices[-1].finish_reason == "stop"
    driver.stop()


def test_serve_bench_measures_a_live_server(tiny, smollm2_tokenizer, tmp_path):
    """benchmarks/serve_bench.py against a live server (the completions endpoint, token-id prompts,
    all at once, 3 at a time): every request completes with its tokens (ignore_eos), and the saved
    result holds vLLM's figures."""
    from helpers import load_script

    bench = load_script("benchmarks/serve_bench.py")
    driver = Driver(Engine(tiny, **(SERVE_ENGINE | dict(slots=2)), **TINY)).start()
    with ServerThread(create_app(driver, "tiny", smollm2_tokenizer)) as server:
        code = bench.main(
            [
                "--base-url",
                server.url,
                "--model",
                "tiny",
                "--tokenizer",
                "smollm2-135m-instruct",
                "--backend",
                "openai",
                "--random-input-len",
                "40",
                "--random-output-len",
                "5",
                "--num-prompts",
                "6",
                "--max-concurrency",
                "3",
                "--ignore-eos",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "r.json",
                "--goodput",
                "ttft:60000",
            ]
        )
    driver.stop()
    result = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and result["completed"] == 6 and result["total_output_tokens"] == 30
    assert result["total_input_tokens"] == 240 and result["request_goodput"] > 0
    for name in ("ttft", "tpot", "itl"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["output_throughput"] > 0 and len(result["itls"]) == 6


def test_full_queue_answers_429(tiny, smollm2_tokenizer):
    """With the driver not yet started nothing leaves the queue: two requests fill it, the third is
    a 429 (openai.RateLimitError); once started, the two are answered."""
    driver = Driver(Engine(tiny, **SERVE_ENGINE, **TINY), queue_size=2)
    with ServerThread(create_app(driver, "tiny", smollm2_tokenizer)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)

        def ask():
            return (
                client.completions.create(model="tiny", prompt="hello", max_tokens=4)
                .choices[0]
                .text
            )

        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(ask) for _ in range(2)]
            wait_for(lambda: driver.waiting == 2, what="two queued requests")
            with pytest.raises(openai.RateLimitError) as error:
                ask()
            assert error.value.status_code == 429 and error.value.body["code"] == "queue_full"
            with pytest.raises(QueueFull):
                driver.submit([1, 2, 3])
            assert httpx.get(server.url + "/health").status_code == 503  # not started yet
            driver.start()
            assert all(isinstance(w.result(60), str) for w in waiting)
    driver.stop()
    assert driver.counts["length"] == 2


def test_a_client_that_disconnects_frees_its_slot(tiny, smollm2_tokenizer):
    """One slot: a streaming client asks for 3000 tokens, reads two chunks and hangs up; the slot is
    freed (its request cancelled well before its limit) and serves the next request."""
    driver = Driver(Engine(tiny, **SERVE_ENGINE, **TINY)).start()
    with ServerThread(create_app(driver, "tiny", smollm2_tokenizer)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt="hello", max_tokens=3000, stream=True
        )
        for _, _ in zip(stream, range(2)):
            pass
        stream.close()
        wait_for(lambda: driver.counts["cancelled"] == 1, what="the cancellation")
        assert driver.active == 0
        reply = client.completions.create(
            model="tiny", prompt="hello again", max_tokens=5, temperature=0
        )
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    driver.stop()
    assert driver.counts == driver.counts | {"admitted": 2, "cancelled": 1, "length": 1}
    assert driver.counts["steps"] < 3000


def test_cli_serve_help_and_early_errors(capsys):
    from kvjax.cli.main import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for option in (
        "--host",
        "--port",
        "--slots",
        "--max-prompt",
        "--max-tokens",
        "--queue",
        "--mesh",
        "--budget",
        "--scorer",
        "--allocation",
        "--no-warmup",
        "--context-slots",
        "--context-evict-slots",
    ):
        assert option in text
    assert main(["serve", "--model", "no-such-model", "--budget", "8"]) == 2
    assert "budget=8 must be larger than n_sink + window" in capsys.readouterr().err
    assert main(["serve", "--model", "no-such-model", "--context-evict-slots", "2"]) == 2
    assert "--context-evict-slots=2 needs --context-slots >= 1" in capsys.readouterr().err


def test_cli_serve_finishes_requests_in_flight_on_sigterm(tiny, smollm2_tokenizer, tmp_path):
    """``python -m kvjax serve`` on a saved tiny checkpoint: SIGTERM while a 100-token stream is in
    flight; the stream still ends with all its tokens and [DONE], then the process exits with 0."""
    from kvjax.checkpoint.store import write_checkpoint
    from kvjax.model.params import params_to_flat

    model = tmp_path / "tiny-serve"
    write_checkpoint(str(model), tiny.config, params_to_flat(tiny), tokenizer=smollm2_tokenizer)
    args = [str(model), "--slots", "1", "--max-prompt", "32", "--max-tokens", "100"]
    args += ["--log-level", "warning", "--budget", "24", "--obs-window", "8", "--block-size", "16"]
    log = (tmp_path / "serve.log").open("w")
    with log, ServeProcess(["--model", *args], timeout=120, cwd=TESTS.parent, stdout=log) as server:
        url = server.url
        events, first = [], threading.Event()

        def stream():
            body = {
                "model": "tiny-serve",
                "prompt": "hello",
                "max_tokens": 100,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    if line:
                        events.append(line)
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        code = server.stop(signal.SIGTERM, timeout=60)
        reader.join(60)
    assert code == 0
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][6:])["usage"]
    assert usage["completion_tokens"] == 100, events[-3:]


def test_engine_on_a_mesh_of_two_devices():
    """tests/serving_mesh_check.py with two fake CPU devices: slots split over data=2 equal the
    one-device run, for prompts and for questions continuing compressed contexts."""
    env = os.environ | xla_env(2) | {"PYTHONPATH": str(TESTS)}
    result = subprocess.run(
        [sys.executable, str(TESTS / "serving_mesh_check.py")],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "mesh ok" in result.stdout and "contexts on the mesh ok" in result.stdout


def test_serve_process_says_when_the_server_exits_or_is_not_ready(tmp_path):
    """``ServeProcess``: a server that exits before it is ready (an unknown model) is a RuntimeError
    naming its exit status; one not ready in time is killed and a TimeoutError."""
    log = (tmp_path / "serve.log").open("w")
    with log, pytest.raises(RuntimeError, match="kvjax serve exited with status 2"):
        ServeProcess(["--model", "no-such-model"], cwd=TESTS.parent, stdout=log)
    assert "no-such-model" in (tmp_path / "serve.log").read_text()
    log = (tmp_path / "slow.log").open("w")
    with log, pytest.raises(TimeoutError, match="did not answer /health in 0 s"):
        ServeProcess(["--model", "random:tiny"], timeout=0.01, cwd=TESTS.parent, stdout=log)
