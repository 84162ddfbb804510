"""Decoding: the state the decode loop carries, the jitted prefills that start it (full cache or budget cache
under an eviction protocol) and the jitted loop itself (``lax.while_loop``, the state donated); ``Generation``
drives them for a batch, streamed or whole.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from kvjax.budget_cache import BudgetCache
from kvjax.cache import FullCache, Segment
from kvjax.engine import Eviction, decode_segment, extend, step
from kvjax.inputs import check_context, check_max_new, pad_rows, prompt_bucket, round_capacity
from kvjax.model import decode_hidden, logits_from_hidden
from kvjax.paged_cache import PagedCache
from kvjax.params import Params
from kvjax.sampling import Sampling, sample
from kvjax.sharding import check_batch, constrain, on_mesh, to_host


@dataclasses.dataclass(frozen=True)
class Context:
    """A batch of prompts prefilled into a budget cache.

    cache: BudgetCache or PagedCache with room for the budget; lengths: [B] tokens seen per row; logits: [B, V]
    next-token logits after each row's last token; ev: the eviction settings it was built with; mesh: the
    device mesh its arrays are placed on (None: one device), which decoding it uses too.
    """

    cache: BudgetCache | PagedCache
    lengths: np.ndarray
    logits: jax.Array
    ev: Eviction
    batched: bool
    mesh: Mesh | None = None


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries.

    cache: FullCache or BudgetCache; out: [B, N] generated ids (pad after ``n_new``); lengths: [B] tokens
    seen per row (the next position); n_new: [B] generated so far; done: [B]; logits: [B, V] float32
    next-token logits; key: PRNG key; step: scalar loop counter.
    """

    cache: FullCache | BudgetCache | PagedCache
    out: jax.Array
    lengths: jax.Array
    n_new: jax.Array
    done: jax.Array
    logits: jax.Array
    key: jax.Array
    step: jax.Array

    # What the host reads (the tokens, counts and flags) is replicated: every process of a multi-host run can
    # read it whole.
    AXES = dict(out=(None, None), lengths=(None,), n_new=(None,), done=(None,), logits=("batch", "vocab"), key=(),
                step=())


def start_state(params: Params, cache, lengths, last_hidden, key, out_width: int) -> DecodeState:
    B = lengths.shape[0]
    return constrain(DecodeState(cache=cache, out=jnp.full((B, out_width), params.config.pad_token_id, jnp.int32),
                                 lengths=lengths, n_new=jnp.zeros(B, jnp.int32), done=jnp.zeros(B, bool),
                                 logits=logits_from_hidden(params, last_hidden), key=key,
                                 step=jnp.zeros((), jnp.int32)))


@functools.partial(jax.jit, static_argnames=("capacity", "out_width"))
def prefill_full_cache(params: Params, tokens: jax.Array, lengths: jax.Array, key: jax.Array, capacity: int,
            out_width: int) -> DecodeState:
    """Full cache. tokens: [B, P] right-padded prompts with ``lengths`` [B] valid tokens each."""
    B, P = tokens.shape
    cache = constrain(FullCache.init(params.config, B, capacity, params.dtype))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    hidden, cache = decode_hidden(params, tokens, cache, Segment(positions=positions, from_start=True))
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return start_state(params, cache, lengths, last, key, out_width)


@functools.partial(jax.jit, static_argnames=("ev", "out_width", "decode_spare"))
def prefill_budget_cache(params: Params, cache: BudgetCache | PagedCache | None, tokens: jax.Array,
                         start: jax.Array, lengths: jax.Array, key: jax.Array, ev: Eviction, out_width: int,
                         decode_spare: int) -> DecodeState:
    """Budget cache: feed tokens [B, P] at ``start`` [B] into ``cache`` (None = empty) under the protocol."""
    cfg, spare = params.config, ev.extend_spare(tokens.shape[1])
    if cache is None:
        cache = ev.empty_cache(cfg, tokens.shape[0], spare, params.dtype)
    cache, last = extend(params, constrain(ev.fit(cache, cfg, spare)), tokens, start, lengths, ev)
    return start_state(params, ev.fit(cache, cfg, decode_spare), start + lengths, last, key, out_width)


@functools.partial(jax.jit, static_argnames=("sampling", "stop_ids", "ev"), donate_argnames=("state",))
def decode_steps(params: Params, state: DecodeState, max_new_tokens: jax.Array, stop_step: jax.Array,
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
        hidden, cache = step(params, tok[:, None], s.cache, seg)
        return constrain(DecodeState(cache=cache, out=out, lengths=s.lengths + active, n_new=n_new, done=done,
                                     logits=logits_from_hidden(params, hidden[:, 0]), key=key, step=s.step + 1))

    return constrain(jax.lax.while_loop(cond, body, state))


class Generation:
    """A batch being decoded: streamed (``run`` in chunks) or whole (one ``run``).

    ev=None means a full cache; otherwise the budget cache and eviction engine configured by ``ev``; mesh: the
    device mesh the state is placed on (None: one device).
    """

    def __init__(self, params: Params, state: DecodeState, max_new_tokens: int, sampling: Sampling,
                 stop_ids: Sequence[int] | None, ev: Eviction | None, mesh: Mesh | None = None):
        self.params, self.state, self.max_new, self.sampling = params, state, max_new_tokens, sampling
        self.ev = None if ev is None else ev.decoding()
        self.stop_ids = tuple(sorted(params.config.eos_token_ids if stop_ids is None else stop_ids))
        self.mesh = mesh

    @classmethod
    def from_prompts(cls, params: Params, rows: list[np.ndarray], max_new_tokens: int, sampling: Sampling,
                     seed: int, stop_ids: Sequence[int] | None, ev: Eviction | None,
                     mesh: Mesh | None = None) -> Generation:
        """Validate lengths, pad to the bucket and prefill (full cache or the eviction protocol) on ``mesh``."""
        check_batch(len(rows), mesh)
        cfg = params.config
        max_new_tokens = check_max_new(max_new_tokens)
        longest = max(len(r) for r in rows)
        check_context(cfg, longest, max_new_tokens)
        bucket = prompt_bucket(longest, 1 if ev is None else ev.block_size)
        padded, lengths = pad_rows(rows, bucket, cfg.pad_token_id)
        out_width, key = round_capacity(max_new_tokens), jax.random.key(seed)
        with on_mesh(mesh):
            if ev is None:
                state = prefill_full_cache(params, jnp.asarray(padded), jnp.asarray(lengths), key,
                                           capacity=round_capacity(bucket + max_new_tokens), out_width=out_width)
            else:
                state = prefill_budget_cache(params, None, jnp.asarray(padded), jnp.zeros(len(rows), jnp.int32),
                                             jnp.asarray(lengths), key, ev=ev, out_width=out_width,
                                             decode_spare=ev.decode_spare(out_width))
        return cls(params, state, max_new_tokens, sampling, stop_ids, ev, mesh)

    def run(self, steps: int) -> list[np.ndarray]:
        """Decode up to ``steps`` more tokens; returns each row's new tokens since the previous call."""
        before = to_host(self.state.n_new)
        stop = int(to_host(self.state.step)) + steps
        with on_mesh(self.mesh):
            self.state = decode_steps(self.params, self.state, jnp.int32(self.max_new), jnp.int32(stop),
                                      self.sampling, self.stop_ids, self.ev)
        out, n_new = to_host(self.state.out), to_host(self.state.n_new)
        return [out[i, before[i]: n_new[i]] for i in range(len(n_new))]

    @property
    def finished(self) -> bool:
        return bool(np.all(to_host(self.state.done)))
