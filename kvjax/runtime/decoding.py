"""Decoding: the state the decode loops carry and the one place it starts (``start_state``: after a
jitted prefill, full cache or budget cache under an eviction protocol, or over a context's cache);
the one decode step (``decode_step``: sample, feed, stop), which the serving engine scans over its
slots; and the jitted loop of ``kvjax.generate``, streaming and ``kvjax.decode`` / ``extend``
(``lax.while_loop``, the state donated), which ``Generation`` drives for a batch.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from kvjax.cache.dense import BudgetCache
from kvjax.cache.full import FullCache
from kvjax.cache.paged import PagedCache
from kvjax.cache.slots_view import reset_state
from kvjax.model.decoder import decode_hidden, logits_from_hidden
from kvjax.model.params import Params
from kvjax.model.segment import Segment
from kvjax.runtime.inputs import check_stop_ids, pad_rows, prompt_bucket, round_capacity
from kvjax.runtime.jit import jit
from kvjax.runtime.protocol import Eviction, decode_segment, extend, step
from kvjax.runtime.sampling import Sampling, sample
from kvjax.sharding import constrain, on_mesh, to_host


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries.

    Fields:
        cache: FullCache or BudgetCache.
        out: [B, N] generated ids (pad after ``n_new``).
        lengths: [B] tokens seen per row (the next position).
        n_new: [B] generated so far.
        done: [B].
        logits: [B, V] float32 next-token logits.
        key: PRNG key.
        step: scalar loop counter.
    """

    cache: FullCache | BudgetCache | PagedCache
    out: jax.Array
    lengths: jax.Array
    n_new: jax.Array
    done: jax.Array
    logits: jax.Array
    key: jax.Array
    step: jax.Array

    # What the host reads (the tokens, counts and flags) is replicated: every process of a
    # multi-host run can read it whole.
    AXES = dict(
        out=(None, None),
        lengths=(None,),
        n_new=(None,),
        done=(None,),
        logits=("batch", "vocab"),
        key=(),
        step=(),
    )


def start_state(
    cfg, cache, lengths: jax.Array, logits: jax.Array, key: jax.Array, out_width: int
) -> DecodeState:
    """The state before the first decode step: ``cache`` holding ``lengths`` [B] tokens per row,
    ``logits`` [B, V] float32 after each row's last token, room for ``out_width`` new tokens."""
    B = lengths.shape[0]
    out = jnp.full((B, out_width), cfg.pad_token_id, jnp.int32)
    return constrain(
        DecodeState(
            cache=cache,
            out=out,
            lengths=lengths,
            logits=logits,
            key=key,
            n_new=jnp.zeros(B, jnp.int32),
            done=jnp.zeros(B, bool),
            step=jnp.zeros((), jnp.int32),
        )
    )


@jit(static_argnames=("capacity", "out_width", "impl", "kv_dtype"))
def feed_full(
    params: Params,
    tokens: jax.Array,
    lengths: jax.Array,
    key: jax.Array,
    capacity: int,
    out_width: int,
    impl: str | None = None,
    kv_dtype: str | None = None,
) -> DecodeState:
    """The decode state after feeding prompts tokens [B, P] (right-padded, ``lengths`` [B] valid
    tokens each) into a new full cache of ``capacity`` slots (``impl``, ``kv_dtype``: as
    ``FullCache.init``)."""
    B, P = tokens.shape
    cache = constrain(FullCache.init(params.config, B, capacity, params.dtype, impl, kv_dtype))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    hidden, cache = decode_hidden(
        params, tokens, cache, Segment(positions=positions, from_start=True)
    )
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = logits_from_hidden(params, last)
    return start_state(params.config, cache, lengths, logits, key, out_width)


@jit(static_argnames=("ev", "out_width", "decode_spare"))
def feed_budget(
    params: Params,
    cache: BudgetCache | PagedCache | None,
    tokens: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
    key: jax.Array,
    ev: Eviction,
    out_width: int,
    decode_spare: int,
) -> DecodeState:
    """The decode state after feeding tokens [B, P] at positions ``start`` [B] + t into a budget
    ``cache`` (None = a new one) under the eviction protocol of ``ev``."""
    cfg, spare = params.config, ev.extend_spare(tokens.shape[1])
    if cache is None:  # made to measure: fitting it would gather XLA folds into a constant
        cache = ev.empty_cache(cfg, tokens.shape[0], spare, params.dtype)
    else:
        cache = ev.fit(cache, cfg, spare)
    cache, last = extend(params, constrain(cache), tokens, start, lengths, ev)
    return start_state(
        cfg,
        ev.fit(cache, cfg, decode_spare),
        start + lengths,
        logits_from_hidden(params, last),
        key,
        out_width,
    )


