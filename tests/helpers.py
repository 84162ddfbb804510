"""Plain helpers and constants shared by several test modules (fixtures live in conftest.py)."""

import importlib
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from reference_eviction import parse_scorer

from kvjax.eviction.moments import Moments

GPU_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu"


def gpu_script(module: str):
    """A module of the GPU script (benchmarks/gpu, whose modules import each other by name)."""
    sys.path.insert(0, str(GPU_SCRIPT))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(GPU_SCRIPT))


def load_script(path: str):
    """A script of the repository (``benchmarks/...``) as a module, by its path from the root."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, GPU_SCRIPT.parent.parent / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# Every test process's XLA flags (conftest.py): no backend optimisation, and XLA:CPU's older
# elemental emitters for fusions instead of its MLIR fusion emitters, which compile the suite's
# small programs more slowly.
QUICK_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


# XLA:CPU runs a device's collectives on the process's intra-op thread pool, of max(cores, devices)
# threads (NPROC stands for the cores), and a collective holds its thread until every participant
# has arrived. A device may start its next collective before the last one ends, so on a 2-core
# machine 8 fake devices could fill the pool with collectives that wait for a device left without
# a thread (seen as a stall in an all-gather on the (data=2, model=4) mesh). Eight threads a device
# leave room for that.
FAKE_DEVICE_THREADS = 8


def xla_env(devices: int | None = None, *, optimized: bool = False) -> dict[str, str]:
    """Environment for a subprocess: this run's XLA_FLAGS, or without QUICK_COMPILE (``optimized``:
    the compiler as a user's process runs it); with ``devices`` fake CPU devices, and NPROC giving
    the thread pool FAKE_DEVICE_THREADS threads for each."""
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not (optimized and f in QUICK_COMPILE)
    ]
    if not devices:
        return {"XLA_FLAGS": " ".join(flags)}
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    return {"XLA_FLAGS": " ".join(flags), "NPROC": str(FAKE_DEVICE_THREADS * devices)}


# --- real-model prompts: a needle in repetitive filler (SmolLM2 tests)
NEEDLE = "The special magic number is 7341295. "
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    * 30
)
QUESTION = (
    "What is the special magic number mentioned in the text above? Answer with the number only."
)


def distinct_prompts(lengths=(37, 20), seed=0, vocab=97):
    """Prompts without repeated tokens (repeated tokens have equal layer-0 values, which makes exact
    score ties)."""
    rng = np.random.default_rng(seed)
    return [rng.choice(np.arange(4, vocab), n, replace=False).astype(np.int32) for n in lengths]


def kept_positions(pos: np.ndarray, row: int) -> list[list[list[int]]]:
    """[L, B, Hk, S] slot positions -> per layer and KV head, the sorted kept positions of row."""
    return [[sorted(int(p) for p in head if p >= 0) for head in layer[row]] for layer in pos]


def moments_of(k_evicted, v_evicted):
    """Moments of evicted tokens k, v [B, Hk, E, K]."""
    return Moments(
        count=jnp.full(k_evicted.shape[:2], float(k_evicted.shape[2])),
        k_sum=k_evicted.sum(2),
        v_sum=v_evicted.sum(2),
        vk_sum=jnp.einsum("bhei,bhej->bhij", v_evicted, k_evicted),
    )


def scorer_requirements(name: str, head_scores: str, tiny: bool = True) -> dict:
    """What a scorer name needs beyond the common options, for tests that run every name: KVzip's
    repeat prompt (any token ids do), kvzip-head's file of head scores (``head_scores``), and for
    PyramidKV on the tiny models of two or three layers (``tiny``) nothing protected (its last layer
    keeps m/20 tokens)."""
    from kvjax.eviction import BASES, RepeatPrompt, split_name

    allocation, base, _ = split_name(name)
    needs = {
        "kvzip": dict(repeat_prompt=RepeatPrompt((5, 6, 7), (5, 6, 8), (9,))),
        "heads": dict(head_scores=head_scores),
    }.get(BASES[base].scoring_pass, {})
    return needs | (dict(n_sink=0, window=0) if allocation == "pyramidkv" and tiny else {})


def own_pass(name: str) -> bool:
    """The scorer scores the prompt in a pass of its own (KVzip): prefill protocol only."""
    from kvjax.eviction import BASES, split_name

    return BASES[split_name(name)[1]].scoring_pass is not None


# --- the NumPy reference's self-checks: prompt length and new tokens of the ``prompt`` /
# ``no_eviction`` fixtures
P, N = 80, 10


def defaults(scorer, budget=20):
    """Per-base options in the spirit of the docs' defaults table, scaled to the tiny test."""
    return {
        "streamingllm": dict(n_sink=4, window=0),
        "h2o": dict(n_sink=2, window=budget // 4),
        "h2o-window": dict(n_sink=2, window=8, obs_window=8),
        "tova": dict(n_sink=0, window=0),
        "snapkv": dict(n_sink=0, window=8, obs_window=8),
        "expected-attention": dict(n_sink=2, window=0, pool="none"),
    }[parse_scorer(scorer)[0]]


# --- small random Hugging Face models (parity and checkpoint-error tests)
BASE = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

HF_CASES = {
    "llama-gqa-llama3rope-untied": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-mha-tied": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=8, tie_word_embeddings=True),
    ),
    "llama-linear-rope": (
        transformers.LlamaConfig,
        dict(
            num_key_value_heads=4,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
    "qwen2-gqa-tied": (
        transformers.Qwen2Config,
        dict(num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen2-gqa-untied": (
        transformers.Qwen2Config,
        dict(num_key_value_heads=4, tie_word_embeddings=False),
    ),
    "qwen3-gqa-untied": (
        transformers.Qwen3Config,
        dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    ),
    "qwen3-gqa-tied": (
        transformers.Qwen3Config,
        dict(num_key_value_heads=4, tie_word_embeddings=True),
    ),
}


def make_hf_model(config_cls, overrides, path, seed=0):
    torch.manual_seed(seed)
    config = config_cls(**BASE, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).eval()
    with torch.no_grad():  # non-trivial norm scales and biases so that their handling is tested
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".bias")):
                p.copy_(
                    1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p)
                )
    model.save_pretrained(path)
    return model


def covering(names):
    """Of the scorer ``names``: every base and alias, and each modifier once on the base used least
    so far, so that the default run compiles each part once (tests/test_engine_vs_reference.py
    checks the combinations)."""
    from collections import Counter

    from kvjax.eviction import ALIASES, split_name

    parts = {name: split_name(name)[1:] for name in names if name not in ALIASES}
    picked = [name for name in names if name in ALIASES or not parts[name][1]]
    uses = Counter(parts[name][0] for name in picked if name in parts)
    for modifier in dict.fromkeys(m for _, m in parts.values() if m):
        name = min(
            (n for n, (b, m) in parts.items() if m == modifier), key=lambda n: uses[parts[n][0]]
        )
        uses[parts[name][0]] += 1
        picked.append(name)
    return picked


def wait_for(condition, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
