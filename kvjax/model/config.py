"""Model configuration: one frozen, hashable dataclass used as a static jit argument."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama / Qwen2 / Qwen3 decoder.

    ``rope_scaling`` is a sorted tuple of ``(key, value)`` pairs (hashable) holding the
    Hugging Face ``rope_parameters`` other than ``rope_type`` and ``rope_theta``.
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"arch={self.arch!r} is not supported; expected one of {ARCHITECTURES}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported; expected one of {ROPE_TYPES}"
            )
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
            "max_seq_len",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (G)."""
        return self.n_heads // self.n_kv_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        raw = json.loads(text)
        raw["rope_scaling"] = tuple((k, v) for k, v in raw.get("rope_scaling", ()))
        raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := set(raw) - known:
            raise ValueError(f"unknown config fields {sorted(unknown)}")
        return cls(**raw)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` dict (transformers 4 or 5 layout)."""
        arch = hf.get("model_type")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"config.json model_type={arch!r} is not supported; expected one of {ARCHITECTURES}"
            )
        for flag in ("use_sliding_window", "mlp_bias") + (
            () if arch == "qwen2" else ("attention_bias",)
        ):
            if hf.get(flag):
                raise ValueError(
                    f"config.json {flag}=True is not supported for model_type={arch!r}"
                )
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        n_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        pad = hf.get("pad_token_id")
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            d_ff=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_type=rope_type,
            rope_scaling=tuple(sorted(rope.items())),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=pad if pad is not None else (eos[0] if eos else 0),
        )
