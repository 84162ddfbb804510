"""The eviction engine end to end: full-cache equivalence, cache invariants (property tests),
compressed contexts, memory, compilation, and proof on SmolLM2 that eviction really happens."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FILLER, NEEDLE, QUESTION, gpu_script
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax.model.layer_fields import split_layers
from kvjax.runtime.decoding import Generation, decode_steps
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling

BASES = sorted(
    name for name, spec in kvjax.eviction.BASES.items() if spec.scoring_pass is None
)  # kvzip: test_kvzip


def prompts_of(lengths, seed=0, vocab=97):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, n).astype(np.int32) for n in lengths]


@pytest.mark.parametrize("protocol", ["blockwise", "prefill"])
@pytest.mark.parametrize("scorer", BASES)
def test_budget_covering_everything_equals_full_cache(tiny_llama, scorer, protocol):
    prompts = prompts_of([45, 12])
    full = Generation.from_prompts(tiny_llama, prompts, 10, Sampling(), 0, (), None)
    ev = eviction_from(
        budget=64, scorer=scorer, protocol=protocol, block_size=16, window=8, obs_window=8
    )
    budgeted = Generation.from_prompts(tiny_llama, prompts, 10, Sampling(), 0, (), ev)
    # float32 sums over another number of slots, so in another order: within 1e-5 of the largest
    # logit (7.0 here; measured up to 1.4e-5 apart)
    scale = np.abs(np.asarray(full.state.logits)).max()
    np.testing.assert_allclose(
        np.asarray(budgeted.state.logits), np.asarray(full.state.logits), atol=1e-5 * scale
    )
    for a, b in zip(full.run(10), budgeted.run(10)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(
        np.asarray(budgeted.state.logits), np.asarray(full.state.logits), atol=1e-5 * scale
    )
    assert np.asarray(budgeted.state.cache.moments.count).sum() == 0


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_cache_invariants(tiny_llama, data):
    scorer = data.draw(st.sampled_from(BASES))
    protocol = data.draw(st.sampled_from(["blockwise", "prefill"]))
    lengths = data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=3))
    n_sink = data.draw(st.integers(0, 4))
    window = data.draw(st.integers(0, 6))
    budget = data.draw(st.integers(n_sink + window + 1, 40))
    block = data.draw(st.sampled_from([1, 5, 8, 16]))
    evict_every = data.draw(st.sampled_from([1, 2, 4]))
    ev = eviction_from(
        budget=budget,
        scorer=scorer,
        protocol=protocol,
        block_size=block,
        n_sink=n_sink,
        window=window,
        obs_window=4,
        evict_every=evict_every,
    )
    window = ev.policy.window
    gen = Generation.from_prompts(
        tiny_llama, prompts_of(lengths, seed=len(lengths)), 6, Sampling(), 0, (), ev
    )

    def check(seen, limit):
        cache = gen.state.cache
        order = np.asarray(cache.order)
        assert np.all(np.sort(order, -1) == np.arange(cache.slots)), (
            "order is a permutation of the slots"
        )
        pos = np.asarray(cache.sorted_pos)  # [L, B, Hk, S]
        for row, n_seen in enumerate(seen):
            for heads in pos[:, row]:
                for slots in heads:
                    valid = slots[slots >= 0]
                    assert np.all(slots[: len(valid)] == valid), (
                        "valid slots come first in the order"
                    )
                    assert np.all(np.diff(valid) > 0), "sorted by position, no duplicates"
                    assert len(valid) <= limit
                    assert valid.size == 0 or valid.max() < n_seen, "no padded or future token"
                    must_keep = set(range(min(n_sink, n_seen))) | set(
                        range(max(0, n_seen - window), n_seen)
                    )
                    assert must_keep <= set(valid.tolist()), "sinks and the recent window are kept"
                    assert len(valid) == min(n_seen, limit) or len(valid) == min(n_seen, budget)

    check(lengths, budget)
    for step in range(1, 7):
        gen.run(1)
        at_point = step % evict_every == 0
        check([n + step for n in lengths], budget if at_point else budget + step % evict_every)


def test_streamingllm_keeps_sinks_and_the_most_recent(tiny_llama):
    ev = eviction_from(budget=20, scorer="streamingllm", block_size=8, n_sink=4)
    gen = Generation.from_prompts(tiny_llama, prompts_of([50]), 1, Sampling(), 0, (), ev)
    pos = np.asarray(gen.state.cache.sorted_pos)
    expected = list(range(4)) + list(range(34, 50))
    for heads in pos[:, 0]:
        for slots in heads:
            assert slots[slots >= 0].tolist() == expected


def test_compressed_context_answers_several_questions(tiny_llama):
    context = kvjax.prefill(
        tiny_llama, prompts_of([60])[0], budget=24, scorer="snapkv", block_size=16, obs_window=8
    )
    q1, q2 = prompts_of([5, 9], seed=1)
    a1 = kvjax.decode(tiny_llama, context, q1, max_new_tokens=6, stop_ids=())
    a2 = kvjax.decode(tiny_llama, context, q2, max_new_tokens=6, stop_ids=())
    np.testing.assert_array_equal(
        kvjax.decode(tiny_llama, context, q1, max_new_tokens=6, stop_ids=()), a1
    )
    assert not np.array_equal(a1, a2)
    plain = kvjax.decode(
        tiny_llama, context, max_new_tokens=6, stop_ids=()
    )  # no question: continue
    np.testing.assert_array_equal(
        kvjax.decode(tiny_llama, context, max_new_tokens=6, stop_ids=()), plain
    )
    assert len(plain) == 6


def test_context_with_room_for_everything_equals_full_cache(tiny_llama):
    ctx_tokens, question = prompts_of([40, 7], seed=2)
    context = kvjax.prefill(tiny_llama, ctx_tokens, budget=80, scorer="h2o", block_size=16)
    got = kvjax.decode(tiny_llama, context, question, max_new_tokens=8, stop_ids=())
    full = kvjax.generate(
        tiny_llama, np.concatenate([ctx_tokens, question]), max_new_tokens=8, stop_ids=()
    )
    np.testing.assert_array_equal(got, full)


def test_blockwise_cache_size_does_not_depend_on_the_prompt(tiny_llama):
    sizes = {
        n: kvjax.cache_bytes(
            kvjax.prefill(
                tiny_llama, prompts_of([n])[0], budget=32, scorer="h2o", block_size=16
            ).cache
        )
        for n in (20, 100, 400)
    }
    assert len(set(sizes.values())) == 1
    cfg = tiny_llama.config
    slots = 32 + 1  # budget + one decode spare
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * slots * cfg.head_dim * 4
    assert sizes[20] > kv  # positions, scores and moments come on top of keys and values


def _float32_kv_of_every_layer(params, scorer: str, **options) -> list:
    """The float32 arrays shaped like every layer's keys [L, B, Hk, S, K] that one decode step's
    program computes (bfloat16 weights, so the cache itself is bfloat16)."""
    ev = eviction_from(budget=16, scorer=scorer, n_sink=1, window=2, block_size=8, **options)
    gen = Generation.from_prompts(params, prompts_of([40, 23]), 4, Sampling(), 0, (), ev)
    n = jnp.int32(4)
    program = jax.make_jaxpr(decode_steps, static_argnums=(4, 5, 6))(
        params, gen.state, n, n, Sampling(), (), gen.ev
    )
    cfg, slots = params.config, gen.state.cache.pos.shape[-1]

    def avals(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (v.aval for v in eqn.outvars)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from avals(inner)

    every_layer = (cfg.n_layers, 2, cfg.n_kv_heads, slots, cfg.head_dim)
    return [a for a in avals(program.jaxpr) if a.dtype == jnp.float32 and a.shape == every_layer]


@pytest.mark.parametrize("scorer", ["snapkv+momentkv", "h2o+momentkv-zeroth"])
def test_moment_informed_decoding_evicts_layer_by_layer(tiny_llama, scorer):
    """A decoding step under MomentKV's moment-informed eviction, which reads every slot's keys and
    values in float32, evicts in each layer's step of the layer scan on the dense cache (its output
    unchanged: the reference tests compare the tokens), so its program never holds those of every
    layer at once (as it did when every layer evicted together after the step: 132 MiB per row at
    Llama-3.1-8B's shapes on an H200). On pages the eviction stays after the step, and the same
    search finds those arrays."""
    cfg = dataclasses.replace(tiny_llama.config, n_layers=3)
    params = kvjax.init_params(cfg, jax.random.key(0), jnp.bfloat16, scale=0.3)
    assert _float32_kv_of_every_layer(params, scorer) == []
    assert _float32_kv_of_every_layer(params, "adakv+" + scorer, page_size=4)


def _compiled_decode_loop(params, scorer: str, order: str, page_size: int | None = None):
    """(the decoding state, the text of its decode loop compiled for this CPU), budget 128 over two
    prompts."""
    ev = eviction_from(
        budget=128,
        scorer=scorer,
        n_sink=1,
        window=2,
        block_size=8,  # 16: no copy either way
        decode_order=order,
        page_size=page_size,
    )
    gen = Generation.from_prompts(params, prompts_of([200, 150]), 4, Sampling(), 0, (), ev)
    n = jnp.int32(4)
    return gen.state, decode_steps.lower(
        params, gen.state, n, n, Sampling(), (), gen.ev
    ).compile().as_text()


@pytest.mark.parametrize(
    "scorer, order",
    [
        ("snapkv", "attend-first"),
        ("momentkv", "attend-first"),
        ("snapkv+fastcaote", "evict-first"),
        ("momentkv", "evict-first"),
    ],
)
def test_the_compiled_decode_loop_copies_no_stacked_keys_or_values(tiny_llama, scorer, order):
    """XLA writes the new token into the stacked keys and values in place, and no layer of the scan
    copies the whole stack: an eviction in the layer that read its layer from the stacked result
    made XLA copy every layer's keys and values in every layer (FastCAOTE under evict-first: 4.5x
    slower at batch 8 on SmolLM2)."""
    state, text = _compiled_decode_loop(tiny_llama, scorer, order)
    stacked = ",".join(map(str, state.cache.k.shape))
    assert re.search(rf"= f32\[{stacked}\]", text)  # the loop carries them
    assert not re.findall(rf"= f32\[{stacked}\]\S* copy\(", text)


@pytest.mark.parametrize(
    "scorer, order, page_size",
    [
        ("snapkv", "attend-first", None),
        ("momentkv", "attend-first", None),
        ("momentkv", "evict-first", None),
        ("adakv+snapkv", "attend-first", 4),
        ("adakv+momentkv", "evict-first", 4),
        ("pyramidkv", "attend-first", 4),
    ],
)
def test_the_layer_scan_copies_no_stacked_positions_order_state_or_moments(
    tiny_llama, scorer, order, page_size
):
    """The layer scan hands each layer its slice of the cache's ``LAYER_FIELDS`` (positions, state,
    order, moments; the page tables) and stacks what the layers return: updated in place, XLA copied
    the stacked positions or order in every layer under every scorer, and MomentKV's sums (64 and
    1,040 MiB per row and step on Llama-3.1-8B's shapes; AdaKV on pages 513), because a layer read
    them without its write-back depending on the read."""
    state, text = _compiled_decode_loop(tiny_llama, scorer, order, page_size)
    loop_copies = gpu_script(
        "common"
    ).loop_copies  # (dtype, shape, trips) of the copies in loops nested so deep
    _, fields = split_layers(state.cache)
    stacked = {x.shape for x in jax.tree.leaves(fields) if x.size}
    assert stacked >= {state.cache.pos.shape, state.cache.state.shape}
    assert loop_copies(text, depth=1)  # the parser finds copies: the decode loop's own
    assert not [shape for _, shape, _ in loop_copies(text) if shape in stacked]


@pytest.mark.parametrize("scorer", ["adakv+snapkv", "pyramidkv"])
def test_the_paged_eviction_writes_no_gather_index_of_every_coordinate(tiny_llama, scorer):
    """The keys listed by position gather the state's aggregate and the positions by ``order`` in
    one gather, whose index of every coordinate ([L, B, Hk, C, 4]) XLA computes where it reads: as
    two gathers they shared one index, which XLA wrote out (AdaKV 1024 at the 8B's batch 64 on an
    H200: 2.15 GB a step, and 1.8 GB of temporaries)."""
    state, text = _compiled_decode_loop(tiny_llama, scorer, "attend-first", page_size=4)
    index = r"= s32\[{},{},{},{},4\]\S* ".format(*state.cache.pos.shape)
    assert re.search(index + r"concatenate\(", text)  # the index, inside a fused computation
    assert not re.findall(index + r"fusion\(", text)


def test_same_request_shape_does_not_recompile(tiny_llama, count_compiles):
    settings = dict(budget=24, scorer="h2o", protocol="blockwise", block_size=16, max_new_tokens=5)
    kvjax.generate(tiny_llama, prompts_of([30])[0], **settings)
    with count_compiles() as compiles:
        kvjax.generate(tiny_llama, prompts_of([25], seed=3)[0], **settings)  # same bucket (32)
        kvjax.generate(tiny_llama, prompts_of([19], seed=4)[0], **{**settings, "max_new_tokens": 9})
    assert compiles["n"] == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(budget=8, scorer="snapkv", obs_window=4, n_sink=4),
            r"budget=8 must be larger than n_sink \+ window = 4 \+ 4",
        ),
        (dict(budget=0), "budget=0 must be an integer >= 1"),
        (
            dict(budget=0.5, n_sink=4, window=4),
            r"budget=0.5 of a 10-token prompt is 5 slots: budget=5 must be larger than n_sink "
            r"\+ window = 4 \+ 4",
        ),
        (dict(budget=True), "budget=True must be a number, not a bool"),
        (dict(budget=64, window=np.False_), "window=np.False_ must be a number, not a bool"),
        (dict(budget=64, block_size=0), "block_size=0 must be an integer >= 1"),
        (dict(budget=64, evict_every=0), "evict_every=0 must be an integer >= 1"),
        (
            dict(budget=64, scorer="magic"),
            r"scorer=.magic. is unknown; valid scorers: expected-attention, h2o, h2o\+caote, .*, "
            r"tova",
        ),
        (dict(budget=64, protocol="lazy"), "protocol='lazy' must be one of"),
        (dict(budget=64, pool="median"), "pool='median' must be one of"),
        (dict(budget=64, pool="max", kernel=4), "kernel=4 must be odd"),
        (dict(budget=64, aggregate="median"), "aggregate='median' must be one of"),
        (dict(budget=64, scorer="momentkv", mi_batch=0), "mi_batch=0 must be an integer >= 1"),
        (dict(budget=64, scorer="snapkv", mi_batch=4), "mi_batch=4 only applies to MomentKV"),
        (
            dict(budget=64, scorer="momentkv", aggregate="layer"),
            "aggregate='layer' cannot be combined with 'momentkv'",
        ),
    ],
)
def test_bad_eviction_arguments(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvjax.generate(tiny_llama, prompts_of([10])[0], max_new_tokens=2, **kwargs)


def test_numpy_scalars_are_the_python_numbers(tiny_llama):
    """Keywords from NumPy (a sweep over ``np.arange`` budgets) run as the same Python numbers."""
    prompt = prompts_of([40], seed=5)[0]
    plain = dict(budget=20, window=4, floor=0.5, scorer="adakv", block_size=16)
    numpy = dict(
        budget=np.int64(20), window=np.int32(4), floor=np.float32(0.5), block_size=np.int16(16)
    )
    assert eviction_from(**plain) == eviction_from(**numpy | {"scorer": "adakv"})
    sampled = dict(max_new_tokens=6, seed=1)
    np.testing.assert_array_equal(
        kvjax.generate(tiny_llama, prompt, **sampled, temperature=0.7, top_k=5, **plain),
        kvjax.generate(
            tiny_llama,
            prompt,
            **sampled,
            temperature=np.float64(0.7),
            top_k=np.int64(5),
            **plain | numpy,
        ),
    )


def test_batched_moment_eviction_runs_and_keeps_the_budget(tiny_llama):
    ev = eviction_from(
        budget=20, scorer="momentkv", protocol="prefill", block_size=16, obs_window=4, mi_batch=8
    )
    gen = Generation.from_prompts(tiny_llama, prompts_of([70]), 3, Sampling(), 0, (), ev)
    gen.run(3)
    pos = np.asarray(gen.state.cache.pos)
    assert ((pos >= 0).sum(-1) == 20).all() and np.asarray(
        gen.state.cache.moments.count
    ).min() == 70 + 3 - 20


def test_prompt_beyond_context_with_budget(tiny_llama):
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        kvjax.generate(tiny_llama, np.ones(510, np.int32), max_new_tokens=8, budget=64)


def test_prompt_shorter_than_the_observation_window(tiny_llama):
    # Documented: every prompt token is then a scoring query; nothing is evicted below the budget
    # anyway.
    out = kvjax.generate(
        tiny_llama,
        prompts_of([5])[0],
        max_new_tokens=40,
        budget=20,
        scorer="snapkv",
        obs_window=8,
        protocol="prefill",
        stop_ids=(),
    )
    assert len(out) == 40


@pytest.mark.smollm2
def test_eviction_is_real_on_a_needle(smollm2, smollm2_tokenizer):
    ids = kvjax.chat_tokens(smollm2_tokenizer, NEEDLE + FILLER + "\n\n" + QUESTION)
    assert len(ids) > 700
    full = smollm2_tokenizer.decode(kvjax.generate(smollm2, ids, max_new_tokens=20))
    assert "7341295" in full
    # 4 sinks + 124 recent tokens cannot hold the needle near the start of the context.
    evicted = smollm2_tokenizer.decode(
        kvjax.generate(smollm2, ids, max_new_tokens=20, budget=128, scorer="streamingllm")
    )
    assert "7341295" not in evicted
