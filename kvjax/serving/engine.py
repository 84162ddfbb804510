"""The serving engine, in the shape of JetStream's contract: a fixed number of slots, each a row of
one decode state with its own position, token limit, stop ids and sampling settings, and a few
jitted functions over fixed shapes:

- ``generate(params, state) -> (state, tokens)``: ``steps`` decode steps of every slot (the state
  donated), each ``kvjax.runtime.decoding.decode_step`` (as ``kvjax.generate``) by each slot's
  settings;
- prompts are prefilled a chunk at a time in ``prefill_rows`` rows of their own (``Filling``):
  ``fill`` feeds one chunk to each of those rows, and ``mixed`` does that in the same forward
  pass as a decode step of every slot (``kvjax.model.decoder.forward``: one read of the weights
  for both), so that a running slot waits for at most one chunk, never a whole prompt (vLLM's
  chunked prefill); ``promote`` moves a row whose prompt is done into a free slot.

A chunk is the eviction protocol's block (``block_size``): under "blockwise" every chunk ends with
its eviction point, as ``kvjax.generate`` evicts after every block; under "prefill" a row evicts
after its last chunk; the full cache takes chunks of ``prefill_chunk`` tokens. Budget, scorer,
allocation and the other eviction keywords are fixed per engine. Every shape is fixed by the
engine (slots, prompt rows, chunk, the cache), so after ``Engine.warmup`` nothing compiles.
Decoding evicts per row after every token, so each slot's greedy tokens equal ``kvjax.generate``
of its prompt alone.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from kvjax.cache.full import FullCache, cache_bytes
from kvjax.model.decoder import logits_from_hidden
from kvjax.model.params import Params
from kvjax.model.segment import when
from kvjax.runtime.decoding import decode_feed, decode_step, fresh_state, zero_state
from kvjax.runtime.inputs import (
    CAPACITY_STEP,
    check_count,
    check_tokens,
    pad_rows,
    round_capacity,
)
from kvjax.runtime.jit import jit
from kvjax.runtime.options import EvictionOptions, memory_bytes
from kvjax.runtime.protocol import APPEND, Eviction, chunk_segment, step_groups
from kvjax.runtime.sampling import Sampling
from kvjax.sharding import auto_mesh, check_batch, constrain, data_size, on_mesh, shard

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
        tokens: [1, n] int32, the prompt right-padded to a whole number of chunks.
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
    (``AXES``), or -1 for a leaf every row shares (Expected Attention's RoPE frequencies)."""
    fields = {}
    for f in dataclasses.fields(cache):
        value = getattr(cache, f.name)
        if f.metadata.get("pytree_node", True) is False or value is None:
            continue
        if hasattr(type(value), "AXES"):
            fields[f.name] = _cache_batch_axes(value)
            continue
        axes = type(cache).AXES[f.name]
        axis = axes.index("batch") if "batch" in axes else -1
        # quantized: codes and scales alike
        fields[f.name] = jax.tree.map(lambda _, a=axis: a, value)
    return cache.replace(**fields)


def map_rows(fn, cache, *others):
    """``fn(leaf, *leaves of others, axis)`` over every leaf of the cache pytree ``cache`` with a
    "batch" axis (``axis``: its index); a leaf that every row shares stays ``cache``'s."""
    return jax.tree.map(
        lambda x, *rest: x if rest[-1] < 0 else fn(x, *rest),
        cache,
        *others,
        _cache_batch_axes(cache),
    )


def _settings(inputs: Inputs) -> Settings:
    return Settings(
        max_new=inputs.max_new,
        stop=inputs.stop,
        temperature=inputs.temperature,
        top_k=inputs.top_k,
        top_p=inputs.top_p,
    )


@struct.dataclass
class Filling:
    """The prompts being prefilled, a chunk per step, in P rows of their own.

    Fields:
        cache: batch P, the engine's prefill geometry (``Engine.fill_spare``; the full cache: the
            slots' capacity).
        lengths: [P] int32 tokens fed so far (the next position).
    """

    cache: object
    lengths: jax.Array

    AXES = dict(lengths=(None,))


