"""Prefill once, compress many ways: the prefill-then-evict protocol evaluated for many scorers and
budgets.

Under the ``prefill`` protocol nothing is evicted until the whole prompt has been attended with the
full cache, so every scorer and budget sees the same keys, values and queries. ``prefill_full`` runs
that full prefill once and keeps every layer's queries; ``Prefilled.compress`` then scores and
evicts exactly as ``kvjax.prefill(..., protocol="prefill")`` does (the same cache ``evict``),
without running the model again. Scoring statistics are cached per kind of scoring queries, so
budgets of one scorer share them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from kvjax.cache.full import FullCache
from kvjax.cache.layout import EvictingCache
from kvjax.eviction import Policy, RepeatPrompt, ScoringData
from kvjax.eviction.allocations import whole_head_count
from kvjax.kernels import PREFILL_CHUNK, attention_with_scores
from kvjax.kernels.quantized import values
from kvjax.model.decoder import decode_hidden, logits_from_hidden
from kvjax.model.params import Params
from kvjax.model.segment import Segment
from kvjax.runtime.context import Context, compress_by_protocol
from kvjax.runtime.decoding import Generation, start_state
from kvjax.runtime.inputs import (
    check_context,
    check_count,
    check_tokens,
    config_of,
    pad_rows,
    prompt_bucket,
    round_capacity,
)
from kvjax.runtime.jit import jit
from kvjax.runtime.kvzip_pass import head_scores, kvzip_scores
from kvjax.runtime.options import EvictionOptions, check_kv_dtype
from kvjax.runtime.protocol import Eviction
from kvjax.runtime.sampling import Sampling
from kvjax.sharding import auto_mesh, check_batch, constrain, on_mesh, shard


@struct.dataclass
class RecordingCache:
    """A full cache that also keeps every layer's queries q: [L, B, P, H, K] (after RoPE); a
    ``kvjax.cache.layout.Cache``."""

    full: FullCache
    q: jax.Array

    AXES = dict(q=("layers", "batch", "positions", "heads", "head_dim"))

    @property
    def kv(self) -> tuple[jax.Array, jax.Array]:
        return self.full.kv

    def attend(self, layer, q, k, v, seg):
        out, full = self.full.attend(layer, q, k, v, seg)
        return out, RecordingCache(full=full, q=self.q.at[layer].set(q.astype(self.q.dtype)))


@jit(static_argnames=("room", "kv_dtype"))
def _full_pass(
    params: Params, tokens: jax.Array, room: int, kv_dtype: str | None
) -> tuple[RecordingCache, jax.Array]:
    cfg = params.config
    B, P = tokens.shape
    cache = constrain(
        RecordingCache(
            full=FullCache.init(cfg, B, P + room, params.dtype, kv_dtype=kv_dtype),
            q=jnp.zeros((cfg.n_layers, B, P, cfg.n_heads, cfg.head_dim), params.dtype),
        )
    )
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    hidden, cache = decode_hidden(
        params, tokens, cache, Segment(positions=positions, from_start=True)
    )
    return cache, hidden


def _scoring_queries(policy: Policy, q: jax.Array, lengths: jax.Array):
    """The scoring queries of one layer and their weights: q [B, P, H, K] -> (q [B, W, H, K],
    positions [B, W], weights [B, W]); the last ``obs_window`` (or the last) positions only, when
    that is all that scores, else every position."""
    B, P = q.shape[:2]
    kind = policy.scorer.queries
    if kind == "all":
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    else:
        W = min(P, 1 if kind == "last" else policy.obs_window)
        positions = lengths[:, None] - W + jnp.arange(W, dtype=jnp.int32)
    index = jnp.maximum(positions, 0)
    weights = policy.query_weights(
        positions, (positions >= 0) & (positions < lengths[:, None]), lengths
    )
    return jnp.take_along_axis(q, index[:, :, None, None], axis=1), index, weights


@jit(static_argnames=("policy",))
def _scoring_state(
    policy: Policy, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array
) -> jax.Array:
    """[L, B, Hk, G, P] state after the prompt's scoring queries (as the prefill protocol
    accumulates it; G = 1 where the policy folds it, ``Policy.state_groups``).

    Args:
        q: [L, B, P, H, K].
        k, v: [L, B, Hk, C, K] with C >= P.
        lengths: [B] prompt tokens per row.
    """
    L, B, P, H, _ = q.shape
    if policy.scorer.queries == "none":
        groups = policy.state_groups(H // k.shape[2])
        return jnp.zeros((L, B, k.shape[2], groups, P), jnp.float32)

    def layer(xs):
        q_l, k_l, v_l = xs
        k_l, v_l = k_l[:, :, :P], v_l[:, :, :P]
        qs, positions, weights = _scoring_queries(policy, q_l, lengths)
        slots = jnp.arange(P)
        col = 0.0
        for start in range(0, qs.shape[1], PREFILL_CHUNK):  # no [P, P] attention matrix at once
            pos = positions[:, start : start + PREFILL_CHUNK]
            mask = (slots[None, None, :] <= pos[:, :, None]) & (slots < lengths[:, None, None])
            col = (
                col
                + attention_with_scores(
                    qs[:, start : start + PREFILL_CHUNK],
                    k_l,
                    v_l,
                    mask[:, None],
                    weights[:, start : start + PREFILL_CHUNK],
                    policy.score_kind,
                )[2]
            )
        col = policy.fold(col)
        zeros = jnp.zeros(col.shape, jnp.float32)
        return policy.scorer.update_state(zeros, col, weights.sum(-1) > 0)

    return jax.lax.map(layer, (q, k, v))


@jit(static_argnames=("cfg", "policy"))
def _scoring_stats(cfg, policy: Policy, q: jax.Array, lengths: jax.Array):
    """The base scorer's own statistics (``Base.observe``) after the prompts' first ``lengths``
    queries q [L, B, P, H, K], or None."""
    L, B, P = q.shape[:3]
    stats = policy.scorer.init_stats(cfg, B)
    if stats is None:
        return None
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    valid = positions < lengths[:, None]
    return jax.lax.fori_loop(
        0, L, lambda i, st: policy.scorer.observe(st, i, q[i], positions, valid, policy), stats
    )


@jit(static_argnames=("cfg", "ev"))
def _compress(
    cfg,
    ev: Eviction,
    k: jax.Array,
    v: jax.Array,
    state: jax.Array,
    stats,
    lengths: jax.Array,
    head_budgets: jax.Array | None,
) -> EvictingCache:
    """Evict every layer once down to the budget (the cache's ``evict``: dense or paged as ``ev``
    says), into a cache fitted for decoding.

    Args:
        k, v: [L, B, Hk, C, K] the full cache.
        state: [L, B, Hk, G, P] the scorer's state, P <= C.
        stats: the base scorer's statistics (``_scoring_stats``).
        lengths: [B] each row's prompt length.
        head_budgets: [L, Hk] int32 each head's budget under the "heads" allocation
            (``whole_heads``).
    """
    C = k.shape[3]
    slots = jnp.arange(C, dtype=jnp.int32)
    pos = jnp.broadcast_to(
        jnp.where(slots < lengths[:, None], slots, -1)[None, :, None], k.shape[:4]
    )
    state = jnp.pad(state, [(0, 0)] * 4 + [(0, C - state.shape[-1])])
    cache = ev.layout.compress(ev.policy, k, v, pos, state, stats, lengths, head_budgets)
    return constrain(ev.fit(cache, cfg, ev.decode_spare(0)))


def whole_heads(policy: Policy, scores: np.ndarray, context: int) -> np.ndarray:
    """kvzip-head's head budgets [L, Hk] int32 for a context of ``context`` tokens: the best heads
    by the saved head scores [L, Hk] keep the whole context, the others their sinks and window, as
    many full heads as the budget pays for (``whole_head_count``)."""
    reduced = policy.n_sink + policy.window
    full = np.argsort(-scores.reshape(-1), kind="stable")[
        : whole_head_count(policy.budget, reduced, context, scores.size)
    ]
    budgets = np.full(scores.size, reduced, np.int32)
    budgets[full] = context
    return budgets.reshape(scores.shape)


class Prefilled:
    """A full-cache prefill of one batch of prompts, kept with every layer's queries.

    ``compress(**eviction)`` returns the ``kvjax.Context`` that ``kvjax.prefill(...,
    protocol="prefill")`` would, optionally for a prefix of each prompt (``upto``: queries and keys
    are causal, so the prefix's are already here). ``generate`` decodes from the full cache itself.
    ``mesh``: the device mesh everything runs on (None: one device). ``kv_dtype``: how the full
    cache stores keys and values, which its compressions keep (``compress`` takes the same).
    """

    def __init__(
        self,
        params: Params,
        rows: list[np.ndarray],
        batched: bool,
        room: int = 256,
        mesh: Mesh | None = None,
        kv_dtype: str | None = None,
    ):
        """The full-cache prefill of ``rows``.

        Args:
            rows: prompt rows already checked (``check_tokens``, ``check_context``), which split
                over ``mesh``.
            batched: whether the caller gave a batch.
            room: slots for decoding.
            kv_dtype: as ``EvictionOptions.kv_dtype``.
        """
        check_kv_dtype(kv_dtype)
        self.kv_dtype = kv_dtype
        self.batched = batched
        padded, self.lengths = pad_rows(
            rows, prompt_bucket(max(len(r) for r in rows)), params.config.pad_token_id
        )
        self.params = params if mesh is None else shard(params, mesh)
        self.rows, self.mesh = rows, mesh
        with on_mesh(mesh):
            self.cache, self.hidden = _full_pass(self.params, jnp.asarray(padded), room, kv_dtype)
        self._states: dict = {}

    def _state(self, policy: Policy, data: ScoringData, lengths: np.ndarray) -> jax.Array:
        """The scorer state [L, B, Hk, G, P] (G = 1 where the policy folds it:
        ``Policy.state_groups``) after the prompts' first ``lengths`` tokens (cached per kind);
        data: what the scorer's own scoring pass reads."""
        spec, full = policy.scorer, self.cache.full
        key = (
            spec.queries,
            policy.score_kind,
            spec.replace,
            policy.obs_window if spec.queries == "window" else 0,
            spec.scoring_pass,
            data.key(),
            tuple(lengths),
            policy.state_form,
        )
        if key in self._states:
            return self._states[key]
        cfg = self.params.config
        if spec.scoring_pass is None:
            k, v = values(full.k), values(full.v)  # as attention read them
            state = _scoring_state(policy, self.cache.q, k, v, jnp.asarray(lengths))
        else:
            if spec.scoring_pass == "kvzip":
                rows = [r[:n] for r, n in zip(self.rows, lengths, strict=True)]
                scores = kvzip_scores(self.params, full, rows, data.repeat_prompt)[
                    ..., : self.hidden.shape[1]
                ]
            else:  # "heads": every token of a head scores its saved head score
                heads = jnp.asarray(data.head_scores, jnp.float32)
                scores = jnp.broadcast_to(
                    heads[:, None, :, None],
                    (cfg.n_layers, len(lengths), cfg.n_kv_heads, self.hidden.shape[1]),
                )
            # each query head's alike, as the state keeps it (``Policy.fold``)
            state = policy.fold(
                jnp.broadcast_to(
                    scores[:, :, :, None], scores.shape[:3] + (cfg.group_size,) + scores.shape[3:]
                )
            )
        self._states[key] = state
        return state

    def compress(self, *, upto=None, **eviction) -> Context:
        """The compressed context of each prompt (or of its first ``upto`` tokens: an int or one per
        row). ``eviction``: the keywords of ``kvjax.EvictionOptions`` (``budget`` required; the
        protocol is "prefill")."""
        if eviction.get("protocol", "prefill") != "prefill":
            raise ValueError(
                f"protocol={eviction['protocol']!r}: compress runs the prefill protocol only"
            )
        lengths = (
            self.lengths if upto is None else np.minimum(self.lengths, np.asarray(upto, np.int32))
        )
        if np.any(lengths < 1):
            raise ValueError(f"upto={upto!r} must keep at least one token of every prompt")
        options = EvictionOptions.of(**(eviction | {"protocol": "prefill"}))
        ev = options.resolve(context=int(lengths.max()), model=self.params)
        if ev is None:
            raise ValueError("budget=None: compress needs a budget")
        if ev.kv_dtype != self.kv_dtype:
            raise ValueError(
                f"kv_dtype={ev.kv_dtype!r}, but this prefill stored keys and values as "
                f"kv_dtype={self.kv_dtype!r} (kvjax.prefill_full(..., kv_dtype=...))"
            )
        return self.compressed(ev, options.scoring_data(self.params.config), lengths)

    def compressed(self, ev: Eviction, data: ScoringData, lengths: np.ndarray) -> Context:
        """The context of the prompts' first ``lengths`` tokens compressed under ``ev`` (resolved
        for a prefill protocol); data: what the scorer's own scoring pass reads."""
        context = int(lengths.max())
        ev = dataclasses.replace(ev, policy=ev.policy.for_context(context))
        head_budgets = None
        if ev.policy.scorer.scoring_pass == "heads":
            head_budgets = whole_heads(ev.policy, data.head_scores, context)
        with on_mesh(self.mesh):
            state = self._state(ev.policy, data, lengths)
            stats = _scoring_stats(
                self.params.config, ev.policy, self.cache.q, jnp.asarray(lengths)
            )
            cache = _compress(
                self.params.config,
                ev,
                self.cache.full.k,
                self.cache.full.v,
                state,
                stats,
                jnp.asarray(lengths),
                head_budgets,
            )
            last = jnp.take_along_axis(
                self.hidden, jnp.asarray(lengths - 1)[:, None, None], axis=1
            )[:, 0]
            logits = logits_from_hidden(self.params, last)
        return Context(
            cache=cache, lengths=lengths, logits=logits, ev=ev, batched=self.batched, mesh=self.mesh
        )

    def kvzip_head_scores(self, prompt: RepeatPrompt) -> np.ndarray:
        """KVzip's head scores S_head [L, Hk] of these prompts (the calibration of ``kvzip-head``:
        each head's largest token score over the prompts; save them with
        ``kvjax.runtime.kvzip_pass.save_head_scores``)."""
        with on_mesh(self.mesh):
            return head_scores(
                kvzip_scores(self.params, self.cache.full, self.rows, prompt), self.lengths
            )

    def generate(self, max_new_tokens: int = 64, *, stop_ids: Sequence[int] | None = None):
        """Greedy continuation of the prompts with the full cache (as ``kvjax.generate`` with no
        budget)."""
        max_new = check_count(max_new_tokens)
        room = self.cache.full.capacity - self.hidden.shape[1]
        if max_new > room:
            raise ValueError(
                f"max_new_tokens={max_new} exceeds the room={room} this prefill kept for decoding"
            )
        check_context(self.params.config, int(self.lengths.max()), max_new)
        last = jnp.take_along_axis(
            self.hidden, jnp.asarray(self.lengths - 1)[:, None, None], axis=1
        )[:, 0]
        # decoding donates its cache; this one is kept
        cache = jax.tree.map(jnp.copy, self.cache.full)
        with on_mesh(self.mesh):
            state = start_state(
                self.params.config,
                cache,
                jnp.asarray(self.lengths),
                logits_from_hidden(self.params, last),
                jax.random.key(0),
                round_capacity(max_new),
            )
        out = Generation(self.params, state, max_new, Sampling(), stop_ids, None, self.mesh).run(
            max_new
        )
        return out if self.batched else out[0]


def prefill_full(
    params: Params,
    tokens,
    room: int = 256,
    *,
    mesh: Mesh | None = None,
    kv_dtype: str | None = None,
) -> Prefilled:
    """Run the full-cache prefill of ``tokens`` (1-D or a batch) once.

    Args:
        room: extra slots for decoding.
        mesh: a device mesh to run on.
        kv_dtype: how the cache stores keys and values (``EvictionOptions.kv_dtype``); its
            compressions keep it.
    """
    rows, batched = check_tokens(tokens, config_of(params).vocab_size)
    return Prefilled(params, rows, batched, room, _placed(params, rows, mesh), kv_dtype)


def prefill(params: Params, tokens, *, mesh: Mesh | None = None, **eviction) -> Context:
    """Prefill and compress prompts (1-D or a batch) under a budget.

    Args:
        eviction: the keywords of ``kvjax.EvictionOptions``, as ``kvjax.generate``; ``budget`` is
            required.
        mesh: a device mesh (``kvjax.sharding.make_mesh``) to place the params and the context on
            (the batch must split over its ``data`` axis); the context's ``decode`` runs there too.
    """
    rows, batched = check_tokens(tokens, config_of(params).vocab_size)
    longest = max(len(r) for r in rows)
    options = EvictionOptions.of(**eviction)
    ev = options.resolve(context=longest, model=params)
    if ev is None:
        raise ValueError(
            "budget=None: prefill builds a compressed context and needs a budget; use "
            "kvjax.generate (or kvjax.prefill_full) for a full cache"
        )
    mesh = _placed(params, rows, mesh)
    return compress_rows(params, rows, batched, ev, options.scoring_data(params.config), mesh)


def _placed(params: Params, rows: list[np.ndarray], mesh: Mesh | None) -> Mesh | None:
    """The mesh prompt ``rows`` run on (``auto_mesh``), once they are checked to fit the model's
    context and to split over it."""
    check_context(params.config, max(len(r) for r in rows), 0)
    mesh = auto_mesh(mesh)
    check_batch(len(rows), mesh)
    return mesh


def compress_rows(
    params: Params,
    rows: list[np.ndarray],
    batched: bool,
    ev: Eviction,
    data: ScoringData,
    mesh: Mesh | None,
) -> Context:
    """``prefill`` of validated prompt rows (``check_tokens``, ``check_context``; they split over
    ``mesh``) under the resolved eviction settings ``ev``; data: what a scoring pass of the scorer's
    own reads (``EvictionOptions.scoring_data``)."""
    # KVzip: a scoring pass over the whole prefilled prompt
    if ev.policy.scorer.scoring_pass is not None:
        prefilled = Prefilled(params, rows, batched, mesh=mesh, kv_dtype=ev.kv_dtype)
        # a scoring pass runs under "prefill"
        return prefilled.compressed(ev, data, prefilled.lengths)
    return compress_by_protocol(params, rows, batched, ev, mesh)
