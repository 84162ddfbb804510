"""Models of a named shape with random weights (``random:<shape>``): the real server and the
benchmarks run them where no weights can be downloaded (a GPU machine without network). Their
text is meaningless; every report of one says "random weights".

``SHAPES`` holds the configurations (published ``config.json`` values); ``random_params`` draws the
weights (``kvjax.init_params``, on the default device); ``random_tokenizer`` is a byte-level
tokenizer of the shape's vocabulary size with a plain chat template: text encodes to its UTF-8
bytes (ids 0-255), every other id decodes to ``<|id|>``.
"""

from __future__ import annotations

import dataclasses

import jax

from kvjax.model.config import ModelConfig

PREFIX = "random:"

_LLAMA3_ROPE = (
    ("factor", 8.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192),
)
_LLAMA_3_1_8B = ModelConfig(
    arch="llama",
    vocab_size=128256,
    d_model=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    d_ff=14336,
    max_seq_len=131072,
    rope_theta=500000.0,
    rope_type="llama3",
    rope_scaling=_LLAMA3_ROPE,
    norm_eps=1e-5,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
    pad_token_id=128001,
)
_QWEN3_8B = ModelConfig(
    arch="qwen3",
    vocab_size=151936,
    d_model=4096,
    n_layers=36,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    d_ff=12288,
    max_seq_len=40960,
    rope_theta=1000000.0,
    norm_eps=1e-6,
    qk_norm=True,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
)
SHAPES: dict[str, ModelConfig] = {
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "llama-3.2-1b": dataclasses.replace(
        _LLAMA_3_1_8B,
        d_model=2048,
        n_layers=16,
        head_dim=64,
        d_ff=8192,
        tie_embeddings=True,
        rope_scaling=(("factor", 32.0),) + _LLAMA3_ROPE[1:],
    ),
    "qwen3-8b": _QWEN3_8B,
    "qwen2.5-7b": dataclasses.replace(
        _QWEN3_8B,
        arch="qwen2",
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        d_ff=18944,
        max_seq_len=32768,
        qk_norm=False,
        qkv_bias=True,
    ),
    # for smoke runs: a server and benchmarks that start in seconds on a CPU
    "tiny": ModelConfig(
        arch="llama",
        vocab_size=512,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        max_seq_len=4096,
        eos_token_ids=(2,),
        pad_token_id=0,
    ),
    "smollm2-135m": ModelConfig(
        arch="llama",
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        d_ff=1536,
        max_seq_len=8192,
        rope_theta=100000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        pad_token_id=2,
    ),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def shape_of(source: str) -> ModelConfig:
    """The configuration of ``random:<shape>`` (ValueError naming the shapes for another)."""
    name = source[len(PREFIX) :]
    if name not in SHAPES:
        raise ValueError(
            f"model {source!r}: random shapes are {', '.join(PREFIX + s for s in SHAPES)}"
        )
    return SHAPES[name]


def random_params(source: str, dtype):
    """Random weights of ``random:<shape>`` in ``dtype`` (``init_params`` with key 0, op by op on
    the default device: one weight in float32 at a time besides the result)."""
    from kvjax.model.params import init_params

    return init_params(shape_of(source), jax.random.key(0), dtype)


def random_tokenizer(source: str):
    """A byte-level tokenizer over the vocabulary of ``random:<shape>`` (module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = shape_of(source)
    vocab = {char: byte for byte, char in enumerate(_byte_chars())}
    vocab |= {f"<|{i}|>": i for i in range(256, cfg.vocab_size)}
    inner = Tokenizer(models.BPE(vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    eos = f"<|{cfg.eos_token_ids[0]}|>" if cfg.eos_token_ids else None
    return PreTrainedTokenizerFast(
        tokenizer_object=inner,
        eos_token=eos,
        pad_token=f"<|{cfg.pad_token_id}|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=cfg.max_seq_len,
    )


def _byte_chars() -> list[str]:
    """The character that byte-level BPE writes for each byte 0-255 (GPT-2's table: printable
    bytes as themselves, the others from U+0100 on)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
