"""Full-cache generation: bucketed jitted prefill and a donated-cache decode loop under ``lax.while_loop``."""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.cache import FullCache
from kvjax.model import decode_hidden, logits_from_hidden
from kvjax.params import Params
from kvjax.sampling import Sampling, sample

MIN_BUCKET = 32
CAPACITY_STEP = 256


def prompt_bucket(n: int) -> int:
    """Padded prompt length: the next power of two >= n (at least ``MIN_BUCKET``)."""
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def cache_capacity(bucket: int, max_new_tokens: int) -> int:
    """Static cache length: prompt bucket + new tokens, rounded up to ``CAPACITY_STEP``."""
    return -(-(bucket + max_new_tokens) // CAPACITY_STEP) * CAPACITY_STEP


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries.

    cache: FullCache [L, B, Hk, C, K]; tokens: [B, C] prompt and generated ids (pad after ``lengths``);
    lengths: [B] tokens held per row; n_new: [B] generated so far; done: [B]; logits: [B, V] float32
    next-token logits; key: PRNG key; step: scalar loop counter.
    """

    cache: FullCache
    tokens: jax.Array
    lengths: jax.Array
    n_new: jax.Array
    done: jax.Array
    logits: jax.Array
    key: jax.Array
    step: jax.Array


@functools.partial(jax.jit, static_argnames=("capacity",))
def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, key: jax.Array, capacity: int) -> DecodeState:
    """tokens: [B, P] right-padded prompts with ``lengths`` [B] valid tokens each."""
    cfg = params.config
    B, P = tokens.shape
    cache = FullCache.init(cfg, B, capacity, params.dtype)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    hidden, cache = decode_hidden(params, tokens, positions, cache)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    buffer = jnp.full((B, capacity), cfg.pad_token_id, jnp.int32).at[:, :P].set(tokens)
    return DecodeState(cache=cache, tokens=buffer, lengths=lengths, n_new=jnp.zeros(B, jnp.int32),
                       done=jnp.zeros(B, bool), logits=logits_from_hidden(params, last), key=key,
                       step=jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnames=("sampling", "stop_ids"), donate_argnames=("state",))
def decode(params: Params, state: DecodeState, max_new_tokens: jax.Array, stop_step: jax.Array,
           sampling: Sampling, stop_ids: tuple[int, ...]) -> DecodeState:
    """Generate until every row is done (stop id or ``max_new_tokens``) or ``state.step == stop_step``."""
    pad = params.config.pad_token_id
    rows = jnp.arange(state.tokens.shape[0])

    def cond(s: DecodeState):
        return (s.step < stop_step) & ~jnp.all(s.done)

    def body(s: DecodeState):
        key, sub = jax.random.split(s.key)
        tok = jnp.where(s.done, pad, sample(s.logits, sub, sampling))
        active = ~s.done
        tokens = s.tokens.at[rows, s.lengths].set(jnp.where(active, tok, s.tokens[rows, s.lengths]))
        n_new = s.n_new + active
        done = s.done | jnp.isin(tok, jnp.asarray(stop_ids, jnp.int32)) | (n_new >= max_new_tokens)
        hidden, cache = decode_hidden(params, tok[:, None], s.lengths[:, None], s.cache)
        return DecodeState(cache=cache, tokens=tokens, lengths=s.lengths + active, n_new=n_new, done=done,
                           logits=logits_from_hidden(params, hidden[:, 0]), key=key, step=s.step + 1)

    return jax.lax.while_loop(cond, body, state)


@jax.jit
def _forward(params: Params, tokens: jax.Array) -> jax.Array:
    B, T = tokens.shape
    cache = FullCache.init(params.config, B, T, params.dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _ = decode_hidden(params, tokens, positions, cache)
    return logits_from_hidden(params, hidden)


def check_tokens(tokens, vocab_size: int, name: str = "tokens") -> tuple[list[np.ndarray], bool]:
    """Validate and split a 1-D sequence, a 2-D batch or a list of sequences into 1-D int32 arrays.

    Returns the rows and whether the input was a batch.
    """
    if isinstance(tokens, (list, tuple)) and tokens and not np.isscalar(tokens[0]):
        rows, batched = [np.asarray(t) for t in tokens], True
    else:
        arr = np.asarray(tokens)
        if arr.ndim not in (1, 2):
            raise ValueError(f"{name} must be 1-D (one sequence) or 2-D [batch, length], got shape {arr.shape}")
        rows, batched = ([arr] if arr.ndim == 1 else list(arr)), arr.ndim == 2
    if not rows:
        raise ValueError(f"{name} is an empty batch")
    for i, row in enumerate(rows):
        if row.ndim != 1:
            raise ValueError(f"{name}[{i}] must be 1-D, got shape {row.shape}")
        if row.size == 0:
            raise ValueError(f"{name}[{i}] is empty: a prompt needs at least one token")
        if not np.issubdtype(row.dtype, np.integer):
            raise TypeError(f"{name} must hold integer token ids, got dtype {row.dtype}")
        if row.min() < 0 or row.max() >= vocab_size:
            raise ValueError(f"{name}[{i}] holds ids outside [0, {vocab_size}): min {row.min()}, max {row.max()}")
    return [row.astype(np.int32) for row in rows], batched


def forward(params: Params, tokens) -> jax.Array:
    """Logits [B, T, V] (float32) of a full causal pass over tokens [B, T] (or [T], read as B=1)."""
    rows, _ = check_tokens(tokens, params.config.vocab_size)
    if len({len(r) for r in rows}) != 1:
        raise ValueError("tokens: forward needs rows of equal length")
    return _forward(params, jnp.asarray(np.stack(rows)))


class Generation:
    """Prepared generation of a batch: validation, padding and buckets, then streamed or whole decoding."""

    def __init__(self, params: Params, tokens, max_new_tokens: int, sampling: Sampling, seed: int,
                 stop_ids: Sequence[int] | None):
        cfg = params.config
        self.rows, self.batched = check_tokens(tokens, cfg.vocab_size)
        if not (isinstance(max_new_tokens, (int, np.integer)) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        longest = max(len(r) for r in self.rows)
        if longest + max_new_tokens > cfg.max_seq_len:
            raise ValueError(f"tokens: prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the "
                             f"model's context of {cfg.max_seq_len} tokens")
        self.params, self.max_new, self.sampling = params, int(max_new_tokens), sampling
        self.stop_ids = tuple(sorted(cfg.eos_token_ids if stop_ids is None else stop_ids))
        bucket = prompt_bucket(longest)
        padded = np.full((len(self.rows), bucket), cfg.pad_token_id, np.int32)
        for i, r in enumerate(self.rows):
            padded[i, : len(r)] = r
        self.prompt_lengths = np.array([len(r) for r in self.rows], np.int32)
        self.state = prefill(params, jnp.asarray(padded), jnp.asarray(self.prompt_lengths),
                             jax.random.key(seed), capacity=cache_capacity(bucket, self.max_new))

    def run(self, steps: int) -> list[np.ndarray]:
        """Decode up to ``steps`` more tokens; returns each row's new tokens since the previous call."""
        before = np.asarray(self.state.n_new)
        stop = int(self.state.step) + steps
        self.state = decode(self.params, self.state, jnp.int32(self.max_new), jnp.int32(stop), self.sampling,
                            self.stop_ids)
        tokens, n_new = np.asarray(self.state.tokens), np.asarray(self.state.n_new)
        start = self.prompt_lengths + before
        return [tokens[i, start[i]: self.prompt_lengths[i] + n_new[i]] for i in range(len(self.rows))]

    @property
    def finished(self) -> bool:
        return bool(np.all(np.asarray(self.state.done)))


def generate(params: Params, tokens, max_new_tokens: int = 64, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop_ids: Sequence[int] | None = None):
    """New tokens for a prompt (1-D ids -> 1-D array) or a batch (2-D array / list of 1-D -> list of arrays).

    Generation stops at ``max_new_tokens`` or after a stop id (default: the model's EOS ids), which is
    included in the output. Rows of a batch are right-padded; each row's tokens equal running it alone.
    """
    gen = Generation(params, tokens, max_new_tokens, Sampling(temperature, top_k, top_p), seed, stop_ids)
    out = gen.run(gen.max_new)
    return out if gen.batched else out[0]


def generate_stream(params: Params, tokens, max_new_tokens: int = 64, *, chunk: int = 4, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                    stop_ids: Sequence[int] | None = None) -> Iterator[list[np.ndarray]]:
    """Like ``generate`` but yields each row's newest tokens every ``chunk`` decode steps."""
    gen = Generation(params, tokens, max_new_tokens, Sampling(temperature, top_k, top_p), seed, stop_ids)
    while not gen.finished:
        yield gen.run(chunk)
