"""Bad input gets a clear error naming the argument or the file, never a crash deep inside XLA."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from helpers import HF_CASES, make_hf_model

import kvjax
from kvjax.checkpoint import store


@pytest.fixture
def hf_dir(tmp_path):
    make_hf_model(*HF_CASES["llama-gqa-llama3rope-untied"], tmp_path / "hf")
    return tmp_path / "hf"


def test_unknown_registry_name_lists_known_names():
    with pytest.raises(kvjax.CheckpointError, match=r"source='smollm9'.*smollm2-135m-instruct"):
        kvjax.load("smollm9")


def test_missing_paths(tmp_path):
    with pytest.raises(kvjax.CheckpointError, match="not a registry name"):
        kvjax.load(str(tmp_path / "absent.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(kvjax.CheckpointError, match="neither a .gguf file"):
        kvjax.load(str(tmp_path / "empty"))


def test_bad_dtype_argument(tiny_llama):
    with pytest.raises(ValueError, match="dtype='float16'"):
        kvjax.load("smollm2-135m-instruct", dtype="float16")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_gguf(tmp_path, checkpoint_root, smollm2_gguf_path, damage):
    bad = tmp_path / "bad.gguf"
    if damage == "garbage":
        bad.write_bytes(b"not a gguf file at all" * 100)
    else:
        with open(smollm2_gguf_path, "rb") as f:
            bad.write_bytes(f.read(5_000_000))
    with pytest.raises(kvjax.CheckpointError, match="bad.gguf"):
        kvjax.load(str(bad))
    assert not checkpoint_root.exists() or not any(checkpoint_root.iterdir())


def test_truncated_safetensors(hf_dir, checkpoint_root):
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: os.path.getsize(f) // 2])
    with pytest.raises(kvjax.CheckpointError, match="truncated"):
        kvjax.load(str(hf_dir))


def test_shape_mismatch_lists_every_tensor(hf_dir, checkpoint_root):
    config = json.loads((hf_dir / "config.json").read_text())
    config["intermediate_size"] += 8
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(kvjax.CheckpointError) as err:
        kvjax.load(str(hf_dir))
    message = str(err.value)
    assert "(9 problems)" in message  # gate, up and down of each of the 3 layers, in one error
    for layer in range(3):
        assert (
            f"model.layers.{layer}.mlp.down_proj.weight -> layers.w_down: expected (104, 64), "
            "found (96, 64)" in message
        )


def test_missing_tensor_is_reported(hf_dir, checkpoint_root, tmp_path):
    import safetensors.numpy as stn

    from kvjax.checkpoint.hf_dir import _read_tensor, read_safetensors_index

    index = read_safetensors_index(str(hf_dir / "model.safetensors"))
    tensors = {
        k: _read_tensor(*v)
        for k, v in index.items()
        if k != "model.layers.1.self_attn.k_proj.weight"
    }
    stn.save_file(tensors, str(hf_dir / "model.safetensors"))
    with pytest.raises(kvjax.CheckpointError, match=r"layers.wk: missing layers \[1\]"):
        kvjax.load(str(hf_dir))


# Orbax reading a damaged file fails inside tensorstore, whose threads then print tracebacks ("Event
# loop is closed") after the error: a damaged file must be found before Orbax reads it.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_converted_checkpoint_damage(hf_dir, checkpoint_root):
    kvjax.load(str(hf_dir))
    (ckpt,) = [p for p in checkpoint_root.iterdir()]
    kvjax.load(str(ckpt))  # a converted directory is itself a source

    cfg = json.loads((ckpt / store.CONFIG_FILE).read_text())
    cfg["d_model"] = 48
    (ckpt / store.CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(
        kvjax.CheckpointError, match=r"embed: expected \(211, 48\), found \(211, 64\)"
    ):
        kvjax.load(str(ckpt))
    cfg["d_model"] = 64
    (ckpt / store.CONFIG_FILE).write_text(json.dumps(cfg))

    data = sorted(f for f in (ckpt / "params").rglob("*") if f.is_file() and f.parent.name == "d")
    intact = data[0].read_bytes()
    data[0].write_bytes(bytes([intact[0] ^ 1]) + intact[1:])  # the same size
    with pytest.raises(
        kvjax.CheckpointError,
        match=rf"params is corrupt: params/.*{data[0].name} changed since it "
        rf"was written \(its CRC-32 differs\); delete .* to convert again",
    ):
        kvjax.load(str(ckpt))
    data[0].write_bytes(b"\0" * 10)
    with pytest.raises(
        kvjax.CheckpointError, match=rf"{data[0].name} holds 10 bytes, {len(intact)} when written"
    ):
        kvjax.load(str(ckpt))
    data[0].unlink()
    with pytest.raises(kvjax.CheckpointError, match=rf"{data[0].name} is missing"):
        kvjax.load(str(ckpt))
    data[0].write_bytes(intact)
    listing = (ckpt / store.FILES_FILE).read_text()
    (ckpt / store.FILES_FILE).write_text(listing[:20])
    with pytest.raises(kvjax.CheckpointError, match="params is corrupt: files.json is unreadable"):
        kvjax.load(str(ckpt))
    (
        ckpt / store.FILES_FILE
    ).unlink()  # converted before kvjax recorded its files: nothing to check
    kvjax.load(str(ckpt))

    (ckpt / store.CONFIG_FILE).write_text("{broken")
    with pytest.raises(kvjax.CheckpointError, match="kvjax_config.json is missing or corrupt"):
        kvjax.load(str(ckpt))


def test_a_checkpoint_with_separate_qkv_projections_is_refused_with_the_reason(
    hf_dir, checkpoint_root, tmp_path
):
    from kvjax.model.params import params_to_flat, split_qkv

    params = kvjax.load(str(hf_dir))
    flat = params_to_flat(params)
    flat["layers.wq"], flat["layers.wk"], flat["layers.wv"] = split_qkv(flat.pop("layers.wqkv"))
    store.write_checkpoint(
        str(tmp_path / "old"), params.config, flat
    )  # as kvjax converted before wqkv
    with pytest.raises(
        kvjax.CheckpointError,
        match=r"(?s)layers.wqkv: expected .* missing.*layers.wq: unexpected "
        r".*stored apart: an older kvjax converted it",
    ):
        kvjax.load(str(tmp_path / "old"))


def test_conversion_is_atomic(hf_dir, checkpoint_root, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    # fails after the weights are written, before the config that marks a complete checkpoint
    monkeypatch.setattr(kvjax.ModelConfig, "to_json", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        kvjax.load(str(hf_dir))
    assert (
        list(checkpoint_root.iterdir()) == []
    )  # neither a partial checkpoint nor a temporary directory
    monkeypatch.undo()
    assert kvjax.load(str(hf_dir)).config.n_layers == 3


def test_reconverts_when_source_changes(hf_dir, checkpoint_root):
    a = kvjax.load(str(hf_dir))
    make_hf_model(*HF_CASES["llama-gqa-llama3rope-untied"], hf_dir, seed=1)
    os.utime(hf_dir / "model.safetensors", (1, 1))
    b = kvjax.load(str(hf_dir))
    assert not np.array_equal(np.asarray(a.embed), np.asarray(b.embed))


@pytest.mark.parametrize(
    "tokens, error, match",
    [
        ([], ValueError, r"tokens\[0\] is empty"),
        (np.zeros((0, 5), np.int32), ValueError, "tokens is an empty batch"),
        (np.array([], np.int32), ValueError, r"tokens\[0\] is empty"),
        ([[1, 2], []], ValueError, r"tokens\[1\] is empty"),
        (np.array([1.0, 2.0]), TypeError, "tokens must hold integer token ids, got dtype float64"),
        (np.array([1, 200]), ValueError, r"tokens\[0\] holds ids outside \[0, 97\)"),
        (np.zeros((1, 2, 3), np.int32), ValueError, "tokens must be 1-D"),
        ("What is 2 + 2?", TypeError, "tokens must be token ids, got text: encode it first"),
        (["one", "two"], TypeError, "tokens must be token ids, got text"),
    ],
)
def test_bad_tokens(tiny_llama, tokens, error, match):
    with pytest.raises(error, match=match):
        kvjax.generate(tiny_llama, tokens, max_new_tokens=2)


def test_text_after_a_context_and_params_that_are_not_params_are_named(tiny_llama):
    context = kvjax.prefill(tiny_llama, np.arange(4, 40, dtype=np.int32), budget=20, window=4)
    with pytest.raises(TypeError, match="tokens must be token ids, got text"):
        kvjax.decode(tiny_llama, context, "And then?")
    for params in (None, {"embed": np.zeros(3)}):
        for call in (kvjax.generate, kvjax.prefill_full):
            with pytest.raises(TypeError, match="params must be kvjax's Params .kvjax.load"):
                call(params, np.ones(5, np.int32))


@pytest.mark.parametrize("stop_ids", [[97], [-1], [1.0], ["</s>"]])
def test_stop_ids_outside_the_vocabulary_are_refused(tiny_llama, stop_ids):
    with pytest.raises(ValueError, match=r"stop_ids=.* must be token ids in \[0, 97\)"):
        kvjax.generate(tiny_llama, np.ones(5, np.int32), max_new_tokens=2, stop_ids=stop_ids)


def test_prompt_beyond_context(tiny_llama):
    with pytest.raises(
        ValueError,
        match="prompt length 500 \\+ max_new_tokens 20 exceeds the model's context of 512",
    ):
        kvjax.generate(tiny_llama, np.ones(500, np.int32), max_new_tokens=20)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        kvjax.generate(tiny_llama, np.ones(5, np.int32), max_new_tokens=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(top_p=0.0), "top_p=0.0"),
    ],
)
def test_bad_sampling(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvjax.generate(tiny_llama, np.ones(5, np.int32), max_new_tokens=2, **kwargs)


def test_moments_without_sums_are_refused_by_momentkv(tiny_llama):
    """A cache filled under SnapKV keeps only the count of its evicted tokens, and one filled under
    MomentKV's zeroth order no Σ v kᵀ; decoding either under MomentKV, which reads them, is refused
    by name instead of starting from empty statistics. The zeroth order decodes a first-order
    cache (it reads less)."""
    from kvjax.runtime.options import eviction_from

    def cache(scorer):
        return kvjax.prefill(
            tiny_llama, [np.arange(4, 40, dtype=np.int32)], budget=20, scorer=scorer, window=4
        ).cache

    momentkv = eviction_from(budget=20, scorer="momentkv", window=4)
    with pytest.raises(
        ValueError, match="scorer='snapkv\\+momentkv' reads the moments of the evicted tokens"
    ):
        momentkv.fit(cache("snapkv"), tiny_llama.config, 1)
    with pytest.raises(ValueError, match=r"filled under MomentKV's zeroth order\) keeps no Σ v kᵀ"):
        momentkv.fit(cache("snapkv+momentkv-zeroth"), tiny_llama.config, 1)
    K = tiny_llama.config.head_dim
    assert momentkv.fit(cache("momentkv"), tiny_llama.config, 1).moments.dims == (K, K)
    zeroth = eviction_from(budget=20, scorer="snapkv+momentkv-zeroth", window=4)
    assert zeroth.fit(cache("momentkv"), tiny_llama.config, 1).moments.dims == (K, K)


def test_stream_steps_and_another_models_context_are_refused(tiny_llama):
    """``generate_stream(every=0)`` had looped forever; a context decoded with another model's
    params had failed inside XLA on a broadcast."""
    prompt = np.arange(4, 40, dtype=np.int32)
    with pytest.raises(ValueError, match="every=0 must be an integer >= 1"):
        next(kvjax.generate_stream(tiny_llama, prompt, budget=20, window=4, every=0))
    context = kvjax.prefill(tiny_llama, prompt, budget=20, window=4)
    other = kvjax.init_params(dataclasses.replace(tiny_llama.config, n_layers=3), jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"context: made for another model: n_layers 2 \(the model's 3\)"
    ):
        kvjax.decode(other, context, [5, 6])
