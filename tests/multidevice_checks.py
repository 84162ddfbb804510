"""Sharded runs on 8 devices against the one-device run (run by tests/test_sharding.py in a
subprocess with 8 fake CPU devices; ``pytest tests/multidevice_checks.py`` needs
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``NPROC=64``, as helpers.xla_env says).

On meshes (data=2, model=4) and (model=8) (and (data=8) for the full and the paged cache) of a small
model whose heads divide, and SmolLM2 with SnapKV on (data=2) and (model=2, its 3 KV and 9 query
heads then replicated): the same generated tokens, logits within 1e-5, the same kept positions per
(layer, row, KV head); the params (stacked or unstacked) and caches placed as their logical axes
say; the compiled decode step gathers no keys, values or scorer state.
"Logits within 1e-5" is relative to the largest logit: a reduction split over devices adds in
another order.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from kvjax.kernels.quantized import values

import kvjax
from kvjax.runtime.decoding import Generation, decode_steps
from kvjax.runtime.options import EvictionOptions, eviction_from
from kvjax.runtime.sampling import Sampling
from kvjax.serving import Engine
from kvjax.sharding import make_mesh, shard

MESHES = ("data=8", "data=2,model=4", "model=8")
# One of each kind: the dense cache per KV head, a decision over the layer's heads
# (aggregate="layer"), MomentKV's per-head statistics, the paged cache of a shared allocation, and
# Expected Attention's statistics of the queries (its logits per shard: ``expected_logits``).
SETTINGS = {
    "full": {},
    "snapkv": dict(budget=16, scorer="snapkv", obs_window=4, window=4),
    "tova-layer": dict(budget=16, scorer="tova", aggregate="layer"),
    "momentkv": dict(budget=16, scorer="momentkv", obs_window=4, window=4),
    "adakv": dict(budget=16, scorer="adakv", obs_window=4, window=4),
    # query statistics per head, and RoPE's frequencies, which every row shares
    "expected-attention": dict(budget=16, scorer="expected-attention", window=4),
}


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    assert jax.device_count() == 8, (
        "run with XLA_FLAGS=--xla_force_host_platform_device_count=8 NPROC=64"
    )


@pytest.fixture(scope="module")
def model():
    cfg = kvjax.ModelConfig(
        arch="qwen2",
        vocab_size=128,
        d_model=64,
        n_layers=2,
        n_heads=16,
        n_kv_heads=8,
        head_dim=8,
        d_ff=128,
        max_seq_len=512,
        qkv_bias=True,
        eos_token_ids=(3,),
        pad_token_id=0,
    )
    return kvjax.init_params(cfg, jax.random.key(0), scale=0.3)


def prompts(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, length).astype(np.int32) for length in rng.integers(5, 60, n)]


def run(params, rows, options, mesh, steps=6):
    ev = eviction_from(context=max(map(len, rows)), **options)
    gen = Generation.from_prompts(
        params if mesh is None else shard(params, mesh), rows, steps, Sampling(), 0, (), ev, mesh
    )
    tokens = gen.run(steps)
    return gen, tokens


def placed(x) -> tuple:
    """An array's PartitionSpec as a tuple of one entry per dimension (JAX drops trailing Nones)."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def kept(cache):
    return np.sort(np.asarray(cache.sorted_pos), axis=-1) if hasattr(cache, "sorted_pos") else None


# the one-device run of (params, rows, options), shared by the meshes that compare with it
ONE_DEVICE = {}


def check_equal(params, rows, options, mesh):
    key = (id(params), tuple(row.tobytes() for row in rows), tuple(sorted(options.items())))
    if key not in ONE_DEVICE:
        ONE_DEVICE[key] = run(params, rows, options, None)
    one, one_tokens = ONE_DEVICE[key]
    many, many_tokens = run(params, rows, options, mesh)
    for a, b in zip(one_tokens, many_tokens, strict=True):
        np.testing.assert_array_equal(a, b)
    # Within 1e-5 of the largest logit: a split reduction adds in another order (measured: under
    # 3.5e-6 of it, absolute up to 2.9e-5 on logits up to ~8 where heads or the MLP are split; 0
    # with the batch split only).
    expected = np.asarray(one.state.logits)
    assert np.abs(np.asarray(many.state.logits) - expected).max() <= 1e-5 * np.abs(expected).max()
    if options:
        np.testing.assert_array_equal(kept(many.state.cache), kept(one.state.cache))
    return many


