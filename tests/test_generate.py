"""Full-cache generation: decode equals a full forward, batching/padding, stopping, sampling, no
recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache.full import FullCache
from kvjax.model.params import fuse_qkv, split_qkv
from kvjax.model.segment import Segment
from kvjax.runtime.decoding import Generation
from kvjax.runtime.generate import _forward, _generation
from kvjax.runtime.sampling import Sampling, sample
from kvjax.serving import Engine


def random_prompt(n, seed, vocab=97):
    return np.random.default_rng(seed).integers(4, vocab, n).astype(np.int32)


def test_prefill_then_decode_equals_full_forward(tiny_llama):
    prompt = random_prompt(11, 0)
    gen = Generation.from_prompts(tiny_llama, [prompt], 9, Sampling(), 0, (), None)
    step_logits = [np.asarray(gen.state.logits[0])]
    new = []
    for _ in range(9):
        new.append(int(gen.run(1)[0][0]))
        step_logits.append(np.asarray(gen.state.logits[0]))
    full = np.asarray(kvjax.forward(tiny_llama, np.concatenate([prompt, new])))[0]
    for i, logits in enumerate(step_logits):
        np.testing.assert_allclose(logits, full[len(prompt) - 1 + i], atol=1e-5)
        if i < len(new):
            assert new[i] == np.argmax(full[len(prompt) - 1 + i])


def test_batch_with_padding_equals_each_row_alone(tiny_llama):
    prompts = [random_prompt(n, seed) for seed, n in enumerate([5, 17, 40, 1])]
    batch = kvjax.generate(tiny_llama, prompts, max_new_tokens=12)
    assert len(batch) == len(prompts)
    for prompt, row in zip(prompts, batch):
        np.testing.assert_array_equal(row, kvjax.generate(tiny_llama, prompt, max_new_tokens=12))


def test_batch_rows_stop_independently(tiny_llama):
    prompts = [random_prompt(n, 10 + n) for n in (6, 9, 14)]
    free = kvjax.generate(tiny_llama, prompts, max_new_tokens=10, stop_ids=())
    stop = int(
        free[1][3]
    )  # row 1 stops after its 4th token; others stop at their first occurrence, if any
    stopped = kvjax.generate(tiny_llama, prompts, max_new_tokens=10, stop_ids=(stop,))
    for full, got in zip(free, stopped):
        hits = np.flatnonzero(full == stop)
        expected = full[: hits[0] + 1] if hits.size else full
        np.testing.assert_array_equal(got, expected)
    assert len(stopped[1]) <= 4


def test_two_dimensional_batch_returns_list(tiny_llama):
    out = kvjax.generate(
        tiny_llama,
        np.stack([random_prompt(8, 1), random_prompt(8, 2)]),
        max_new_tokens=3,
        stop_ids=(),
    )
    assert isinstance(out, list) and [len(o) for o in out] == [3, 3]


def test_stream_yields_the_generated_tokens(tiny_llama):
    prompt = random_prompt(13, 3)
    chunks = list(
        kvjax.generate_stream(tiny_llama, prompt, max_new_tokens=10, every=3, stop_ids=())
    )
    assert len(chunks) == 4
    np.testing.assert_array_equal(
        np.concatenate([c[0] for c in chunks]),
        kvjax.generate(tiny_llama, prompt, max_new_tokens=10, stop_ids=()),
    )


def test_same_bucket_does_not_recompile(tiny_llama, count_compiles):
    kvjax.generate(tiny_llama, random_prompt(20, 0), max_new_tokens=8)
    kvjax.generate(tiny_llama, random_prompt(20, 0), max_new_tokens=8, temperature=0.7, seed=1)
    with count_compiles() as compiles:
        kvjax.generate(
            tiny_llama, random_prompt(25, 1), max_new_tokens=8
        )  # same bucket (32), other prompt
        kvjax.generate(tiny_llama, random_prompt(31, 2), max_new_tokens=20)  # same cache capacity
        kvjax.generate(tiny_llama, random_prompt(17, 3), max_new_tokens=5, temperature=0.7, seed=5)
    assert compiles["n"] == 0
    with count_compiles() as compiles:  # the counter does see compilations
        kvjax.generate(tiny_llama, random_prompt(100, 1), max_new_tokens=8)
    assert compiles["n"] > 0


def test_sampling_seeded_and_greedy_limits(tiny_llama):
    prompt = random_prompt(9, 4)
    greedy = kvjax.generate(tiny_llama, prompt, max_new_tokens=12, stop_ids=())
    hot = dict(max_new_tokens=12, stop_ids=(), temperature=5.0)
    np.testing.assert_array_equal(kvjax.generate(tiny_llama, prompt, top_k=1, **hot), greedy)
    np.testing.assert_array_equal(kvjax.generate(tiny_llama, prompt, top_p=1e-6, **hot), greedy)
    a = kvjax.generate(tiny_llama, prompt, seed=7, **hot)
    np.testing.assert_array_equal(a, kvjax.generate(tiny_llama, prompt, seed=7, **hot))
    assert not np.array_equal(a, kvjax.generate(tiny_llama, prompt, seed=8, **hot))


@pytest.mark.parametrize(
    "sampling, expected",
    [
        (Sampling(temperature=1.0), [0.5, 0.3, 0.2, 0.0]),
        (Sampling(temperature=1.0, top_k=2), [0.625, 0.375, 0.0, 0.0]),
        (Sampling(temperature=1.0, top_p=0.6), [0.625, 0.375, 0.0, 0.0]),
        (Sampling(temperature=1.0, top_p=0.4), [1.0, 0.0, 0.0, 0.0]),
    ],
)
def test_sampling_frequencies(sampling, expected):
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    logits = jnp.log(jnp.asarray(np.tile(probs, (20000, 1)), jnp.float32))
    counts = (
        np.bincount(np.asarray(sample(logits, jax.random.key(0), sampling)), minlength=4) / 20000
    )
    np.testing.assert_allclose(counts, expected, atol=0.015)


@pytest.mark.smollm2
def test_smollm2_batch_of_chats_equals_alone(smollm2, smollm2_tokenizer):
    chats = [
        kvjax.chat_tokens(smollm2_tokenizer, q) for q in ("What is 2+2?", "Name a large animal.")
    ]
    batch = kvjax.generate(smollm2, chats, max_new_tokens=12)
    for ids, row in zip(chats, batch):
        np.testing.assert_array_equal(
            row, kvjax.generate(smollm2, np.array(ids), max_new_tokens=12)
        )


def test_bfloat16_batch_generates(tiny_llama):
    from kvjax.model.params import cast_params

    prompts = [random_prompt(7, 1), random_prompt(12, 2)]
    out = kvjax.generate(
        cast_params(tiny_llama, "bfloat16"), prompts, max_new_tokens=4, stop_ids=()
    )
    assert [len(o) for o in out] == [4, 4]


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_fused_qkv_groups_query_heads_with_their_kv_head(xp):
    H, Hk, K = 6, 2, 3
    q = xp.asarray(np.arange(5 * H * K, dtype=np.float32).reshape(5, H, K))
    k = xp.asarray(-np.arange(5 * Hk * K, dtype=np.float32).reshape(5, Hk, K))
    v = k - 1000
    fused = fuse_qkv(q, k, v)
    assert fused.shape == (5, Hk, H // Hk + 2, K) and isinstance(fused, type(q))
    for h in range(H):  # query head h shares KV head h // G, as grouped-query attention pairs them
        np.testing.assert_array_equal(fused[:, h // 3, h % 3], q[:, h])
    np.testing.assert_array_equal(fused[:, :, 3], k)
    np.testing.assert_array_equal(fused[:, :, 4], v)
    for a, b in zip(split_qkv(fused), (q, k, v), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "eviction",
    [
        {},
        dict(budget=16, scorer="snapkv", window=4, obs_window=4),
        dict(budget=16, scorer="adakv", protocol="prefill", window=4, obs_window=4),
    ],
    ids=["full", "snapkv", "adakv-prefill"],
)
def test_unstacked_layers_generate_as_the_stacked_scan(tiny_llama, eviction):
    unstacked = kvjax.unstack_layers(tiny_llama)
    assert len(unstacked.layers) == tiny_llama.config.n_layers
    assert unstacked.layers[1].wqkv.shape == tiny_llama.layers.wqkv.shape[1:]
    prompts = [random_prompt(n, seed) for seed, n in enumerate([5, 40, 23])]
    stacked = kvjax.generate(tiny_llama, prompts, 10, stop_ids=(), **eviction)
    looped = kvjax.generate(unstacked, prompts, 10, stop_ids=(), **eviction)
    for a, b in zip(stacked, looped, strict=True):
        np.testing.assert_array_equal(a, b)


def test_unstacked_layers_forward_and_round_trip(tiny_llama):
    unstacked = kvjax.unstack_layers(tiny_llama)
    tokens = random_prompt(30, 7)[None]
    np.testing.assert_allclose(
        kvjax.forward(unstacked, tokens), kvjax.forward(tiny_llama, tokens), rtol=0, atol=1e-6
    )
    trace = lambda p: str(jax.make_jaxpr(_forward)(p, jnp.asarray(tokens)))  # noqa: E731
    assert "scan" in trace(tiny_llama) and "scan" not in trace(unstacked)
    assert kvjax.unstack_layers(unstacked) is unstacked
    restacked = kvjax.stack_layers(unstacked)
    for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(tiny_llama), strict=True):
        np.testing.assert_array_equal(a, b)
    assert kvjax.stack_layers(tiny_llama) is tiny_llama


def test_full_cache_impl_chooses_the_decode_attention(tiny_llama):
    """budget=None with impl: the full cache's decode steps run XLA ("xla") or the kernels under the
    interpreter ("pallas" on CPU); the tokens are the default's. An unknown impl names the choices.
    """
    prompts = [random_prompt(n, seed) for seed, n in enumerate([9, 30])]
    default = kvjax.generate(tiny_llama, prompts, 6, stop_ids=())
    for impl in ("xla", "pallas"):
        for a, b in zip(
            default, kvjax.generate(tiny_llama, prompts, 6, stop_ids=(), impl=impl), strict=True
        ):
            np.testing.assert_array_equal(a, b)
        gen = _generation(tiny_llama, prompts, 6, Sampling(), 0, (), {"impl": impl}, None)
        assert gen.state.cache.impl == impl
        state, _ = Engine(tiny_llama, slots=2, max_prompt=32, impl=impl).init_state()
        assert state.cache.impl == impl
    cache = FullCache.init(tiny_llama.config, 1, 16, jnp.float32, "pallas")
    q, kv = jnp.ones((1, 1, 4, 8)), jnp.ones((1, 1, 2, 8))
    seg = Segment(positions=jnp.full((1, 1), 3, jnp.int32), from_start=False)
    assert "pallas_call" in str(
        jax.make_jaxpr(lambda c: c.attend(jnp.int32(1), q, kv, kv, seg))(cache)
    )
    with pytest.raises(ValueError, match="impl='triton' must be one of"):
        kvjax.generate(tiny_llama, prompts, 6, impl="triton")
