"""KVzip: the scores of Algorithm 1 (kvzip-appendix.tex) against a direct float64 NumPy computation
on a tiny model, the compression that keeps the top scores across a layer's KV heads, the head-level
mode with saved head scores, and the errors a user meets."""

import contextlib
import json

import jax
import numpy as np
import pytest
from reference_eviction import repeat_scores, run_kvzip_reference, shared_counts

import kvjax
from kvjax.runtime.kvzip_pass import (
    RepeatPrompt,
    head_scores,
    kvzip_scores,
    load_head_scores,
    save_head_scores,
)
from kvjax.runtime.options import EvictionOptions
from kvjax.runtime.prefilled import prefill_full

PROMPT = RepeatPrompt(first=(5, 6, 7), later=(5, 6, 8), colon=(9,))
CHUNK = 16


@pytest.fixture(scope="module")
def model():
    cfg = kvjax.ModelConfig(
        arch="qwen2",
        vocab_size=97,
        d_model=32,
        n_layers=2,
        n_heads=6,
        n_kv_heads=2,
        head_dim=8,
        d_ff=48,
        max_seq_len=512,
        norm_eps=1e-5,
        qkv_bias=True,
        eos_token_ids=(3,),
        pad_token_id=0,
    )
    return kvjax.init_params(cfg, jax.random.key(4), scale=0.4)


def numpy_kvzip(
    params, context: np.ndarray, chunk: int, prompt: RepeatPrompt = PROMPT
) -> np.ndarray:
    """Algorithm 1 as written, in float64 (``reference_eviction.repeat_scores``): S [L, Hk, n_c]."""
    return repeat_scores(params, context, prompt, chunk)


def test_scores_equal_algorithm_1(model):
    """Three chunks (the later ones start with the previous chunk's last 8 tokens) and a batch of
    two contexts of different lengths."""
    rng = np.random.default_rng(0)
    contexts = [
        rng.integers(10, 97, 41).astype(np.int32),
        rng.integers(10, 97, 23).astype(np.int32),
    ]
    shared = prefill_full(model, contexts)
    got = np.asarray(kvzip_scores(model, shared.cache.full, contexts, PROMPT, chunk=CHUNK))
    for row, context in enumerate(contexts):
        want = numpy_kvzip(model, context, CHUNK)
        np.testing.assert_allclose(got[:, row, :, : len(context)], want, rtol=1e-4, atol=1e-6)
        assert not got[:, row, :, len(context) :].any()
        assert (want > 0).all()
    np.testing.assert_allclose(
        head_scores(got, [41, 23]),
        np.maximum(
            numpy_kvzip(model, contexts[0], CHUNK).max(-1),
            numpy_kvzip(model, contexts[1], CHUNK).max(-1),
        ),
        rtol=1e-4,
    )


def test_kvpress_form_scores_equal_its_reference(model):
    """kvpress's form: the first 5 tokens (a chat template's head) neither repeated nor scored, 4
    sinks in every softmax, three chunks and a batch of two contexts of different lengths."""
    prompt = RepeatPrompt(first=(5, 6, 7, 11, 12), later=(5, 6, 8), colon=(11, 12), skip=5, sinks=4)
    rng = np.random.default_rng(5)
    contexts = [
        rng.integers(10, 97, 41).astype(np.int32),
        rng.integers(10, 97, 23).astype(np.int32),
    ]
    got = np.asarray(
        kvzip_scores(model, prefill_full(model, contexts).cache.full, contexts, prompt, chunk=CHUNK)
    )
    for row, context in enumerate(contexts):
        want = numpy_kvzip(model, context, CHUNK, prompt)
        np.testing.assert_allclose(got[:, row, :, : len(context)], want, rtol=1e-4, atol=1e-6)
        assert not got[:, row, :, :5].any() and (want[..., 5:] > 0).all()
    assert not np.allclose(
        got[:, 0, :, 5:41], numpy_kvzip(model, contexts[0], CHUNK)[..., 5:], rtol=1e-2
    )


@contextlib.contextmanager
def pass_traced_with(monkeypatch, **constants):
    """``kvjax.runtime.kvzip_pass``'s module ``constants`` set, read by the pass traced anew (JAX's
    caches cleared before and after)."""
    import kvjax.runtime.kvzip_pass as kvzip

    for name, value in constants.items():
        monkeypatch.setattr(kvzip, name, value)
    jax.clear_caches()
    try:
        yield
    finally:
        monkeypatch.undo()
        jax.clear_caches()