# Every setting on the meshes that split heads (with and without the batch); on the batch alone
# (data=8), the dense and the paged cache once each (data=2,model=4 splits the batch for every
# setting).
CASES = [
    (spec, name)
    for spec in MESHES
    for name in sorted(SETTINGS)
    if "model" in spec or name in ("full", "adakv")
]


@pytest.mark.parametrize("spec, name", CASES)
def test_sharded_run_equals_one_device(model, spec, name):
    mesh = make_mesh(spec)
    many = check_equal(model, prompts(8, 128), SETTINGS[name], mesh)
    data, heads = ("data" if "data" in spec else None), ("model" if "model" in spec else None)
    cache = many.state.cache
    k = cache.k_pages if name == "adakv" else cache.k
    assert placed(k) == (
        (data, None, None, None) if name == "adakv" else (None, data, heads, None, None)
    )
    if name != "full":
        assert placed(cache.pos) == (None, data, heads, None)
        assert placed(cache.state) == (None, data, heads, None, None)


@pytest.mark.parametrize("spec", MESHES)
def test_params_are_placed_by_their_logical_axes(model, spec):
    params = shard(model, make_mesh(spec))
    heads = "model" if "model" in spec else None
    assert placed(params.layers.wqkv) == (None, None, heads, None, None)
    assert placed(params.layers.w_gate) == (None, None, heads)
    assert placed(params.layers.w_down) == (None, heads, None)
    assert placed(params.embed) == (heads, None)
    assert shard(params, make_mesh(spec)) is params  # already placed: nothing moves


def test_unstacked_layers_are_placed_and_run_as_the_stacked_scan(model):
    params = shard(kvjax.unstack_layers(model), make_mesh("data=2,model=4"))
    assert all(placed(layer.wqkv) == (None, "model", None, None) for layer in params.layers)
    assert all(placed(layer.w_down) == ("model", None) for layer in params.layers)
    tokens = np.stack([row[:5] for row in prompts(8, 128, seed=3)])
    expected = np.asarray(kvjax.forward(model, tokens))
    assert (
        np.abs(np.asarray(kvjax.forward(params, tokens)) - expected).max()
        <= 1e-5 * np.abs(expected).max()
    )


def test_a_batch_that_does_not_fill_the_data_axis_is_padded(model):
    rows = prompts(3, 128, seed=1)
    one = kvjax.generate(model, rows, 5, stop_ids=(), budget=16, scorer="snapkv", obs_window=4)
    many = kvjax.generate(
        model,
        rows,
        5,
        stop_ids=(),
        budget=16,
        scorer="snapkv",
        obs_window=4,
        mesh=make_mesh("data=2,model=4"),
    )
    assert len(many) == 3 and all((a == b).all() for a, b in zip(one, many, strict=True))
    with pytest.raises(ValueError, match="a batch of 3 rows on a mesh with data=2"):
        kvjax.prefill(model, rows, budget=16, scorer="h2o", mesh=make_mesh("data=2"))