@jit(static_argnames=("cfg", "ev", "out_width", "spare"))
def resume_state(
    cfg,
    cache: BudgetCache | PagedCache,
    lengths: jax.Array,
    logits: jax.Array,
    key: jax.Array,
    ev: Eviction,
    out_width: int,
    spare: int,
) -> DecodeState:
    """A state over a context's cache, fitted to ``spare`` new tokens per head (pass copies: jit may
    forward inputs that decoding donates)."""
    return start_state(cfg, ev.fit(cache, cfg, spare), lengths, logits, key, out_width)


def decode_step(
    params: Params, s, sampling, stop, max_new, ev: Eviction | None, fresh_state: bool = False
):
    """One decode step of every row: a row not done samples its next token (``sample``, the key
    split once per step), feeds it (evicting as ``ev`` says; None: a full cache) and is done after a
    stop id or its token limit.

    Args:
        s: a ``DecodeState`` or the serving engine's ``Slots``: cache, logits [B, V], lengths,
            n_new, done [B], key (one PRNG key, or [B] keys) and step.
        sampling: a ``Sampling`` or per-row settings (as ``sample``).
        stop: stop ids [n], or [B, n] per row (-1: none).
        max_new: the token limit, a scalar or [B].
        fresh_state: the scorer's state is zero as the step begins, and its eviction point
            leaves it for the next step to overwrite (``Segment.fresh_state``; only where
            ``ev.fresh_state`` holds).

    Returns the state after the step and the tokens [B], -1 for rows already done.
    """
    tokens, seg, finish = decode_feed(params, s, sampling, stop, max_new, ev, fresh_state)
    return finish(*step(params, tokens, s.cache, seg))


def decode_feed(
    params: Params, s, sampling, stop, max_new, ev: Eviction | None, fresh_state: bool = False
):
    """The first half of ``decode_step`` (arguments as there), for a forward call that other rows
    may share (the serving engine's prompt chunks): (tokens [B, 1], seg, finish), where
    ``finish(hidden [B, 1, D], cache)`` of the forward call and its eviction returns the state
    after the step and the tokens [B] (-1 for rows already done)."""
    split = jax.random.split(s.key) if s.key.ndim == 0 else jax.vmap(jax.random.split)(s.key)
    active = ~s.done
    tok = jnp.where(active, sample(s.logits, split[..., 1], sampling), params.config.pad_token_id)
    n_new = s.n_new + active
    done = s.done | (tok[:, None] == jnp.asarray(stop, jnp.int32)).any(-1) | (n_new >= max_new)

    def finish(hidden: jax.Array, cache):
        after = s.replace(
            cache=cache,
            logits=logits_from_hidden(params, hidden[:, 0]),
            key=split[..., 0],
            lengths=s.lengths + active,
            n_new=n_new,
            done=done,
            step=s.step + 1,
        )
        return after, jnp.where(active, tok, -1)

    return tok[:, None], decode_segment(ev, s.step, s.lengths, active, fresh_state), finish


@jit(static_argnames=("sampling", "stop_ids", "ev"), donate_argnames=("state",))
def decode_steps(
    params: Params,
    state: DecodeState,
    max_new_tokens: jax.Array,
    stop_step: jax.Array,
    sampling: Sampling,
    stop_ids: tuple[int, ...],
    ev: Eviction | None = None,
) -> DecodeState:
    """``decode_step`` until every row is done (stop id or ``max_new_tokens``) or ``state.step ==
    stop_step``, each row's new tokens written to ``out``."""
    rows = jnp.arange(state.out.shape[0])
    fresh = fresh_state(ev)

    def cond(s: DecodeState):
        return (s.step < stop_step) & ~jnp.all(s.done)

    def body(s: DecodeState):
        after, tok = decode_step(params, s, sampling, stop_ids, max_new_tokens, ev, fresh)
        out = s.out.at[rows, s.n_new].set(jnp.where(tok >= 0, tok, s.out[rows, s.n_new]))
        return constrain(after.replace(out=out))

    state = jax.lax.while_loop(cond, body, state)
    return constrain(zero_state(state) if fresh else state)