@struct.dataclass
class Chunk:
    """The next chunk of every prompt row, made on the host (``Engine.chunk``).

    Fields:
        tokens: [P, m] int32 (padding past ``n``).
        n: [P] int32 tokens of the chunk (0 for a row with no prompt).
        end: [P] int32 the position after the row's prompt.
        final: [P] bool the row's prompt ends with this chunk.
    """

    tokens: jax.Array
    n: jax.Array
    end: jax.Array
    final: jax.Array


def _rows_where(mask: jax.Array, new, old):
    """The cache pytree of rows ``new`` where mask [B] and ``old`` elsewhere."""

    def pick(a, b, axis):
        shape = [1] * a.ndim
        shape[axis] = -1
        return jnp.where(mask.reshape(shape), a, b)

    return map_rows(pick, new, old)


def _chunk_forward(params: Params, groups: tuple, chunk: Chunk, ev: Eviction | None):
    """``step_groups`` of ``groups`` and a chunk of the filling rows (the last group); under the
    prefill protocol each row whose prompt ends here then evicts. Returns the groups' hidden
    states and caches, and the logits [P, V] after each row's last token of the chunk."""
    hidden, caches = step_groups(params, groups)
    filled = caches[-1]
    if ev is not None and ev.protocol == "prefill":
        seen = groups[-1][2].seen
        evicted = when(jnp.any(chunk.final), lambda c: c.evict(ev.policy, seen), filled)
        filled = _rows_where(chunk.final, evicted, filled)
    last = jnp.take_along_axis(hidden[-1], jnp.maximum(chunk.n - 1, 0)[:, None, None], axis=1)
    return hidden, caches[:-1] + (filled,), logits_from_hidden(params, last[:, 0])


@jit(static_argnames=("ev",), donate_argnames=("filling",))
def fill(
    params: Params, filling: Filling, chunk: Chunk, ev: Eviction | None
) -> tuple[Filling, jax.Array]:
    """One chunk of every prompt row (``ev``: the engine's eviction, None for the full cache).
    Returns the rows and the logits [P, V] after each row's last token so far."""
    m = chunk.tokens.shape[1]
    seg = chunk_segment(ev, filling.lengths, chunk.n, chunk.end, m)
    _, (cache,), logits = _chunk_forward(params, ((chunk.tokens, filling.cache, seg),), chunk, ev)
    return constrain(Filling(cache=cache, lengths=filling.lengths + chunk.n)), logits


@jit(static_argnames=("ev", "decode_ev"), donate_argnames=("state", "filling"))
def mixed(
    params: Params,
    state: Slots,
    filling: Filling,
    chunk: Chunk,
    ev: Eviction | None,
    decode_ev: Eviction | None,
) -> tuple[Slots, Filling, jax.Array, jax.Array]:
    """A decode step of every slot (``decode_step``, each by its settings; ``decode_ev``: the
    engine's decoding eviction) and a chunk of every prompt row (as ``fill``) in one forward pass.
    Returns the state, the rows, each slot's new token [S] (-1 where done) and the rows' logits
    [P, V]."""
    s, fresh = state.settings, fresh_state(decode_ev)
    tokens, seg, finish = decode_feed(params, state, s, s.stop, s.max_new, decode_ev, fresh)
    fill_seg = chunk_segment(ev, filling.lengths, chunk.n, chunk.end, chunk.tokens.shape[1])
    groups = ((tokens, state.cache, seg), (chunk.tokens, filling.cache, fill_seg))
    (hidden, _), (cache, filled), logits = _chunk_forward(params, groups, chunk, ev)
    state, new = finish(hidden, cache)
    filling = Filling(cache=filled, lengths=filling.lengths + chunk.n)
    return constrain(zero_state(state) if fresh else state), constrain(filling), new, logits


