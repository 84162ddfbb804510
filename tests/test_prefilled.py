"""One full prefill, many compressions: ``kvjax.prefill_full(...).compress(...)`` equals
``kvjax.prefill(..., protocol="prefill")`` for every base, modifier and alias by default and every
scorer name with --runslow (KVzip's names, which ``kvjax.prefill`` compresses with ``compress``
itself: the NumPy reference's ``run_kvzip_reference``); appending without eviction
(``kvjax.decode(..., evict=False)``) keeps the whole question and answer."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    covering,
    distinct_prompts,
    kept_positions,
    own_pass,
    scorer_requirements,
)
from reference_eviction import assert_kept_sums, run_kvzip_reference

import kvjax
from kvjax.eviction import SCORERS
from kvjax.runtime.options import eviction_from

BUDGET = 14


def kept(context):
    return np.sort(np.asarray(context.cache.sorted_pos), axis=-1)


@pytest.fixture(scope="module")
def prefilled(tiny_llama):
    return kvjax.prefill_full(tiny_llama, distinct_prompts())


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_compress_equals_the_prefill_protocol":
        metafunc.parametrize(
            "name", list(SCORERS) if metafunc.config.getoption("--runslow") else covering(SCORERS)
        )


def kvzip_reference(model, prompts, settings: dict, new: int) -> list[dict]:
    """The NumPy reference of a KVzip name (``settings``: the compression's keywords) for each
    prompt, without near ties; kvzip-head's file of head scores read as plain JSON."""
    import json

    options = {k: v for k, v in settings.items() if k != "obs_window"}
    if "head_scores" in options:
        with open(options["head_scores"]) as f:
            options |= dict(
                head_scores=np.asarray(json.load(f)["scores"]), context=max(len(p) for p in prompts)
            )
    refs = [run_kvzip_reference(model, p, new, **options) for p in prompts]
    assert all(r["near_ties"] == r["exact_ties"] for r in refs)
    return refs


def test_compress_equals_the_prefill_protocol(tiny_llama, prefilled, name, tiny_head_scores):
    settings = dict(budget=BUDGET, scorer=name, obs_window=4, n_sink=1)
    if not name.startswith(("streamingllm", "tova")):
        settings["window"] = 3
    settings |= scorer_requirements(name, tiny_head_scores)
    shared = prefilled.compress(**settings)
    if own_pass(name):  # kvjax.prefill runs this very compress: the reference instead
        check_kvzip_compress(tiny_llama, shared, name, settings)
        return
    direct = kvjax.prefill(
        tiny_llama, distinct_prompts(), protocol="prefill", block_size=8, **settings
    )
    np.testing.assert_array_equal(kept(shared), kept(direct))
    np.testing.assert_allclose(np.asarray(shared.logits), np.asarray(direct.logits), atol=1e-4)
    for field in ("count", "k_sum", "v_sum", "vk_sum"):
        np.testing.assert_allclose(
            np.asarray(getattr(shared.cache.moments, field)),
            np.asarray(getattr(direct.cache.moments, field)),
            atol=1e-3,
        )
    evicted = np.asarray(direct.cache.moments.count)
    # something was evicted in every row and head (kvzip-head keeps some heads whole; pyramidkv's
    # first layer holds a short row whole on this two-layer model)
    assert (evicted.max() if name in ("kvzip-head", "pyramidkv") else evicted.min()) > 0
    for a, b in zip(
        kvjax.decode(tiny_llama, shared, max_new_tokens=5, stop_ids=()),
        kvjax.decode(tiny_llama, direct, max_new_tokens=5, stop_ids=()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def check_kvzip_compress(model, shared, name, settings):
    """``test_compress_equals_the_prefill_protocol``'s checks, for a KVzip name: the reference."""
    refs = kvzip_reference(model, distinct_prompts(), settings, 5)
    pos, moments = np.asarray(shared.cache.sorted_pos), shared.cache.moments
    sums = assert_kept_sums(moments, name)  # only what MomentKV reads
    for row, ref in enumerate(refs):
        assert kept_positions(pos, row) == ref["kept_after_prefill"]
        np.testing.assert_allclose(np.asarray(shared.logits[row]), ref["prefill_logits"], atol=1e-4)
        for field in ("count", *sums):
            got = np.asarray(getattr(moments, field)[:, row])
            np.testing.assert_allclose(got, ref["moments"][field], atol=1e-3)
    evicted = np.stack([r["moments"]["count"] for r in refs])
    assert (evicted.max() if name == "kvzip-head" else evicted.min()) > 0  # as the test above
    answers = kvjax.decode(model, shared, max_new_tokens=5, stop_ids=())
    assert [a.tolist() for a in answers] == [r["tokens"] for r in refs]


def test_compressing_a_prefix_equals_prefilling_the_prefix(tiny_llama, prefilled):
    shared = prefilled.compress(budget=BUDGET, scorer="snapkv", obs_window=4, upto=25)
    prefixes = [p[:25] for p in distinct_prompts()]
    direct = kvjax.prefill(
        tiny_llama, prefixes, protocol="prefill", budget=BUDGET, scorer="snapkv", obs_window=4
    )
    np.testing.assert_array_equal(kept(shared), kept(direct))
    np.testing.assert_allclose(np.asarray(shared.logits), np.asarray(direct.logits), atol=1e-4)


def test_full_cache_generation_equals_generate(tiny_llama, prefilled):
    for a, b in zip(
        prefilled.generate(8, stop_ids=()),
        kvjax.generate(tiny_llama, distinct_prompts(), 8, stop_ids=()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="max_new_tokens=300 exceeds the room=256"):
        prefilled.generate(300)


def test_appending_without_eviction_keeps_the_question_and_the_answer(tiny_llama, prefilled):
    """What ``kvjax.decode(..., evict=False)`` runs: the question and then the answer join the
    compressed context and nothing leaves it."""
    import jax

    from kvjax.runtime.decoding import Generation, feed_budget
    from kvjax.runtime.inputs import pad_rows, prompt_bucket
    from kvjax.runtime.sampling import Sampling

    context = prefilled.compress(budget=BUDGET, scorer="snapkv", obs_window=4, upto=[30, 15])
    questions = [np.arange(60, 66, dtype=np.int32), np.arange(70, 73, dtype=np.int32)]
    ev = context.ev.without_eviction()
    padded, lengths = pad_rows(questions, prompt_bucket(6, ev.block_size), 0)
    state = feed_budget(
        tiny_llama,
        context.cache,
        padded,
        context.lengths,
        lengths,
        jax.random.key(0),
        ev=ev,
        out_width=4,
        decode_spare=ev.extend_spare(padded.shape[1]) + 4,
    )
    gen = Generation(tiny_llama, state, 4, Sampling(), (), ev)
    gen.run(4)
    before, after = kept(context), np.asarray(gen.state.cache.sorted_pos)
    for row, (n_ctx, question) in enumerate(zip((30, 15), questions, strict=True)):
        for layer in range(tiny_llama.config.n_layers):
            for head in range(tiny_llama.config.n_kv_heads):
                old = {int(p) for p in before[layer, row, head] if p >= 0}
                new = {int(p) for p in after[layer, row, head] if p >= 0}
                # the question, then the four answer tokens (each is fed as it is generated)
                assert new == old | set(range(n_ctx, n_ctx + len(question) + 4))


def test_appending_without_eviction_with_room_for_everything_equals_the_full_cache(tiny_llama):
    prompt, question = distinct_prompts((30, 6), seed=1)
    context = kvjax.prefill(tiny_llama, prompt, budget=64, scorer="h2o")
    got = kvjax.decode(tiny_llama, context, question, max_new_tokens=8, evict=False, stop_ids=())
    np.testing.assert_array_equal(
        got, kvjax.generate(tiny_llama, np.concatenate([prompt, question]), 8, stop_ids=())
    )


def test_momentkv_still_corrects_attention_without_eviction(tiny_llama, prefilled):
    plain = prefilled.compress(budget=BUDGET, scorer="snapkv", obs_window=4)
    corrected = prefilled.compress(budget=BUDGET, scorer="snapkv+momentkv-nc", obs_window=4)
    np.testing.assert_array_equal(
        kept(plain), kept(corrected)
    )  # same tokens kept: NC does not choose
    question = [np.arange(60, 66, dtype=np.int32)] * 2
    a = kvjax.decode(tiny_llama, plain, question, max_new_tokens=12, evict=False, stop_ids=())
    b = kvjax.decode(tiny_llama, corrected, question, max_new_tokens=12, evict=False, stop_ids=())
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_compress_on_pages_writes_the_per_slot_state(tiny_llama, prefilled, tiny_head_scores):
    """The paged cache's compression (AdaKV's allocation) gives Expected Attention's slots their
    state (log ‖v‖) as the prefill protocol's blocks do."""
    name = "adakv+expected-attention"
    assert eviction_from(budget=BUDGET, scorer=name).page_size is not None
    test_compress_equals_the_prefill_protocol(tiny_llama, prefilled, name, tiny_head_scores)


@pytest.mark.parametrize("name", ["adakv", "global+snapkv", "adakv+snapkv+momentkv", "kvzip"])
def test_compress_when_one_head_may_keep_more_than_the_prompt(tiny_llama, name, tiny_head_scores):
    """A shared allocation whose one-head cap (here 2 × 40 under adakv) exceeds the prefilled cache
    (a 50-token prompt in 64 slots): a head may lose every slot, which the compression must allow.
    """
    prompt = [int(t) for t in np.random.default_rng(3).integers(4, 97, 50)]
    settings = dict(budget=40, scorer=name, obs_window=4, n_sink=1, window=3)
    settings |= scorer_requirements(name, tiny_head_scores)
    shared = kvjax.prefill_full(tiny_llama, prompt, room=0).compress(**settings)
    if own_pass(name):  # kvjax.prefill runs this very compress: the reference instead
        ref = kvzip_reference(tiny_llama, [prompt], settings, 0)[0]
        assert kept_positions(np.asarray(shared.cache.sorted_pos), 0) == ref["kept_after_prefill"]
        assert ref["moments"]["count"].sum() > 0  # something was evicted
        return
    direct = kvjax.prefill(tiny_llama, prompt, protocol="prefill", block_size=8, **settings)
    np.testing.assert_array_equal(kept(shared), kept(direct))
    assert int(np.asarray(direct.cache.moments.count).sum()) > 0  # something was evicted


@pytest.mark.parametrize(
    "scorer", ["snapkv", "momentkv", "snapkv+momentkv-zeroth", "adakv", "expected-attention"]
)
def test_a_saved_context_loads_as_it_was(tiny_llama, prefilled, scorer, tmp_path):
    """``save_context`` then ``load_context``: every leaf of the cache as it was, MomentKV's moments
    with their sums (its zeroth order without Σ v kᵀ) and the others' with none (zero-size arrays,
    which orbax cannot write: left out, then put back), Expected Attention's statistics settled
    (without a decoding's buffer of queries) and its state (log ‖v‖ per slot), and the same
    answers."""
    from kvjax.runtime.saved_context import load_context, save_context

    context = prefilled.compress(budget=BUDGET, scorer=scorer, obs_window=4, n_sink=1, window=3)
    save_context(str(tmp_path / "c"), context, tiny_llama)
    loaded = load_context(str(tmp_path / "c"), tiny_llama)
    assert_kept_sums(loaded.cache.moments, scorer)
    settled = context.cache.replace(
        stats=context.ev.policy.scorer.fit_stats(context.cache.stats, False)
    )
    assert jax.tree.structure(loaded.cache) == jax.tree.structure(settled)
    jax.tree.map(np.testing.assert_array_equal, loaded.cache, settled)
    if scorer == "expected-attention":
        assert context.cache.stats.pending is not None
        assert np.asarray(loaded.cache.state).any()
    for a, b in zip(
        kvjax.decode(tiny_llama, loaded, max_new_tokens=4, stop_ids=()),
        kvjax.decode(tiny_llama, context, max_new_tokens=4, stop_ids=()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scorer", ["snapkv", "expected-attention"])
def test_a_context_saved_in_format_1(tiny_llama, prefilled, scorer, tmp_path):
    """Contexts saved in format 1 still load, except Expected Attention's, whose state then held
    no value norms: a clear error asks for a new compression."""
    from kvjax.checkpoint.errors import CheckpointError
    from kvjax.runtime.saved_context import META_FILE, load_context, save_context

    context = prefilled.compress(budget=BUDGET, scorer=scorer, obs_window=4, n_sink=1, window=3)
    path = tmp_path / "c"
    save_context(str(path), context, tiny_llama)
    meta = json.loads((path / META_FILE).read_text())
    (path / META_FILE).write_text(json.dumps(meta | {"format": 1}))
    if scorer == "snapkv":
        load_context(str(path), tiny_llama)
        return
    with pytest.raises(CheckpointError, match="format 1.*compress the context again"):
        load_context(str(path), tiny_llama)


def test_a_context_saved_in_format_2_loads_its_state_folded(tiny_llama, prefilled, tmp_path):
    """Format 2 kept a state per query head for every policy; a policy that keeps their aggregate
    (``Policy.state_groups``) loads it folded (H2O's sums: mean over the query heads)."""
    from kvjax.runtime.saved_context import META_FILE, load_context, save_context

    context = prefilled.compress(budget=BUDGET, scorer="h2o", n_sink=1, window=3)
    G = tiny_llama.config.group_size
    assert context.cache.state.shape[3] == 1 < G
    rng = np.random.default_rng(0)
    shape = context.cache.state.shape
    per_head = rng.random(shape[:3] + (G,) + shape[4:]).astype(np.float32)
    old = dataclasses.replace(context, cache=context.cache.replace(state=jnp.asarray(per_head)))
    path = tmp_path / "c"
    save_context(str(path), old, tiny_llama)
    meta = json.loads((path / META_FILE).read_text())
    (path / META_FILE).write_text(json.dumps(meta | {"format": 2}))
    loaded = load_context(str(path), tiny_llama)
    np.testing.assert_allclose(loaded.cache.state, per_head.mean(3, keepdims=True), rtol=1e-6)


def test_fit_folds_a_state_per_query_head_and_refuses_the_converse(tiny_llama, prefilled):
    """A context whose state is per query head (CAOTE's) continues under the settings without
    eviction (one value per KV head): ``Eviction.fit`` folds it. The converse has no per-head
    values to give: a ValueError."""
    per_head = prefilled.compress(budget=BUDGET, scorer="h2o+caote", n_sink=1, window=3)
    cfg, state = tiny_llama.config, per_head.cache.state
    assert state.shape[3] == cfg.group_size > 1
    without = per_head.ev.without_eviction()
    fitted = without.fit(per_head.cache, cfg, 0)
    mean = without.fit(per_head.cache.replace(state=jnp.mean(state, 3, keepdims=True)), cfg, 0)
    assert fitted.state.shape[3] == 1
    np.testing.assert_allclose(fitted.state, mean.state, rtol=1e-6)
    folded = prefilled.compress(budget=BUDGET, scorer="h2o", n_sink=1, window=3)
    with pytest.raises(ValueError, match="reads the state of each query head"):
        per_head.ev.fit(folded.cache, cfg, 0)
