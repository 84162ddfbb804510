"""Full-cache generation: bucketed jitted prefill and a donated-cache decode loop under ``lax.while_loop``."""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.budget_cache import BudgetCache
from kvjax.cache import FullCache, Segment
from kvjax.engine import Eviction, decode_segment, extend, round_capacity
from kvjax.model import decode_hidden, logits_from_hidden
from kvjax.params import Params
from kvjax.sampling import Sampling, sample
from kvjax.scorers import make_policy

MIN_BUCKET = 32


def prompt_bucket(n: int, multiple: int = 1) -> int:
    """Padded prompt length: the next power of two >= n (at least ``MIN_BUCKET``), rounded up to ``multiple``."""
    return -(-max(MIN_BUCKET, 1 << (n - 1).bit_length()) // multiple) * multiple


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries.

    cache: FullCache or BudgetCache; out: [B, N] generated ids (pad after ``n_new``); lengths: [B] tokens
    seen per row (the next position); n_new: [B] generated so far; done: [B]; logits: [B, V] float32
    next-token logits; key: PRNG key; step: scalar loop counter.
    """

    cache: FullCache | BudgetCache
    out: jax.Array
    lengths: jax.Array
    n_new: jax.Array
    done: jax.Array
    logits: jax.Array
    key: jax.Array
    step: jax.Array


def start_state(params: Params, cache, lengths, last_hidden, key, out_width: int) -> DecodeState:
    B = lengths.shape[0]
    return DecodeState(cache=cache, out=jnp.full((B, out_width), params.config.pad_token_id, jnp.int32),
                       lengths=lengths, n_new=jnp.zeros(B, jnp.int32), done=jnp.zeros(B, bool),
                       logits=logits_from_hidden(params, last_hidden), key=key, step=jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnames=("capacity", "out_width"))
def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, key: jax.Array, capacity: int,
            out_width: int) -> DecodeState:
    """Full cache. tokens: [B, P] right-padded prompts with ``lengths`` [B] valid tokens each."""
    B, P = tokens.shape
    cache = FullCache.init(params.config, B, capacity, params.dtype)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    hidden, cache = decode_hidden(params, tokens, cache, Segment(positions=positions, from_start=True))
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return start_state(params, cache, lengths, last, key, out_width)


@functools.partial(jax.jit, static_argnames=("ev", "out_width", "decode_slots"))
def extend_budget(params: Params, cache: BudgetCache | None, tokens: jax.Array, start: jax.Array,
                  lengths: jax.Array, key: jax.Array, ev: Eviction, out_width: int,
                  decode_slots: int) -> DecodeState:
    """Budget cache: feed tokens [B, P] at ``start`` [B] into ``cache`` (None = empty) under the protocol."""
    slots = ev.extend_slots(tokens.shape[1])
    if cache is None:
        cache = BudgetCache.init(params.config, ev.policy, tokens.shape[0], slots, params.dtype)
    cache, last = extend(params, cache.resize(slots), tokens, start, lengths, ev)
    return start_state(params, cache.resize(decode_slots), start + lengths, last, key, out_width)


@functools.partial(jax.jit, static_argnames=("sampling", "stop_ids", "ev"), donate_argnames=("state",))
def decode(params: Params, state: DecodeState, max_new_tokens: jax.Array, stop_step: jax.Array,
           sampling: Sampling, stop_ids: tuple[int, ...], ev: Eviction | None = None) -> DecodeState:
    """Generate until every row is done (stop id or ``max_new_tokens``) or ``state.step == stop_step``."""
    pad = params.config.pad_token_id
    rows = jnp.arange(state.out.shape[0])

    def cond(s: DecodeState):
        return (s.step < stop_step) & ~jnp.all(s.done)

    def body(s: DecodeState):
        key, sub = jax.random.split(s.key)
        active = ~s.done
        tok = jnp.where(active, sample(s.logits, sub, sampling), pad)
        out = s.out.at[rows, s.n_new].set(jnp.where(active, tok, s.out[rows, s.n_new]))
        n_new = s.n_new + active
        done = s.done | jnp.isin(tok, jnp.asarray(stop_ids, jnp.int32)) | (n_new >= max_new_tokens)
        seg = decode_segment(ev, s.step, s.lengths, active)
        hidden, cache = decode_hidden(params, tok[:, None], s.cache, seg)
        return DecodeState(cache=cache, out=out, lengths=s.lengths + active, n_new=n_new, done=done,
                           logits=logits_from_hidden(params, hidden[:, 0]), key=key, step=s.step + 1)

    return jax.lax.while_loop(cond, body, state)


@jax.jit
def _forward(params: Params, tokens: jax.Array) -> jax.Array:
    B, T = tokens.shape
    cache = FullCache.init(params.config, B, T, params.dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _ = decode_hidden(params, tokens, cache, Segment(positions=positions, from_start=True))
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


def pad_rows(rows: list[np.ndarray], width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad 1-D rows to [B, width]; returns the padded ids and the lengths [B]."""
    padded = np.full((len(rows), width), pad, np.int32)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return padded, np.array([len(r) for r in rows], np.int32)


def check_max_new(max_new_tokens) -> int:
    if not (isinstance(max_new_tokens, (int, np.integer)) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    return int(max_new_tokens)


def check_context(cfg, longest: int, max_new_tokens: int, what: str = "prompt length") -> None:
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"tokens: {what} {longest} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"context of {cfg.max_seq_len} tokens")


class Generation:
    """A batch being decoded: streamed (``run`` in chunks) or whole (one ``run``).

    ev=None means a full cache; otherwise the budget cache and eviction engine configured by ``ev``.
    """

    def __init__(self, params: Params, state: DecodeState, max_new_tokens: int, sampling: Sampling,
                 stop_ids: Sequence[int] | None, ev: Eviction | None):
        self.params, self.state, self.max_new, self.sampling = params, state, max_new_tokens, sampling
        self.ev = None if ev is None else ev.decoding()
        if ev is not None and not ev.decode_evict:  # the cache's static policy joins the shared compilation
            self.state = state.replace(cache=state.cache.replace(policy=self.ev.policy))
        self.stop_ids = tuple(sorted(params.config.eos_token_ids if stop_ids is None else stop_ids))

    @classmethod
    def from_prompts(cls, params: Params, rows: list[np.ndarray], max_new_tokens: int, sampling: Sampling,
                     seed: int, stop_ids: Sequence[int] | None, ev: Eviction | None) -> Generation:
        """Validate lengths, pad to the bucket and prefill (full cache or the eviction protocol)."""
        cfg = params.config
        max_new_tokens = check_max_new(max_new_tokens)
        longest = max(len(r) for r in rows)
        check_context(cfg, longest, max_new_tokens)
        bucket = prompt_bucket(longest, 1 if ev is None else ev.block_size)
        padded, lengths = pad_rows(rows, bucket, cfg.pad_token_id)
        out_width, key = round_capacity(max_new_tokens), jax.random.key(seed)
        if ev is None:
            state = prefill(params, jnp.asarray(padded), jnp.asarray(lengths), key,
                            capacity=round_capacity(bucket + max_new_tokens), out_width=out_width)
        else:
            state = extend_budget(params, None, jnp.asarray(padded), jnp.zeros(len(rows), jnp.int32),
                                  jnp.asarray(lengths), key, ev=ev, out_width=out_width,
                                  decode_slots=ev.decode_slots(out_width))
        return cls(params, state, max_new_tokens, sampling, stop_ids, ev)

    def run(self, steps: int) -> list[np.ndarray]:
        """Decode up to ``steps`` more tokens; returns each row's new tokens since the previous call."""
        before = np.asarray(self.state.n_new)
        stop = int(self.state.step) + steps
        self.state = decode(self.params, self.state, jnp.int32(self.max_new), jnp.int32(stop), self.sampling,
                            self.stop_ids, self.ev)
        out, n_new = np.asarray(self.state.out), np.asarray(self.state.n_new)
        return [out[i, before[i]: n_new[i]] for i in range(len(n_new))]

    @property
    def finished(self) -> bool:
        return bool(np.all(np.asarray(self.state.done)))


def eviction_settings(budget: int | None, scorer: str = "snapkv", protocol: str = "blockwise",
                      block_size: int = 128, evict_every: int = 1, decode_evict: bool = True,
                      **policy) -> Eviction | None:
    """The static ``Eviction`` for the eviction keyword arguments (budget=None: full cache, None)."""
    if budget is None:
        if policy.get("impl") is not None:
            raise ValueError(f"impl={policy['impl']!r} chooses the attention of the budget cache; the full cache "
                             "(budget=None) always runs XLA attention")
        return None
    return Eviction(make_policy(scorer, budget, **policy), protocol=protocol, block_size=block_size,
                    evict_every=evict_every, decode_evict=decode_evict)


def generate(params: Params, tokens, max_new_tokens: int = 64, *, budget: int | None = None,
             scorer: str = "snapkv", protocol: str = "blockwise", block_size: int = 128, n_sink: int = 4,
             window: int | None = None, obs_window: int = 32, pool: str | None = None, kernel: int = 7,
             aggregate: str | None = None, mi_batch: int = 1, evict_every: int = 1, decode_evict: bool = True,
             impl: str | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_ids: Sequence[int] | None = None):
    """New tokens for a prompt (1-D ids -> 1-D array) or a batch (2-D array / list of 1-D -> list of arrays).

    budget=None keeps the full cache. Otherwise every layer keeps at most ``budget`` tokens per KV head,
    chosen by ``scorer`` (``kvjax.scorers.SCORERS``; semantics in docs/eviction.md) under ``protocol``
    ("blockwise": evict after every ``block_size`` prompt tokens; "prefill": prefill in blocks, then evict
    once); decoding evicts every ``evict_every`` tokens unless ``decode_evict`` is False. The ``n_sink``
    first and ``window`` most recent tokens are never evicted (window=None: the scorer's default);
    ``obs_window``, ``pool``, ``kernel`` and ``aggregate`` tune the scorer; ``mi_batch`` > 1 lets MomentKV's
    moment-informed eviction remove that many tokens per statistics update (faster, approximate). ``impl``
    chooses how the budget cache's attention with scores runs (``kvjax.kernels``; None: XLA on CPU, the
    Pallas kernels on TPU and CUDA GPUs; "pallas": the kernels, interpreted on CPU — slow, for checking).
    Generation stops at ``max_new_tokens`` or after a stop id (default: the model's EOS ids), which is
    included in the output. Rows of a batch are right-padded; each row's tokens equal running it alone.
    """
    ev = eviction_settings(budget, scorer, protocol, block_size, evict_every, decode_evict, n_sink=n_sink,
                           window=window, obs_window=obs_window, pool=pool, kernel=kernel, aggregate=aggregate,
                           mi_batch=mi_batch, impl=impl)
    rows, batched = check_tokens(tokens, params.config.vocab_size)
    gen = Generation.from_prompts(params, rows, max_new_tokens, Sampling(temperature, top_k, top_p), seed,
                                  stop_ids, ev)
    out = gen.run(gen.max_new)
    return out if batched else out[0]


def generate_stream(params: Params, tokens, max_new_tokens: int = 64, *, chunk: int = 4, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_ids: Sequence[int] | None = None,
                    budget: int | None = None, **eviction) -> Iterator[list[np.ndarray]]:
    """Like ``generate`` (same eviction keywords) but yields each row's newest tokens every ``chunk`` steps."""
    rows, _ = check_tokens(tokens, params.config.vocab_size)
    gen = Generation.from_prompts(params, rows, max_new_tokens, Sampling(temperature, top_k, top_p), seed,
                                  stop_ids, eviction_settings(budget, **eviction))
    while not gen.finished:
        yield gen.run(chunk)