@jit(donate_argnames=("filling",))
def begin(filling: Filling, row: jax.Array, cache, start: jax.Array) -> Filling:
    """The rows with row ``row`` (an int32 scalar) replaced by ``cache`` (batch 1, the rows'
    geometry: empty, or a context's) holding ``start`` tokens."""

    def put(full, one, axis):
        return jax.lax.dynamic_update_slice_in_dim(full, one, row, axis)

    cache = map_rows(put, filling.cache, cache)
    return constrain(Filling(cache=cache, lengths=filling.lengths.at[row].set(start)))


@jit(static_argnames=("ev", "cfg", "spare"))
def _fit(cache, ev: Eviction, cfg, spare: int):
    """``ev.fit``: a context's cache in the rows' geometry, or a row in the slots'."""
    return ev.fit(cache, cfg, spare)


@jit(static_argnames=("ev", "cfg", "spare"), donate_argnames=("state",))
def promote(
    filling: Filling,
    row: jax.Array,
    logits: jax.Array,
    state: Slots,
    slot: jax.Array,
    settings: Settings,
    seed: jax.Array,
    ev: Eviction | None,
    cfg,
    spare: int,
) -> Slots:
    """The state with slot ``slot`` holding prompt row ``row`` (int32 scalars): its cache row
    fitted to the slots (``spare`` decode slots per head; the full cache as it is), its next-token
    logits ``logits`` [V], its length, a key from ``seed`` [1] and its ``settings`` (R = 1),
    nothing generated yet."""
    take = lambda full, axis: jax.lax.dynamic_slice_in_dim(full, row, 1, axis)  # noqa: E731
    cache = map_rows(take, filling.cache)
    prefix = Prefix(
        cache=cache if ev is None else ev.fit(cache, cfg, spare),
        logits=logits[None],
        length=jax.lax.dynamic_slice_in_dim(filling.lengths, row, 1),
        key=jax.vmap(jax.random.key)(seed),
        settings=settings,
    )
    return _insert(prefix, state, slot)


def _insert(prefix: Prefix, state: Slots, slot: jax.Array) -> Slots:
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
    cache = map_rows(put, state.cache, prefix.cache)
    return constrain(jax.tree.map(put, rest(state), row).replace(cache=cache, step=state.step))


@jit(static_argnames=("ev", "steps"), donate_argnames=("state",))
def generate(
    params: Params, state: Slots, ev: Eviction | None, steps: int
) -> tuple[Slots, jax.Array]:
    """``steps`` decode steps of every slot (``decode_step``, each slot by its own settings; ``ev``:
    the engine's decoding ``Eviction``, None for the full cache). Returns the state and tokens
    [S, steps] int32: each active slot's new token per step, -1 where the slot was done (free,
    finished by a stop id or its token limit)."""

    fresh = fresh_state(ev)

    def body(s: Slots, _):
        settings = s.settings
        s, tokens = decode_step(params, s, settings, settings.stop, settings.max_new, ev, fresh)
        return constrain(s), tokens

    state, tokens = jax.lax.scan(body, state, None, length=steps)
    return zero_state(state) if fresh else state, tokens.T