@pytest.mark.parametrize(
    "shift, ways",
    [(-50.0, [False, True] * 2), (200.0, [False, False])],
    ids=["scored-logits", "exponentials"],
)
def test_both_ways_to_the_weights_equal_the_reference(model, monkeypatch, shift, ways):
    """The pass takes a slot's weight from the attention's exponentials over their sum on the scored
    slots, and scores a chunk again from the scored logits alone where some query's scored
    exponentials sum below e^-SHIFT. Each way forced (SHIFT -50: every chunk twice; 200: once) on
    kvpress's form, whose template head is visible but not scored, over two chunks: the float64
    reference."""
    import kvjax.runtime.kvzip_pass as kvzip

    prompt = RepeatPrompt(first=(5, 6, 7, 11, 12), later=(5, 6, 8), colon=(11, 12), skip=5, sinks=4)
    contexts = [np.random.default_rng(6).integers(10, 97, 37).astype(np.int32)]
    full = prefill_full(model, contexts).cache.full
    exact, score_chunk = [], kvzip._score_chunk

    def spy(params, scoring, *rest):  # records each call's way
        exact.append(scoring.exact)
        return score_chunk(params, scoring, *rest)

    with pass_traced_with(monkeypatch, _score_chunk=spy, SHIFT=shift):
        got = np.asarray(kvzip_scores(model, full, contexts, prompt, chunk=CHUNK))
    assert exact == ways
    np.testing.assert_allclose(
        got[:, 0, :, :37], numpy_kvzip(model, contexts[0], CHUNK, prompt), rtol=1e-4, atol=1e-6
    )


def test_query_blocks_read_only_the_slots_they_can_see(model, monkeypatch):
    """Queries lo … hi − 1 of a repeat input read the slots below C + hi alone (C: the prefilled
    cache's 65 slots, the repeat input's 28 tokens written past a context of 63): in blocks of 4
    queries, the scores of Algorithm 1."""
    rng = np.random.default_rng(7)
    contexts = [
        rng.integers(10, 97, 63).astype(np.int32),
        rng.integers(10, 97, 30).astype(np.int32),
    ]
    full = prefill_full(model, contexts, room=1).cache.full
    assert full.capacity == 65
    with pass_traced_with(monkeypatch, QUERY_BLOCK=4):
        got = np.asarray(kvzip_scores(model, full, contexts, PROMPT, chunk=CHUNK))
    for row, context in enumerate(contexts):
        np.testing.assert_allclose(
            got[:, row, :, : len(context)], numpy_kvzip(model, context, CHUNK), rtol=1e-4, atol=1e-6
        )


def test_contexts_shorter_than_a_chunk_are_fed_at_their_length(model, monkeypatch):
    """Contexts of 300 and 40 tokens under the paper's 2K chunk: one repeat input of 512 slots (300
    rounded up to WIDTH_STEP), not 2,048, with Algorithm 1's scores; the same as when padded to the
    whole chunk."""
    import kvjax.runtime.kvzip_pass as kvzip

    rng = np.random.default_rng(1)
    contexts = [
        rng.integers(10, 97, 300).astype(np.int32),
        rng.integers(10, 97, 40).astype(np.int32),
    ]
    shared = prefill_full(model, contexts)
    widths, score_chunk = [], kvzip._score_chunk

    def spy(params, scoring, tokens, *rest):  # records the width of each repeat input fed
        widths.append(tokens.shape[1])
        return score_chunk(params, scoring, tokens, *rest)

    monkeypatch.setattr(kvzip, "_score_chunk", spy)
    got = np.asarray(kvzip_scores(model, shared.cache.full, contexts, PROMPT))
    assert widths == [512 + len(PROMPT.later) + 8 + len(PROMPT.colon)]
    for row, context in enumerate(contexts):
        np.testing.assert_allclose(
            got[:, row, :, : len(context)], numpy_kvzip(model, context, 2048), rtol=1e-4, atol=1e-6
        )
    monkeypatch.setattr(kvzip, "WIDTH_STEP", 2048)
    padded = np.asarray(kvzip_scores(model, shared.cache.full, contexts, PROMPT))
    assert widths[-1] == 2048 + len(PROMPT.later) + 8 + len(PROMPT.colon)
    np.testing.assert_allclose(got, padded, rtol=1e-4, atol=1e-6)  # float32 sums of other lengths