def fresh_state(ev: Eviction | None) -> bool:
    """A decoding loop under ``ev`` computes each step's scorer state from its own column
    (``Segment.fresh_state``) and zeroes it once at its end (``zero_state``)."""
    return ev is not None and ev.fresh_state


def zero_state(s):
    """``s`` (a ``DecodeState`` or the serving engine's ``Slots``) with its cache's scorer state
    zeroed (``reset_state``)."""
    return s.replace(cache=s.cache.replace(state=reset_state(s.cache.state)))


class Generation:
    """A batch being decoded: streamed (``run`` in chunks) or whole (one ``run``).

    Args:
        ev: None means a full cache; otherwise the budget cache and eviction engine configured by
            ``ev``.
        mesh: the device mesh the state is placed on (None: one device).
    """

    def __init__(
        self,
        params: Params,
        state: DecodeState,
        max_new_tokens: int,
        sampling: Sampling,
        stop_ids: Sequence[int] | None,
        ev: Eviction | None,
        mesh: Mesh | None = None,
    ):
        self.params, self.state, self.max_new, self.sampling = (
            params,
            state,
            max_new_tokens,
            sampling,
        )
        self.ev = None if ev is None else ev.decoding()
        self.stop_ids = check_stop_ids(
            params.config.eos_token_ids if stop_ids is None else stop_ids, params.config.vocab_size
        )
        self.mesh = mesh

    @classmethod
    def from_prompts(
        cls,
        params: Params,
        rows: list[np.ndarray],
        max_new_tokens: int,
        sampling: Sampling,
        seed: int,
        stop_ids: Sequence[int] | None,
        ev: Eviction | None,
        mesh: Mesh | None = None,
        impl: str | None = None,
        kv_dtype: str | None = None,
    ) -> Generation:
        """Pad validated prompt rows (``kvjax.generate`` checks them and ``max_new_tokens``) to
        their bucket and prefill them (full cache, whose decode attention is ``impl`` and storage
        ``kv_dtype``, or the eviction protocol) on ``mesh``."""
        cfg = params.config
        longest = max(len(r) for r in rows)
        bucket = prompt_bucket(longest, 1 if ev is None else ev.block_size)
        padded, lengths = pad_rows(rows, bucket, cfg.pad_token_id)
        out_width, key = round_capacity(max_new_tokens), jax.random.key(seed)
        with on_mesh(mesh):
            if ev is None:
                state = feed_full(
                    params,
                    jnp.asarray(padded),
                    jnp.asarray(lengths),
                    key,
                    capacity=round_capacity(bucket + max_new_tokens),
                    out_width=out_width,
                    impl=impl,
                    kv_dtype=kv_dtype,
                )
            else:
                state = feed_budget(
                    params,
                    None,
                    jnp.asarray(padded),
                    jnp.zeros(len(rows), jnp.int32),
                    jnp.asarray(lengths),
                    key,
                    ev=ev,
                    out_width=out_width,
                    decode_spare=ev.decode_spare(out_width),
                )
        return cls(params, state, max_new_tokens, sampling, stop_ids, ev, mesh)

    def run(self, steps: int) -> list[np.ndarray]:
        """Decode up to ``steps`` more tokens; returns each row's new tokens since the previous
        call."""
        before = to_host(self.state.n_new)
        stop = int(to_host(self.state.step)) + steps
        with on_mesh(self.mesh):
            self.state = decode_steps(
                self.params,
                self.state,
                jnp.int32(self.max_new),
                jnp.int32(stop),
                self.sampling,
                self.stop_ids,
                self.ev,
            )
        out, n_new = to_host(self.state.out), to_host(self.state.n_new)
        return [out[i, before[i] : n_new[i]] for i in range(len(n_new))]

    @property
    def finished(self) -> bool:
        return bool(np.all(to_host(self.state.done)))
