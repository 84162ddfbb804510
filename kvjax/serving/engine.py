"""The serving engine, in the shape of JetStream's contract: a fixed number of slots, each a row of
one decode state with its own position, token limit, stop ids and sampling settings, and three
jitted functions:

- ``prefill(params, inputs) -> Prefix``: one prompt, padded to a bucket, prefilled at batch 1 under
  the engine's eviction (``kvjax.runtime.decoding.feed_budget``, as ``kvjax.generate``
  does), or into a full cache of a capacity fixed per engine;
- ``insert(prefix, state, slot) -> state``: the prefix written into row ``slot`` (the state
  donated);
- ``generate(params, state) -> (state, tokens)``: ``steps`` decode steps of every slot (the state
  donated), each ``kvjax.runtime.decoding.decode_step`` (as ``kvjax.generate``) by each slot's
  settings.

Budget, scorer, allocation and the other eviction keywords are fixed per engine. Every shape is
fixed by the engine (slots, buckets up to ``max_prompt``, the cache), so after ``Engine.warmup``
nothing compiles. Decoding evicts per row after every token, so each slot's greedy tokens equal
``kvjax.generate`` of its prompt alone.
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

from kvjax.cache.full import FullCache
from kvjax.model.params import Params
from kvjax.runtime.decoding import decode_step, feed_budget, feed_full
from kvjax.runtime.inputs import (
    CAPACITY_STEP,
    check_max_new,
    check_tokens,
    pad_rows,
    prompt_bucket,
    round_capacity,
)
from kvjax.runtime.jit import jit
from kvjax.runtime.options import EvictionOptions
from kvjax.runtime.protocol import APPEND, Eviction
from kvjax.runtime.sampling import Sampling
from kvjax.sharding import auto_mesh, check_batch, constrain, on_mesh, shard

MAX_STOP_IDS = 8  # stop ids per request (a padded [slots, MAX_STOP_IDS] array)
MAX_SEED = 2**31  # seeds lie in [0, MAX_SEED)


@struct.dataclass
class Settings:
    """What a request asks for, one row per request (R = 1 in a prefix, the slot count in the
    state).

    Fields:
        max_new: [R] int32 token limit.
        stop: [R, MAX_STOP_IDS] int32 stop ids (-1 = none).
        temperature, top_p: [R] float32.
        top_k: [R] int32 (temperature 0 = greedy; top_k 0 and top_p 1 = off).
    """

    max_new: jax.Array
    stop: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    AXES = dict(
        max_new=(None,), stop=(None, None), temperature=(None,), top_k=(None,), top_p=(None,)
    )


@struct.dataclass
class Inputs:
    """One request on the host, validated and padded (``Engine.inputs``).

    Fields:
        tokens: [1, bucket] int32.
        length: [1] int32.
        max_new, stop, temperature, top_k, top_p: its settings as NumPy arrays.
        seed: [1] int32, in place of the key.
    """

    tokens: np.ndarray
    length: np.ndarray
    max_new: np.ndarray
    stop: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray


@struct.dataclass
class Prefix:
    """A prefilled prompt, ready for ``insert``.

    Fields:
        cache: batch 1, the engine's decode layout.
        logits: [1, V] float32 next-token logits.
        length: [1] int32 prompt tokens.
        key: [1] PRNG key (typed, from the request's seed).
        settings: its ``Settings`` (R = 1).
    """

    cache: object
    logits: jax.Array
    length: jax.Array
    key: jax.Array
    settings: Settings


@struct.dataclass
class Slots:
    """The decode state of every slot (S rows).

    Fields:
        cache: the engine's cache with batch S.
        logits: [S, V] float32.
        lengths: [S] tokens seen (the next position).
        n_new: [S] tokens generated.
        done: [S] (a free slot is done).
        key: [S] PRNG keys (typed), each split once per decode step of its slot.
        step: decode steps run.
        settings: ``Settings`` with R = S.
    """

    cache: object
    logits: jax.Array
    lengths: jax.Array
    n_new: jax.Array
    done: jax.Array
    key: jax.Array
    step: jax.Array
    settings: Settings

    AXES = dict(
        logits=("batch", "vocab"),
        lengths=(None,),
        n_new=(None,),
        done=(None,),
        key=(None,),
        step=(),
    )


def _cache_batch_axes(cache):
    """The cache pytree with each array leaf replaced by the index of its "batch" logical axis
    (``AXES``)."""
    fields = {}
    for f in dataclasses.fields(cache):
        value = getattr(cache, f.name)
        if f.metadata.get("pytree_node", True) is False or value is None:
            continue
        fields[f.name] = (
            _cache_batch_axes(value)
            if hasattr(type(value), "AXES")
            else type(cache).AXES[f.name].index("batch")
        )
    return cache.replace(**fields)


def _settings(inputs: Inputs) -> Settings:
    return Settings(
        max_new=inputs.max_new,
        stop=inputs.stop,
        temperature=inputs.temperature,
        top_k=inputs.top_k,
        top_p=inputs.top_p,
    )


@jit(static_argnames=("ev", "capacity", "decode_spare", "impl"))
def prefill(
    params: Params,
    inputs: Inputs,
    ev: Eviction | None,
    capacity: int,
    decode_spare: int,
    context=None,
    start: jax.Array | None = None,
    impl: str | None = None,
) -> Prefix:
    """Prefill one prompt (``inputs.tokens`` [1, bucket]): under ``ev`` into a budget cache with
    ``decode_spare`` spare slots per head, or (ev=None) into a full cache of ``capacity`` slots
    whose decode attention is ``impl``.

    Args:
        context: a compressed context's cache (batch 1) the prompt continues, or None.
        start: [1] int32 the context's length (the prompt's first position).
    """
    key = jax.random.key(0)  # unused: the request's key comes from its seed
    if ev is None:
        state = feed_full(
            params, inputs.tokens, inputs.length, key, capacity=capacity, out_width=1, impl=impl
        )
    else:
        state = feed_budget(
            params,
            context,
            inputs.tokens,
            jnp.zeros(1, jnp.int32) if start is None else start,
            inputs.length,
            key,
            ev=ev,
            out_width=1,
            decode_spare=decode_spare,
        )
    return Prefix(
        cache=state.cache,
        logits=state.logits,
        length=state.lengths,
        key=jax.vmap(jax.random.key)(inputs.seed),
        settings=_settings(inputs),
    )


@jit(donate_argnames=("state",))
def insert(prefix: Prefix, state: Slots, slot: jax.Array) -> Slots:
    """The state with row ``slot`` (an int32 scalar) replaced by the prefix: its cache row along
    each leaf's "batch" axis, its logits, length, key and settings, nothing generated yet."""
    put = lambda full, row, axis=0: (  # noqa: E731
        jax.lax.dynamic_update_slice_in_dim(full, row, slot, axis)
    )
    rest = lambda s: s.replace(cache=None, step=None)  # noqa: E731
    row = Slots(
        cache=None,
        logits=prefix.logits,
        lengths=prefix.length,
        n_new=jnp.zeros(1, jnp.int32),
        done=jnp.zeros(1, bool),
        key=prefix.key,
        step=None,
        settings=prefix.settings,
    )
    cache = jax.tree.map(put, state.cache, prefix.cache, _cache_batch_axes(state.cache))
    return constrain(jax.tree.map(put, rest(state), row).replace(cache=cache, step=state.step))


