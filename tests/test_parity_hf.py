"""Logit parity with `transformers` (torch, CPU, float32) on small random Llama / Qwen2 / Qwen3
models, loaded through kvjax's Hugging Face directory reader."""

import numpy as np
import pytest
import torch
from helpers import BASE, HF_CASES, make_hf_model

import kvjax


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_match_transformers(case, tmp_path, checkpoint_root):
    config_cls, overrides = HF_CASES[case]
    model = make_hf_model(config_cls, overrides, tmp_path / "hf")
    tokens = np.random.default_rng(1).integers(0, BASE["vocab_size"], (2, 67))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    params = kvjax.load(str(tmp_path / "hf"))
    assert params.config.tie_embeddings == model.config.tie_word_embeddings
    assert (params.lm_head is None) == params.config.tie_embeddings
    got = np.asarray(kvjax.forward(params, tokens))
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4


def test_bfloat16_close_to_float32(tmp_path, checkpoint_root):
    make_hf_model(*HF_CASES["qwen2-gqa-untied"], tmp_path / "hf")
    tokens = np.random.default_rng(2).integers(0, BASE["vocab_size"], (1, 40))
    ref = np.asarray(kvjax.forward(kvjax.load(str(tmp_path / "hf")), tokens))
    params = kvjax.load(str(tmp_path / "hf"), dtype="bfloat16")
    assert params.dtype == np.dtype("bfloat16")
    got = np.asarray(kvjax.forward(params, tokens))
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_sharded_safetensors_with_index(tmp_path, checkpoint_root):
    model = make_hf_model(*HF_CASES["llama-gqa-llama3rope-untied"], tmp_path / "hf")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert (
        "model.safetensors.index.json" in files
        and sum(f.endswith(".safetensors") for f in files) > 2
    )
    tokens = np.arange(30)[None] % BASE["vocab_size"]
    a = np.asarray(kvjax.forward(kvjax.load(str(tmp_path / "hf")), tokens))
    b = np.asarray(kvjax.forward(kvjax.load(str(tmp_path / "sharded")), tokens))
    np.testing.assert_array_equal(a, b)
