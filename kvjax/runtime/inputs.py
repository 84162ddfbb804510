"""Token inputs: validation of prompts, lengths and numeric settings, right-padding, and the static
sizes they round to.

Prompts are right-padded to power-of-two buckets and sizes that depend on the request (cache
capacity, output width) are rounded to ``CAPACITY_STEP``, so that requests of similar sizes share
one compilation.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.model.config import ModelConfig

MIN_BUCKET = 32
CAPACITY_STEP = 256


def prompt_bucket(n: int, multiple: int = 1) -> int:
    """Padded prompt length: the next power of two >= n (at least ``MIN_BUCKET``), rounded up to
    ``multiple``."""
    return -(-max(MIN_BUCKET, 1 << (n - 1).bit_length()) // multiple) * multiple


def round_capacity(n: int) -> int:
    """Static lengths that depend on the request are rounded up to ``CAPACITY_STEP`` to share
    compilations."""
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP


def config_of(params) -> ModelConfig:
    """The config of ``params``, which must be kvjax's ``Params`` (``kvjax.load``)."""
    config = getattr(params, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(
            f"params must be kvjax's Params (kvjax.load(...)), got {type(params).__name__}"
        )
    return config


def check_tokens(tokens, vocab_size: int, name: str = "tokens") -> tuple[list[np.ndarray], bool]:
    """Validate and split a 1-D sequence, a 2-D batch or a list of sequences into 1-D int32 arrays.

    Returns the rows and whether the input was a batch.
    """
    text = TypeError(
        f"{name} must be token ids, got text: encode it first (kvjax.chat_tokens(tokenizer, "
        "text), or tokenizer.encode)"
    )
    if isinstance(tokens, str):
        raise text
    if isinstance(tokens, (list, tuple)) and tokens and not np.isscalar(tokens[0]):
        rows, batched = [np.asarray(t) for t in tokens], True
    else:
        arr = np.asarray(tokens)
        if arr.ndim not in (1, 2):
            raise ValueError(
                f"{name} must be 1-D (one sequence) or 2-D [batch, length], got shape {arr.shape}"
            )
        rows, batched = ([arr] if arr.ndim == 1 else list(arr)), arr.ndim == 2
    if not rows:
        raise ValueError(f"{name} is an empty batch")
    for i, row in enumerate(rows):
        if row.dtype.kind in "US":
            raise text
        if row.ndim != 1:
            raise ValueError(f"{name}[{i}] must be 1-D, got shape {row.shape}")
        if row.size == 0:
            raise ValueError(f"{name}[{i}] is empty: a prompt needs at least one token")
        if not np.issubdtype(row.dtype, np.integer):
            raise TypeError(f"{name} must hold integer token ids, got dtype {row.dtype}")
        if row.min() < 0 or row.max() >= vocab_size:
            raise ValueError(
                f"{name}[{i}] holds ids outside [0, {vocab_size}): min {row.min()}, max {row.max()}"
            )
    return [row.astype(np.int32) for row in rows], batched


def pad_rows(rows: list[np.ndarray], width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad 1-D rows to [B, width]; returns the padded ids and the lengths [B]."""
    padded = np.full((len(rows), width), pad, np.int32)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return padded, np.array([len(r) for r in rows], np.int32)


def plain_numbers(settings) -> None:
    """In place, a frozen dataclass's NumPy scalar fields become Python numbers (a budget from
    ``np.arange``, say); a bool in a field declared a number (annotations as strings) is refused."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if field.type.startswith(("int", "float")) and isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{field.name}={value!r} must be a number, not a bool")
        if isinstance(value, np.generic):
            object.__setattr__(settings, field.name, value.item())


def check_stop_ids(stop_ids, vocab_size: int) -> tuple[int, ...]:
    """Stop ids as sorted Python ints, each a token id in [0, vocab_size)."""
    ids = tuple(stop_ids)
    if not all(isinstance(t, (int, np.integer)) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"stop_ids={ids!r} must be token ids in [0, {vocab_size})")
    return tuple(sorted(int(t) for t in ids))


def check_count(value, name: str = "max_new_tokens") -> int:
    """``value`` as a Python int, which must be an integer >= 1 (NumPy's too, not a bool)."""
    if isinstance(value, (bool, np.bool_)) or not (
        isinstance(value, (int, np.integer)) and value >= 1
    ):
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return int(value)


def check_context(cfg, longest: int, max_new_tokens: int, what: str = "prompt length") -> None:
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"tokens: {what} {longest} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"context of {cfg.max_seq_len} tokens"
        )