@jit(static_argnames=("ev", "steps"), donate_argnames=("state",))
def generate(
    params: Params, state: Slots, ev: Eviction | None, steps: int
) -> tuple[Slots, jax.Array]:
    """``steps`` decode steps of every slot (``decode_step``, each slot by its own settings; ``ev``:
    the engine's decoding ``Eviction``, None for the full cache). Returns the state and tokens
    [S, steps] int32: each active slot's new token per step, -1 where the slot was done (free,
    finished by a stop id or its token limit)."""

    def body(s: Slots, _):
        s, tokens = decode_step(params, s, s.settings, s.settings.stop, s.settings.max_new, ev)
        return constrain(s), tokens

    state, tokens = jax.lax.scan(body, state, None, length=steps)
    return state, tokens.T


class Engine:
    """Slots decoding under one eviction configuration.

    Args:
        params: the model.
        slots: rows decoded together.
        max_prompt: longest prompt accepted (prompts are padded to ``prompt_bucket`` buckets up to
            it).
        max_new_tokens: the largest token limit a request may ask for.
        steps: decode steps per ``generate`` call.
        mesh: a device mesh (slots split over its ``data`` axis, the params placed with
            ``kvjax.shard``).
        eviction: the keywords of ``kvjax.EvictionOptions`` (budget=None: a full cache of
            ``round_capacity(largest bucket + max_new_tokens)`` slots per row).
        contexts: instead of ``eviction``, the settings contexts were compressed with
            (``kvjax.prefill``): each request then continues a stored context (``Engine.prefill``'s
            ``context``), its prompt appended without eviction and its answer decoded the same way
            (``kvjax.decode(..., evict=False)``); ``max_prompt`` bounds the appended prompt. Every
            context of the same slot geometry (``Eviction.without_eviction``) fits.
        evict: with ``contexts``, append and decode under the contexts' own eviction instead
            (``kvjax.decode(..., evict=True)``: the question and answer evicted within the budget);
            only contexts made with exactly these settings fit. Not for a scorer with a scoring pass
            of its own (kvzip), whose contexts ``kvjax.decode`` always continues without eviction.
    """

    def __init__(
        self,
        params: Params,
        *,
        slots: int = 8,
        max_prompt: int = 1024,
        max_new_tokens: int = 256,
        steps: int = 1,
        mesh: Mesh | None = None,
        contexts: Eviction | None = None,
        evict: bool = False,
        **eviction,
    ):
        cfg = params.config
        for name, value in (("slots", slots), ("steps", steps)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        mesh = auto_mesh(mesh)
        check_batch(slots, mesh)
        max_new_tokens = check_max_new(max_new_tokens)
        if not (
            isinstance(max_prompt, int) and 1 <= max_prompt <= cfg.max_seq_len - max_new_tokens
        ):
            raise ValueError(
                f"max_prompt={max_prompt!r} must be an integer in "
                f"[1, {cfg.max_seq_len - max_new_tokens}]"
                f" (the model's context of {cfg.max_seq_len} minus max_new_tokens={max_new_tokens})"
            )
        if isinstance(eviction.get("budget"), float):
            raise ValueError(
                f"budget={eviction['budget']!r}: an engine's budget is fixed, give a token count"
            )
        if contexts is not None and eviction:
            raise ValueError(
                f"contexts: an engine of contexts decodes under their settings; "
                f"{', '.join(sorted(eviction))} do not apply"
            )
        if evict and (contexts is None or contexts.policy.scorer.scoring_pass is not None):
            raise ValueError(
                "evict=True: an engine of contexts (contexts=) that evict as they continue; "
                + (
                    "none given"
                    if contexts is None
                    else f"contexts of scorer={contexts.policy.name!r} are compressed once in a "
                    "scoring pass of their own and continue without eviction"
                )
            )
        if contexts is None:
            options = EvictionOptions.of(**eviction)
            ev = options.resolve()
        else:
            # room for whole contexts in a head where one may keep them (kvzip-head, global+kvzip)
            contexts = dataclasses.replace(
                contexts, policy=contexts.policy.for_context(cfg.max_seq_len)
            )
            ev = contexts if evict else contexts.without_eviction()
        if contexts is None and ev is not None and ev.policy.scorer.scoring_pass is not None:
            raise ValueError(
                f"scorer={eviction.get('scorer')!r} scores a whole prompt in a pass of its own; "
                "the serving engine runs the scorers that evict as they prefill"
            )
        if ev is not None and ev.decode_evict and ev.evict_every != 1:
            raise ValueError(
                f"evict_every={ev.evict_every!r}: the serving engine evicts after every decode "
                "step (evict_every=1); slots start at different steps, so a shared schedule would "
                "differ from each request run alone"
            )
        self.params = params if mesh is None else shard(params, mesh)
        self.slots, self.max_prompt, self.max_new_tokens, self.steps, self.mesh = (
            slots,
            max_prompt,
            max_new_tokens,
            steps,
            mesh,
        )
        self.ev, self.decode_ev = ev, None if ev is None else ev.decoding()
        self.full_impl = options.full_cache_impl if contexts is None else None
        block = 1 if ev is None else ev.block_size
        self.bucket = functools.partial(prompt_bucket, multiple=block)
        self.buckets = tuple(sorted({self.bucket(n) for n in _bucket_probes(max_prompt)}))
        # The full cache's slots per row (0 for a budget cache: prefills of one bucket then share a
        # compilation across engines of any max_prompt).
        self.capacity = round_capacity(self.buckets[-1] + max_new_tokens) if ev is None else 0
        if contexts is not None and (not evict or ev.protocol == APPEND):
            # room for the longest appended prompt and the answer, not rounded
            self.decode_spare = ev.extend_spare(self.buckets[-1]) + max_new_tokens
        else:
            self.decode_spare = 0 if ev is None else ev.decode_spare(round_capacity(max_new_tokens))
        self.contexts, self.evict = contexts, evict

    def inputs(
        self,
        tokens,
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: Sequence[int] | None = None,
    ) -> Inputs:
        """A request validated and padded on the host (every error a ValueError naming the
        argument).

        Args:
            max_new_tokens: None = the engine's.
            stop_ids: None = the model's EOS ids, () = none.
        """
        cfg = self.params.config
        rows, batched = check_tokens(tokens, cfg.vocab_size)
        if batched:
            raise ValueError("tokens: the engine takes one prompt (1-D) per request")
        row = rows[0]
        if len(row) > self.max_prompt:
            raise ValueError(
                f"tokens: a prompt of {len(row)} tokens exceeds the engine's "
                f"max_prompt={self.max_prompt}"
            )
        max_new = self.max_new_tokens if max_new_tokens is None else check_max_new(max_new_tokens)
        if max_new > self.max_new_tokens:
            raise ValueError(
                f"max_new_tokens={max_new} must be in [1, {self.max_new_tokens}] "
                "(the engine's limit)"
            )
        Sampling(temperature, top_k, top_p)  # validates them
        if not (isinstance(seed, (int, np.integer)) and 0 <= seed < MAX_SEED):
            raise ValueError(f"seed={seed!r} must be an integer in [0, {MAX_SEED})")
        stops = cfg.eos_token_ids if stop_ids is None else tuple(int(t) for t in stop_ids)
        if len(stops) > MAX_STOP_IDS or any(not 0 <= t < cfg.vocab_size for t in stops):
            raise ValueError(
                f"stop_ids={stops!r}: at most {MAX_STOP_IDS} ids in [0, {cfg.vocab_size})"
            )
        tokens, length = pad_rows([row], self.bucket(len(row)), cfg.pad_token_id)
        return Inputs(
            tokens=tokens,
            length=length,
            max_new=np.array([max_new], np.int32),
            stop=np.array([list(stops) + [-1] * (MAX_STOP_IDS - len(stops))], np.int32),
            temperature=np.array([temperature], np.float32),
            top_k=np.array([top_k], np.int32),
            top_p=np.array([top_p], np.float32),
            seed=np.array([seed], np.int32),
        )

    def check_geometry(self, ev: Eviction) -> None:
        """A ValueError naming the differences unless contexts compressed under ``ev`` continue in
        this engine's slots: the same settings once eviction stops (``Eviction.without_eviction``:
        the budget rounded to ``CAPACITY_STEP``, the allocation's layout, MomentKV's correction),
        or in an evicting engine (``evict=True``) the same settings. A context whose heads may keep
        it whole (``Policy.cap``) fits slots of a cap at least as large."""
        theirs = ev if self.evict else ev.without_eviction()
        if theirs == self.ev:
            return
        flat = lambda e: dataclasses.asdict(e) | dataclasses.asdict(e.policy)  # noqa: E731
        ours, theirs = flat(self.ev), flat(theirs)
        if ours["cap"] is not None and (theirs["cap"] or 0) <= ours["cap"]:
            theirs["cap"] = ours["cap"]
        diff = [k for k in theirs if k != "policy" and theirs[k] != ours[k]]
        if not diff:
            return
        raise ValueError(
            (
                "these eviction settings differ from those of this server's evicting context "
                "slots: "
                if self.evict
                else "these eviction settings make contexts of another slot geometry than this "
                "server's contexts: "
            )
            + ", ".join(f"{k}={theirs[k]!r} (the slots': {ours[k]!r})" for k in diff)
            + (
                f" (budgets compare rounded up to {CAPACITY_STEP})"
                if "budget" in diff and not self.evict
                else ""
            )
        )

    def check_context(self, context, inputs: Inputs) -> None:
        """A ValueError naming the mismatch unless ``inputs`` may continue ``context`` (a
        ``kvjax.Context`` of one row) in this engine's slots: an engine of contexts, a context of
        the same slot geometry, and room in the model's context for the prompt and answer."""
        if self.contexts is None:
            raise ValueError("context: this engine serves whole prompts (made without contexts=)")
        if context is None:
            raise ValueError("context: an engine of contexts continues a stored context; give one")
        if len(context.lengths) != 1:
            raise ValueError(f"context: {len(context.lengths)} rows; a slot holds one")
        self.check_geometry(context.ev)
        total = int(context.lengths[0]) + int(inputs.length[0]) + int(inputs.max_new[0])
        limit = self.params.config.max_seq_len
        if total > limit:
            raise ValueError(
                f"context of {int(context.lengths[0])} tokens plus a prompt of "
                f"{int(inputs.length[0])} and max_new_tokens={int(inputs.max_new[0])} exceed the "
                f"model's context of {limit}"
            )

    def prefill(self, inputs: Inputs, context=None) -> Prefix:
        """The prefix of one request (``inputs``), continuing ``context`` (a checked
        ``kvjax.Context``, ``check_context``) in an engine of contexts."""
        if (context is None) != (self.contexts is None):
            raise ValueError("context: an engine of contexts needs one; another engine takes none")
        with on_mesh(self.mesh):
            return prefill(
                self.params,
                inputs,
                ev=self.ev,
                capacity=self.capacity,
                decode_spare=self.decode_spare,
                context=None if context is None else context.cache,
                start=None if context is None else jnp.asarray(context.lengths, jnp.int32),
                impl=self.full_impl,
            )

    def insert(self, prefix: Prefix, state: Slots, slot: int) -> Slots:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot={slot!r} must be in [0, {self.slots})")
        with on_mesh(self.mesh):
            return insert(prefix, state, np.int32(slot))

    def generate(self, state: Slots) -> tuple[Slots, jax.Array]:
        with on_mesh(self.mesh):
            return generate(self.params, state, ev=self.decode_ev, steps=self.steps)

    def init_state(self) -> Slots:
        """Every slot free (done), its cache empty."""
        with on_mesh(self.mesh):
            return _init_state(
                self.params.config,
                self.params.dtype,
                self.slots,
                self.ev,
                self.capacity,
                self.decode_spare,
                self.full_impl,
            )

    def warmup(self) -> None:
        """Compile everything serving runs: the prefill of every bucket, insert and generate (on a
        scratch state; the outputs are discarded). An engine of contexts compiles its prefills at
        their first use (they depend on the contexts' caches)."""
        state = self.init_state()
        for bucket in self.buckets if self.contexts is None else ():
            n = min(bucket, self.max_prompt)
            state = self.insert(
                self.prefill(self.inputs(np.zeros(n, np.int32), max_new_tokens=1)), state, 0
            )
        jax.block_until_ready(self.generate(state))


def _bucket_probes(max_prompt: int) -> list[int]:
    """Prompt lengths that reach every bucket up to ``max_prompt``: the powers of two below it and
    itself."""
    return [1 << i for i in range(max_prompt.bit_length()) if 1 << i < max_prompt] + [max_prompt]


@jit(static_argnames=("cfg", "dtype", "slots", "ev", "capacity", "spare", "impl"))
def _init_state(
    cfg, dtype, slots: int, ev: Eviction | None, capacity: int, spare: int, impl: str | None
) -> Slots:
    cache = (
        FullCache.init(cfg, slots, capacity, dtype, impl)
        if ev is None
        else ev.empty_cache(cfg, slots, spare, dtype)
    )
    settings = Settings(
        max_new=jnp.zeros(slots, jnp.int32),
        stop=jnp.full((slots, MAX_STOP_IDS), -1, jnp.int32),
        temperature=jnp.zeros(slots, jnp.float32),
        top_k=jnp.zeros(slots, jnp.int32),
        top_p=jnp.ones(slots, jnp.float32),
    )
    keys = jax.vmap(jax.random.key)(jnp.zeros(slots, jnp.int32))
    return constrain(
        Slots(
            cache=cache,
            logits=jnp.zeros((slots, cfg.vocab_size), jnp.float32),
            lengths=jnp.zeros(slots, jnp.int32),
            n_new=jnp.zeros(slots, jnp.int32),
            done=jnp.ones(slots, bool),
            key=keys,
            step=jnp.zeros((), jnp.int32),
            settings=settings,
        )
    )