def test_compression_keeps_the_top_scores_over_each_layers_heads(model):
    """kvzip layer-wise (adakv+kvzip, kvpress's KVzipPress(layerwise=True)): each layer keeps
    n_kv_heads × budget tokens, the top scores over its heads (no floor), the first n_sink
    protected; then the question and the answer are appended, nothing evicted."""
    context = np.random.default_rng(3).integers(10, 97, 40).astype(np.int32)
    compressed = kvjax.prefill(
        model, context, budget=12, scorer="adakv+kvzip", repeat_prompt=PROMPT, n_sink=2
    )
    scores = numpy_kvzip(model, context, 2048)  # one chunk of the paper's size
    kept = np.asarray(compressed.cache.sorted_pos)[:, 0]  # [L, Hk, C]
    cfg, uneven = model.config, False
    for layer in range(cfg.n_layers):
        heads = [
            dict(positions=list(range(40)), protected=np.arange(40) < 2, prio=scores[layer, h, 2:])
            for h in range(cfg.n_kv_heads)
        ]
        counts, near, _ = shared_counts(heads, cfg.n_kv_heads * 12, 0, cfg.n_kv_heads * 12)
        assert not near and sum(counts) == cfg.n_kv_heads * 12
        uneven |= len(set(counts)) > 1
        for h in range(cfg.n_kv_heads):
            best = 2 + np.argsort(-scores[layer, h, 2:], kind="stable")[: counts[h] - 2]
            assert sorted(p for p in kept[layer, h] if p >= 0) == sorted([0, 1] + best.tolist())
    assert uneven
    question = np.arange(10, 16, dtype=np.int32)  # decode (evict=True) appends, as the reference
    ref = run_kvzip_reference(
        model,
        context,
        4,
        scorer="adakv+kvzip",
        budget=12,
        question=question,
        repeat_prompt=PROMPT,
        n_sink=2,
    )
    answer = kvjax.decode(model, compressed, question, 4, stop_ids=())
    np.testing.assert_array_equal(answer, ref["tokens"])


def test_the_default_is_one_threshold_over_every_layer_and_head(model):
    """kvzip's default allocation is global (kvpress's default KVzipPress(), chosen on
    docs/results.md's evaluation): the kept positions of global+kvzip, and a layer's heads keep
    other counts than under adakv+kvzip."""
    context = np.random.default_rng(3).integers(10, 97, 40).astype(np.int32)
    kept = {
        scorer: np.asarray(
            kvjax.prefill(
                model, context, budget=12, scorer=scorer, repeat_prompt=PROMPT, n_sink=2
            ).cache.sorted_pos
        )[:, 0]
        for scorer in ("kvzip", "global+kvzip", "adakv+kvzip")
    }
    counts = {s: (k >= 0).sum(-1) for s, k in kept.items()}  # [L, Hk]
    np.testing.assert_array_equal(kept["kvzip"], kept["global+kvzip"])
    assert counts["kvzip"].sum() == counts["adakv+kvzip"].sum() == 12 * counts["kvzip"].size
    assert not np.array_equal(
        counts["kvzip"].sum(-1), counts["adakv+kvzip"].sum(-1)
    )  # layers keep unevenly


def test_head_level_mode_keeps_whole_heads(model, tmp_path):
    cfg = model.config
    scores = np.array([[0.9, 0.1], [0.2, 0.8]])  # heads (0, 0) and (1, 1) are the best
    path = str(tmp_path / "heads.json")
    save_head_scores(path, scores, cfg)
    np.testing.assert_array_equal(load_head_scores(path, cfg), scores)
    context = np.random.default_rng(2).integers(10, 97, 40).astype(np.int32)
    # two of the four heads full: budget = (2 · 40 + 2 · 6) / 4 = 23 tokens per head on average
    compressed = kvjax.prefill(
        model, context, budget=23, scorer="kvzip-head", head_scores=path, n_sink=2, window=4
    )
    kept = [
        [sorted(p for p in head if p >= 0) for head in layer]
        for layer in np.asarray(compressed.cache.pos)[:, 0]
    ]
    reduced = [0, 1] + list(range(36, 40))
    assert kept == [[list(range(40)), reduced], [reduced, list(range(40))]]
    other = kvjax.ModelConfig(**{**cfg.__dict__, "n_layers": 3})
    with pytest.raises(ValueError, match="was made for another model"):
        load_head_scores(path, other)


