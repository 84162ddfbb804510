"""Logit parity with `transformers` (torch, CPU, float32) on small random Llama / Qwen2 / Qwen3 models,
loaded through kvjax's Hugging Face directory reader."""

import numpy as np
import pytest
import torch
import transformers

import kvjax

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
            max_position_embeddings=256, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CASES = {
    "llama-gqa-llama3rope-untied": (transformers.LlamaConfig, dict(num_key_value_heads=2,
                                                                   rope_parameters=LLAMA3_ROPE)),
    "llama-mha-tied": (transformers.LlamaConfig, dict(num_key_value_heads=8, tie_word_embeddings=True)),
    "llama-linear-rope": (transformers.LlamaConfig, dict(num_key_value_heads=4, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen2-gqa-tied": (transformers.Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-gqa-untied": (transformers.Qwen2Config, dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen3-gqa-untied": (transformers.Qwen3Config, dict(num_key_value_heads=2, head_dim=16,
                                                        tie_word_embeddings=False)),
    "qwen3-gqa-tied": (transformers.Qwen3Config, dict(num_key_value_heads=4, tie_word_embeddings=True)),
}


def make_hf_model(config_cls, overrides, path, seed=0):
    torch.manual_seed(seed)
    config = config_cls(**BASE, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # non-trivial norm scales and biases so that their handling is tested
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".bias")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path, checkpoint_root):
    config_cls, overrides = CASES[case]
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
    make_hf_model(*CASES["qwen2-gqa-untied"], tmp_path / "hf")
    tokens = np.random.default_rng(2).integers(0, BASE["vocab_size"], (1, 40))
    ref = np.asarray(kvjax.forward(kvjax.load(str(tmp_path / "hf")), tokens))
    params = kvjax.load(str(tmp_path / "hf"), dtype="bfloat16")
    assert params.dtype == np.dtype("bfloat16")
    got = np.asarray(kvjax.forward(params, tokens))
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_sharded_safetensors_with_index(tmp_path, checkpoint_root):
    model = make_hf_model(*CASES["llama-gqa-llama3rope-untied"], tmp_path / "hf")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    tokens = np.arange(30)[None] % BASE["vocab_size"]
    a = np.asarray(kvjax.forward(kvjax.load(str(tmp_path / "hf")), tokens))
    b = np.asarray(kvjax.forward(kvjax.load(str(tmp_path / "sharded")), tokens))
    np.testing.assert_array_equal(a, b)
