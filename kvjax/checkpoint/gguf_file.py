"""Read a GGUF file (llama / qwen2 / qwen3) into a config and float32 arrays, dequantizing with
``gguf``."""

from __future__ import annotations

import os

import numpy as np

from kvjax.checkpoint.errors import CheckpointError
from kvjax.checkpoint.layout import GGUF, convert
from kvjax.model.config import ModelConfig

# llama.cpp's converter interleaves the rotary halves of q/k rows for the llama architecture only.
_PERMUTED = {"llama"}


def field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def open_gguf(path: str):
    import gguf

    if not os.path.isfile(path):
        raise CheckpointError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError / struct / mmap errors on damaged files
        raise CheckpointError(
            f"GGUF file {path} is corrupt or truncated: {type(e).__name__}: {e}"
        ) from e


def gguf_config(reader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise CheckpointError(
            f"GGUF general.architecture={arch!r} is not supported (llama, qwen2, qwen3)"
        )
    get = lambda k, d=None: field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_heads, d_model = get("attention.head_count"), get("embedding_length")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    pad = field(reader, "tokenizer.ggml.padding_token_id", eos)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return ModelConfig(
        arch=arch,
        vocab_size=get("vocab_size") or len(tokens.data),
        d_model=d_model,
        n_layers=get("block_count"),
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("attention.key_length") or d_model // n_heads,
        d_ff=get("feed_forward_length"),
        max_seq_len=get("context_length"),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=int(pad) if pad is not None else 0,
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleaving of a q/k weight [N*K, ...]."""
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def read_gguf(path: str) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and flat float32 kvjax arrays of a GGUF file (shows a progress bar)."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    cfg = gguf_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def read(name):
        t = tensors[name]
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        except Exception as e:
            raise CheckpointError(f"GGUF tensor {name} in {path} cannot be decoded: {e}") from e
        w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims innermost first
        if cfg.arch in _PERMUTED and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute(w, cfg.n_heads if "attn_q" in name else cfg.n_kv_heads)
        return w

    # rope_freqs holds precomputed llama3 factors; kvjax computes them from the config instead.
    skip = [n for n in tensors if n == "rope_freqs.weight"]
    return cfg, convert(
        cfg, tensors, read, GGUF, skip=skip, desc=f"reading {os.path.basename(path)}"
    )