@pytest.mark.parametrize("scorer", ["kvzip", "kvzip-head"])
def test_budget_covering_the_prompt_equals_the_full_cache(model, scorer, tmp_path):
    path = str(tmp_path / "heads.json")
    save_head_scores(path, np.ones((2, 2)), model.config)
    needs = dict(repeat_prompt=PROMPT) if scorer == "kvzip" else dict(head_scores=path)
    prompts = [np.random.default_rng(5).integers(10, 97, n).astype(np.int32) for n in (30, 17)]
    full = kvjax.generate(model, prompts, 8, stop_ids=())
    kept = kvjax.generate(model, prompts, 8, budget=40, scorer=scorer, stop_ids=(), **needs)
    for a, b in zip(full, kept, strict=True):
        np.testing.assert_array_equal(a, b)


def test_kvzip_needs_its_inputs_and_the_prefill_protocol(model):
    ids = np.arange(10, 50, dtype=np.int32)
    with pytest.raises(ValueError, match="needs repeat_prompt=kvjax.kvzip_prompt"):
        kvjax.generate(model, ids, 4, budget=12, scorer="kvzip")
    with pytest.raises(ValueError, match="needs head_scores="):
        kvjax.generate(model, ids, 4, budget=12, scorer="kvzip-head")
    with pytest.raises(ValueError, match="needs protocol='prefill'"):
        kvjax.generate(
            model, ids, 4, budget=12, scorer="kvzip", repeat_prompt=PROMPT, protocol="blockwise"
        )
    with pytest.raises(ValueError, match="a fractional budget must lie in"):
        kvjax.generate(model, ids, 4, budget=1.5)


def test_repeat_option_errors():
    """An unknown form, or a repeat prompt made in another form than ``repeat`` asks, is an error
    naming both."""
    from kvjax.runtime.options import eviction_from

    with pytest.raises(
        ValueError, match=r"repeat='verbatim' must be one of \('paper', 'kvpress'\)"
    ):
        eviction_from(scorer="kvzip", budget=8, repeat="verbatim", repeat_prompt=PROMPT)
    made = RepeatPrompt(first=(5,), later=(6,), colon=(7,), form="kvpress")
    with pytest.raises(
        ValueError, match="repeat='paper', but repeat_prompt was made in the 'kvpress' form"
    ):
        eviction_from(scorer="kvzip", budget=8, repeat="paper", repeat_prompt=made)
    options = EvictionOptions.of(scorer="kvzip", budget=8, repeat_prompt=made)
    assert options.resolve() is not None and options.scoring_data(None).repeat_prompt == made


def test_repeat_prompt_is_data_beside_the_static_settings():
    """The repeat prompt travels as data (a pytree whose leaves are its ids), not in the static
    ``Policy``: two prompts resolve to the same settings, so jitted functions compile once for both.
    """
    from kvjax.runtime.options import eviction_from

    a = RepeatPrompt(first=(5, 6), later=(7,), colon=(8, 9), skip=3, sinks=4, form="kvpress")
    b = RepeatPrompt(first=(1, 2, 3), later=(4,), colon=(8,), skip=3, sinks=4, form="kvpress")
    assert eviction_from(scorer="kvzip", budget=8, repeat_prompt=a) == eviction_from(
        scorer="kvzip", budget=8, repeat_prompt=b
    )
    assert jax.tree.leaves(a) == [5, 6, 7, 8, 9]


def test_a_saved_contexts_settings_come_back_whole():
    """A saved context's eviction settings (JSON) come back equal, and those saved while the policy
    still held the scoring data (repeat prompt, head budgets) load without it."""
    from kvjax.runtime.options import eviction_from
    from kvjax.runtime.saved_context import _eviction_from_json, _eviction_to_json

    ev = eviction_from(scorer="kvzip", budget=8, repeat_prompt=PROMPT)
    raw = json.loads(json.dumps(_eviction_to_json(ev)))
    assert _eviction_from_json(raw) == ev
    raw["policy"] |= {
        "repeat_prompt": {"first": [5], "later": [6], "colon": [7]},
        "head_budgets": [8, 9],
    }
    assert _eviction_from_json(raw) == ev