class Engine:
    """Slots decoding under one eviction configuration.

    Args:
        params: the model.
        slots: rows decoded together.
        max_prompt: longest prompt accepted.
        max_new_tokens: the largest token limit a request may ask for.
        steps: decode steps per ``generate`` call (while no prompt is being prefilled).
        mesh: a device mesh (slots and prompt rows split over its ``data`` axis, the params placed
            with ``kvjax.shard``).
        prefill_rows: prompts prefilled together, a chunk each per step (None: on an accelerator
            up to 4 under the blockwise protocol, whose prompt rows hold a budget and a chunk, else
            1, whose rows hold a whole prompt; 1 on a CPU; a multiple of the mesh's ``data``
            axis).
        prefill_chunk: the full cache's chunk of prompt tokens (a budget cache's chunk is its
            eviction block, ``block_size``).
        eviction: the keywords of ``kvjax.EvictionOptions`` (budget=None: a full cache of
            ``round_capacity(max_prompt in whole chunks + max_new_tokens)`` slots per row).
        contexts: instead of ``eviction``, the settings contexts were compressed with
            (``kvjax.prefill``): each request then continues a stored context (``Engine.begin``'s
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
        prefill_rows: int | None = None,
        prefill_chunk: int = 128,
        contexts: Eviction | None = None,
        evict: bool = False,
        **eviction,
    ):
        cfg = params.config
        mesh = auto_mesh(mesh)
        slots, steps = check_count(slots, "slots"), check_count(steps, "steps")
        prefill_chunk = check_count(prefill_chunk, "prefill_chunk")
        check_batch(slots, mesh)
        max_new_tokens = check_count(max_new_tokens)
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
            ev = options.resolve(model=params)
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
        # the full cache's (impl, kv_dtype) (``FullCache.init``)
        full = options.full_cache if contexts is None else {}
        self.full = (full.get("impl"), full.get("kv_dtype"))
        if prefill_rows is None:
            # several where a row holds a budget and a chunk and a step is bound by reading the
            # weights (an accelerator); one on a CPU, whose steps are bound by compute, so that
            # idle rows cost it nothing (docs/serving.md: "Long prompts arriving while others
            # decode")
            small = ev is not None and ev.protocol == "blockwise"
            several = small and jax.default_backend() != "cpu"
            prefill_rows = -(-min(slots, 4 if several else 1) // data_size(mesh)) * data_size(mesh)
        if not (isinstance(prefill_rows, int) and 1 <= prefill_rows <= slots):
            raise ValueError(f"prefill_rows={prefill_rows!r} must be an integer in [1, {slots}]")
        check_batch(prefill_rows, mesh)
        self.prefill_rows = prefill_rows
        self.chunk_size = prefill_chunk if ev is None else ev.block_size
        longest = -(-max_prompt // self.chunk_size) * self.chunk_size  # whole chunks
        # The full cache's slots per row (0 for a budget cache).
        self.capacity = round_capacity(longest + max_new_tokens) if ev is None else 0
        # a prompt row's spare slots per head: a chunk, or the whole prompt where eviction waits
        # for its end (the prefill protocol) or never comes (a context's appended question)
        self.fill_spare = 0 if ev is None else ev.extend_spare(longest)
        if contexts is not None and (not evict or ev.protocol == APPEND):
            # room for the longest appended prompt and the answer, not rounded
            self.decode_spare = ev.extend_spare(longest) + max_new_tokens
        else:
            self.decode_spare = 0 if ev is None else ev.decode_spare(round_capacity(max_new_tokens))
        self.contexts, self.evict = contexts, evict
        self._empty_row = None  # a prompt row's empty cache, made at first use

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
        max_new = self.max_new_tokens if max_new_tokens is None else check_count(max_new_tokens)
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
        whole = -(-len(row) // self.chunk_size) * self.chunk_size
        tokens, length = pad_rows([row], whole, cfg.pad_token_id)
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

    @classmethod
    def for_memory(cls, params: Params, kv_memory: int | str, **options) -> Engine:
        """The engine with as many slots as ``kv_memory`` holds: every slot's cache and the
        prompt rows' (``memory``) within it, the slots a multiple of the mesh's ``data`` axis.
        ``kv_memory``: bytes, or a size as ``kvjax serve --kv-memory`` reads it ("60GiB", or
        "0.9" of the free device memory: ``memory_bytes``). ``options``: ``Engine``'s keywords
        but ``slots``. ValueError when not one slot fits."""
        if "slots" in options:
            raise ValueError("slots: an engine sized by kv_memory derives its slot count")
        if isinstance(kv_memory, str):
            kv_memory = memory_bytes(kv_memory)
        if isinstance(kv_memory, bool) or not isinstance(kv_memory, (int, np.integer)):
            raise TypeError(
                f"kv_memory={kv_memory!r} must be bytes (an int) or a size such as '60GiB' or "
                "'0.9' (of the free device memory)"
            )
        step = data_size(auto_mesh(options.get("mesh")))
        probe = cls(params, **(options | dict(slots=4 * step, mesh=None)))
        per_slot, rows = probe.cache_bytes(1), probe.cache_bytes(probe.prefill_rows, prompt=True)
        slots = (kv_memory - rows) // per_slot // step * step
        if slots < step:
            raise ValueError(
                f"kv_memory={kv_memory} bytes holds no slot: one takes {per_slot} and the "
                f"{probe.prefill_rows} prompt rows {rows}"
            )
        return cls(params, slots=int(slots), **options)

    def cache_bytes(self, rows: int, prompt: bool = False) -> int:
        """Bytes of the caches of ``rows`` slots (or, ``prompt``, prompt rows), their positions,
        scorer state and moments included (nothing is allocated)."""
        spare = self.fill_spare if prompt else self.decode_spare
        cfg, dtype = self.params.config, self.params.dtype
        shape = jax.eval_shape(
            lambda: _empty_cache(
                cfg, dtype, rows, self.ev, self.capacity, spare, self.full, not prompt
            )
        )
        return cache_bytes(shape)

    def memory(self) -> dict:
        """What the engine holds: slots, the tokens one keeps (per KV head under a budget, else
        the context), and the bytes of the slots' and the prompt rows' caches."""
        p = None if self.ev is None else self.ev.policy
        return dict(
            slots=self.slots,
            tokens_per_slot=self.capacity if p is None else p.budget,
            per_kv_head=p is not None,
            slot_bytes=self.cache_bytes(1),
            cache_bytes=self.cache_bytes(self.slots),
            prompt_rows=self.prefill_rows,
            prompt_bytes=self.cache_bytes(self.prefill_rows, prompt=True),
        )

    def chunk(self, rows: list) -> Chunk:
        """The next chunk of each prompt row: ``rows`` [P] holds, per row, None or (inputs, fed)
        with ``fed`` the prompt tokens already fed."""
        m, P = self.chunk_size, self.prefill_rows
        tokens = np.full((P, m), self.params.config.pad_token_id, np.int32)
        n, end, final = np.zeros(P, np.int32), np.zeros(P, np.int32), np.zeros(P, bool)
        for i, row in enumerate(rows):
            if row is not None:
                inputs, fed = row
                end[i] = int(inputs.length[0])
                n[i] = min(m, end[i] - fed)
                tokens[i, : n[i]] = inputs.tokens[0, fed : fed + n[i]]
                final[i] = fed + n[i] == end[i]
        return Chunk(tokens=tokens, n=n, end=end, final=final)

    def begin(self, filling: Filling, row: int, context=None) -> Filling:
        """Prompt row ``row`` made ready for a new prompt: empty, or holding ``context`` (a checked
        ``kvjax.Context``, ``check_context``) in an engine of contexts."""
        if (context is None) != (self.contexts is None):
            raise ValueError("context: an engine of contexts needs one; another engine takes none")
        if not 0 <= row < self.prefill_rows:
            raise ValueError(f"row={row!r} must be in [0, {self.prefill_rows})")
        cfg = self.params.config
        with on_mesh(self.mesh):
            if context is not None:
                cache = _fit(context.cache, self.ev, cfg, self.fill_spare)
                start = int(context.lengths[0])
            else:
                if self._empty_row is None:
                    self._empty_row = _empty_cache(
                        cfg,
                        self.params.dtype,
                        1,
                        self.ev,
                        self.capacity,
                        self.fill_spare,
                        self.full,
                    )
                cache, start = self._empty_row, 0
            return begin(filling, np.int32(row), cache, np.int32(start))

    def fill(self, filling: Filling, chunk: Chunk) -> tuple[Filling, jax.Array]:
        with on_mesh(self.mesh):
            return fill(self.params, filling, chunk, ev=self.ev)

    def mixed(
        self, state: Slots, filling: Filling, chunk: Chunk
    ) -> tuple[Slots, Filling, jax.Array, jax.Array]:
        with on_mesh(self.mesh):
            return mixed(self.params, state, filling, chunk, ev=self.ev, decode_ev=self.decode_ev)

    def promote(
        self, filling: Filling, row: int, logits: jax.Array, state: Slots, slot: int, inputs: Inputs
    ) -> Slots:
        """The state with slot ``slot`` decoding prompt row ``row``, whose prompt (``inputs``) is
        done; ``logits`` [P, V]: every row's logits after its last token (``fill``, ``mixed``)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot={slot!r} must be in [0, {self.slots})")
        with on_mesh(self.mesh):
            return promote(
                filling,
                np.int32(row),
                logits[row],
                state,
                np.int32(slot),
                _settings(inputs),
                inputs.seed,
                ev=self.ev,
                cfg=self.params.config,
                spare=self.decode_spare,
            )

    def generate(self, state: Slots) -> tuple[Slots, jax.Array]:
        with on_mesh(self.mesh):
            return generate(self.params, state, ev=self.decode_ev, steps=self.steps)

    def init_state(self) -> tuple[Slots, Filling]:
        """Every slot free (done), its cache empty; and the prompt rows, empty."""
        args = (self.params.config, self.params.dtype)
        with on_mesh(self.mesh):
            state = _init_state(
                *args, self.slots, self.ev, self.capacity, self.decode_spare, self.full
            )
            cache = _empty_cache(
                *args, self.prefill_rows, self.ev, self.capacity, self.fill_spare, self.full
            )
            lengths = jnp.zeros(self.prefill_rows, jnp.int32)
            filling = constrain(Filling(cache=cache, lengths=lengths))
        return state, filling

    def warmup(self) -> None:
        """Compile everything serving runs on a scratch state (the outputs are discarded): a chunk
        alone and with a decode step, promotion, decoding. An engine of contexts compiles the
        fitting of a context into a prompt row at the first context of each geometry."""
        state, filling = self.init_state()
        inputs = self.inputs(np.zeros(1, np.int32), max_new_tokens=1)
        rows = [(inputs, 0)] + [None] * (self.prefill_rows - 1)
        if self.contexts is None:
            filling = self.begin(filling, 0)
        filling, logits = self.fill(filling, self.chunk(rows))
        state = self.promote(filling, 0, logits, state, 0, inputs)
        state, filling, _, logits = self.mixed(state, filling, self.chunk(rows))
        jax.block_until_ready(self.generate(state))


@jit(static_argnames=("cfg", "dtype", "rows", "ev", "capacity", "spare", "full", "decoding"))
def _empty_cache(
    cfg,
    dtype,
    rows: int,
    ev: Eviction | None,
    capacity: int,
    spare: int,
    full: tuple,
    decoding: bool = False,
):
    """An empty cache of ``rows`` rows: the full cache of ``capacity`` slots (ev=None; ``full``:
    its decode attention and kv_dtype), else ``ev``'s budget cache with ``spare`` slots per head,
    with ``decoding`` in the slots' form (``ev.fit``: the scorer's statistics for decoding)."""
    if ev is None:
        return constrain(FullCache.init(cfg, rows, capacity, dtype, *full))
    cache = ev.empty_cache(cfg, rows, spare, dtype)
    return constrain(ev.fit(cache, cfg, spare) if decoding else cache)


@jit(static_argnames=("cfg", "dtype", "slots", "ev", "capacity", "spare", "full"))
def _init_state(
    cfg, dtype, slots: int, ev: Eviction | None, capacity: int, spare: int, full: tuple
) -> Slots:
    cache = _empty_cache(cfg, dtype, slots, ev, capacity, spare, full, decoding=True)
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