def test_compressed_contexts_decode_on_their_mesh(model):
    rows = prompts(4, 128, seed=2)
    question = [np.arange(10, 14, dtype=np.int32)] * 4
    mesh = make_mesh("data=2,model=4")
    for options in (
        dict(budget=16, scorer="snapkv", obs_window=4),
        dict(budget=16, scorer="adakv", obs_window=4),
    ):
        one = kvjax.prefill(model, rows, **options)
        many = kvjax.prefill(model, rows, mesh=mesh, **options)
        assert many.mesh is mesh
        np.testing.assert_array_equal(kept(many.cache), kept(one.cache))
        for a, b in zip(
            kvjax.decode(model, one, question, 5, evict=False, stop_ids=()),
            kvjax.decode(model, many, question, 5, evict=False, stop_ids=()),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)
    shared = kvjax.prefill_full(model, rows, mesh=mesh)
    np.testing.assert_array_equal(
        kept(shared.compress(budget=16, scorer="snapkv", obs_window=4).cache),
        kept(
            kvjax.prefill(
                model, rows, budget=16, scorer="snapkv", obs_window=4, protocol="prefill"
            ).cache
        ),
    )


def test_a_mesh_made_by_jax_with_explicit_axes_runs_as_one_device(model):
    """jax.make_mesh's default axes are Explicit; kvjax runs on its devices with Auto axes
    (kvjax.sharding.auto_mesh, at each entry point, whatever the cache): the same tokens through
    generate, prefill + decode and the serving engine."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert set(mesh.axis_types) == {AxisType.Explicit}
    rows = prompts(8, 128, seed=4)
    one = kvjax.generate(model, rows, 6, stop_ids=(), **SETTINGS["adakv"])
    many = kvjax.generate(model, rows, 6, stop_ids=(), mesh=mesh, **SETTINGS["adakv"])
    assert all((a == b).all() for a, b in zip(one, many, strict=True))
    question = [np.arange(10, 14, dtype=np.int32)] * 8
    context = kvjax.prefill(model, rows, mesh=mesh, **SETTINGS["snapkv"])
    for a, b in zip(
        kvjax.decode(
            model, kvjax.prefill(model, rows, **SETTINGS["snapkv"]), question, 4, stop_ids=()
        ),
        kvjax.decode(model, context, question, 4, stop_ids=()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    engine = Engine(
        model, slots=8, max_prompt=64, max_new_tokens=6, mesh=mesh, **SETTINGS["snapkv"]
    )
    state, filling = engine.init_state()
    for i, row in enumerate(rows):  # each prompt prefilled in row 0, a chunk at a time, then slot i
        inputs, fed, filling = engine.inputs(row, stop_ids=()), 0, engine.begin(filling, 0)
        while fed < len(row):
            chunk = engine.chunk([(inputs, fed)] + [None] * (engine.prefill_rows - 1))
            filling, logits = engine.fill(filling, chunk)
            fed += int(chunk.n[0])
        state = engine.promote(filling, 0, logits, state, i, inputs)
    steps = []
    for _ in range(6):
        state, tokens = engine.generate(state)
        steps.append(np.asarray(tokens))
    alone = kvjax.generate(model, rows, 6, stop_ids=(), **SETTINGS["snapkv"])
    np.testing.assert_array_equal(np.concatenate(steps, axis=1), np.stack(alone))


@pytest.mark.parametrize(
    ("name", "kv_dtype"), [("full", "int8"), ("snapkv", "int4"), ("adakv", "int8")]
)
def test_quantized_caches_split_as_the_model_dtype_ones(model, name, kv_dtype):
    """kv_dtype on (data=2, model=4): codes and scales placed along the keys' axes (the scales' last
    one whole), and the cache the one-device run's up to the split program's float rounding.
    Quantization rounds at steps of max|x| / qmax, so that rounding of the keys (within ~4e-6), like
    any change of XLA's fusions, can move a code by one, and later layers and eviction choices then
    differ by that noise: the full cache's layer-0 codes are within one of the one-device run's, its
    next-token logits within 5% of the largest and its first tokens the same; a budget cache keeps
    as many tokens per layer and row. (Exact equality is checked on one device, against the NumPy
    oracle.)"""
    options = EvictionOptions.of(**(SETTINGS[name] | dict(kv_dtype=kv_dtype)))
    rows = prompts(8, 128, seed=4)
    ev = options.resolve(max(map(len, rows)))
    mesh = make_mesh("data=2,model=4")
    one, many = (
        Generation.from_prompts(p, rows, 1, Sampling(), 0, (), ev, me, **options.full_cache).state
        for p, me in ((model, None), (shard(model, mesh), mesh))
    )
    k = [s.cache.k_pages if name == "adakv" else s.cache.k for s in (one, many)]
    expected = (
        ("data", None, None, None) if name == "adakv" else (None, "data", "model", None, None)
    )
    assert placed(k[1].data) == placed(k[1].scale) == expected
    if name != "full":
        counts = [np.asarray((s.cache.pos >= 0).sum((-2, -1))) for s in (one, many)]
        np.testing.assert_array_equal(counts[0], counts[1])
        return
    codes = [
        np.asarray(values(x)[0]) / np.maximum(np.asarray(x.scale[0], np.float32), 1e-30) for x in k
    ]
    assert np.abs(codes[0] - codes[1]).max() <= 1.0 + 1e-3
    logits = [np.asarray(s.logits) for s in (one, many)]
    assert np.abs(logits[0] - logits[1]).max() <= 0.05 * np.abs(logits[0]).max()
    np.testing.assert_array_equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.parametrize("name", ["momentkv", "adakv"])
def test_pallas_kernels_run_per_shard(model, name):
    """impl="pallas" (the TPU kernels under the interpreter): each device runs the kernel on its own
    rows and KV heads (jax.shard_map; XLA cannot split a Pallas call itself), and the run equals the
    one-device run. The dense cache's block and decode kernels (MomentKV's calls pass its moments
    besides SnapKV's arguments) and the paged cache's."""
    check_equal(
        model,
        prompts(4, 128, seed=3),
        SETTINGS[name] | dict(impl="pallas"),
        make_mesh("data=2,model=4"),
    )


@pytest.mark.parametrize("name", ["snapkv", "tova-layer", "momentkv"])
def test_decode_step_gathers_no_keys_values_or_state(model, name):
    """The compiled decode loop of the dense cache on (data=2, model=4): any all-gather in it moves
    tokens, lengths or logits (shapes without the slot axis), never the cache (whose slot axis is
    the budget + 1 = 37)."""
    mesh = make_mesh("data=2,model=4")
    options = SETTINGS[name] | dict(budget=36)
    gen, _ = run(model, prompts(8, 128), options, mesh, steps=2)
    with jax.set_mesh(mesh):
        text = (
            decode_steps.lower(
                gen.params,
                gen.state,
                jnp.int32(4),
                jnp.int32(3),
                gen.sampling,
                gen.stop_ids,
                gen.ev,
            )
            .compile()
            .as_text()
        )
    slots = gen.state.cache.slots
    assert slots == 37
    gathered = re.findall(r"= \w+\[([\d,]*)\][^=]* all-gather\(", text)
    assert gathered, "the mesh splits the batch, so some small all-gather is expected"
    assert not [shape for shape in gathered if str(slots) in shape.split(",")], gathered


@pytest.fixture(scope="module")
def smollm2():
    return kvjax.load("smollm2-135m-instruct")


@pytest.mark.smollm2
@pytest.mark.parametrize("spec", ["data=2", "model=2"])
def test_smollm2_sharded_equals_one_device(smollm2, spec):
    tokenizer = kvjax.load_tokenizer("smollm2-135m-instruct")
    rows = [
        np.asarray(kvjax.chat_tokens(tokenizer, q), np.int32)
        for q in (
            "What is the capital of France? Answer in one sentence.",
            "Name three primary colours.",
        )
    ]
    mesh = make_mesh(spec)
    if spec == "model=2":  # 3 KV heads and 9 query heads do not split in two: they are replicated
        on_mesh = shard(smollm2, mesh)
        assert placed(on_mesh.layers.wqkv) == (None, None, None, None, None)
        assert placed(on_mesh.layers.w_up) == (None, None, "model")
    # SnapKV alone: the full cache is checked on every mesh with the small model above
    check_equal(smollm2, rows, dict(budget=24, scorer="snapkv", obs_window=8, window=8), mesh)
