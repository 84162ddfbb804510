"""Compress once, ask many times: ``kvjax.prefill`` returns a compressed context, ``kvjax.decode``
continues it.

The context is never consumed: every ``decode`` starts from a copy, so one compressed cache can
answer several questions (KVzip's query-agnostic setting). ``kvjax.extend`` continues a context and
returns the longer one as well (a conversation whose turns stay inside the budget).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kvjax.cache.dense import BudgetCache
from kvjax.cache.paged import PagedCache
from kvjax.model.params import Params
from kvjax.runtime.decoding import Generation, feed_budget, resume_state
from kvjax.runtime.inputs import (
    check_context,
    check_count,
    check_tokens,
    config_of,
    pad_rows,
    prompt_bucket,
    round_capacity,
)
from kvjax.runtime.protocol import APPEND, Eviction
from kvjax.runtime.sampling import Sampling
from kvjax.sharding import on_mesh, shard, to_host


@dataclasses.dataclass(frozen=True)
class Context:
    """A batch of prompts prefilled into a budget cache.

    Fields:
        cache: BudgetCache or PagedCache with room for the budget.
        lengths: [B] tokens seen per row.
        logits: [B, V] next-token logits after each row's last token.
        ev: the eviction settings it was built with.
        mesh: the device mesh its arrays are placed on (None: one device), which decoding it uses
            too.
    """

    cache: BudgetCache | PagedCache
    lengths: np.ndarray
    logits: jax.Array
    ev: Eviction
    batched: bool
    mesh: Mesh | None = None


def compress_by_protocol(
    params: Params, rows: list[np.ndarray], batched: bool, ev: Eviction, mesh: Mesh | None
) -> Context:
    """Validated prompt rows (``check_tokens``; they split over ``mesh``) prefilled into a budget
    cache under ``ev`` by the engine's protocol (scorers without a scoring pass of their own)."""
    padded, lengths = pad_rows(
        rows, prompt_bucket(max(len(r) for r in rows), ev.block_size), params.config.pad_token_id
    )
    params = params if mesh is None else shard(params, mesh)
    with on_mesh(mesh):
        state = feed_budget(
            params,
            None,
            jnp.asarray(padded),
            jnp.zeros(len(rows), jnp.int32),
            jnp.asarray(lengths),
            jax.random.key(0),
            ev=ev,
            out_width=1,
            decode_spare=ev.decode_spare(0),
        )
    return Context(
        cache=state.cache, lengths=lengths, logits=state.logits, ev=ev, batched=batched, mesh=mesh
    )


def decode(
    params: Params,
    context: Context,
    tokens=None,
    max_new_tokens: int = 64,
    *,
    evict: bool = True,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
):
    """Continue a context: feed ``tokens`` (e.g. a question; one row per context row, optional)
    under the context's protocol, then generate. Returns new tokens shaped like the prompts given to
    ``prefill``.

    evict=False appends the tokens and the answer to the compressed context without evicting
    anything (KVzip's and kvpress's query-agnostic setting: only the context is compressed);
    MomentKV's correction still applies. A context compressed by a scorer with a scoring pass of its
    own (kvzip, kvzip-head) is always continued that way: it has no scores for later tokens."""
    max_new = check_count(max_new_tokens)
    sampling = Sampling(temperature, top_k, top_p)
    rows = _new_rows(config_of(params), context, tokens, max_new)
    out = resume(params, context, rows, max_new, sampling, seed, stop_ids, evict).run(max_new)
    return out if context.batched else out[0]


def extend(
    params: Params,
    context: Context,
    tokens=None,
    max_new_tokens: int = 64,
    *,
    every: int = 8,
    on_tokens: Callable[[list[np.ndarray]], None] | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
) -> tuple[object, Context]:
    """As ``decode`` (evicting), and also return the context that now holds ``tokens`` and the
    answer, evicted under the context's scorer: the next turn of a conversation continues it without
    prefilling again. ``on_tokens`` (optional) receives each row's new tokens every ``every`` decode
    steps (streaming).

    The context must evict as it decodes, one token at a time (``decode_evict`` on,
    ``evict_every=1``), so that it holds at most the budget between turns; a scorer with a scoring
    pass of its own (kvzip) cannot (it compresses once: ``decode(..., evict=False)``)."""
    ev = context.ev
    if ev.policy.scorer.scoring_pass is not None:
        raise ValueError(
            f"scorer={ev.policy.name!r} compresses a context once in a scoring pass of its own "
            "and cannot evict later turns; a conversation needs a scorer that evicts as it decodes"
        )
    if not ev.decode_evict or ev.evict_every != 1:
        raise ValueError(
            f"decode_evict={ev.decode_evict!r}, evict_every={ev.evict_every!r}: a context "
            "extended turn after turn must evict after every decoded token (decode_evict=True, "
            "evict_every=1)"
        )
    every = check_count(every, "every")
    max_new = check_count(max_new_tokens)
    sampling = Sampling(temperature, top_k, top_p)
    rows = _new_rows(config_of(params), context, tokens, max_new)
    gen = resume(params, context, rows, max_new, sampling, seed, stop_ids)
    pieces: list[list[np.ndarray]] = []
    while not gen.finished and int(to_host(gen.state.n_new).max()) < max_new:
        pieces.append(gen.run(every if on_tokens is not None else max_new))
        if on_tokens is not None:
            on_tokens(pieces[-1])
    out = [
        np.concatenate([p[i] for p in pieces]).astype(np.int32) if pieces else np.zeros(0, np.int32)
        for i in range(len(context.lengths))
    ]
    state = gen.state
    longer = Context(
        cache=ev.fit(state.cache, params.config, ev.decode_spare(0)),
        lengths=to_host(state.lengths),
        logits=state.logits,
        ev=ev,
        batched=context.batched,
        mesh=context.mesh,
    )
    return (out if context.batched else out[0]), longer


def _new_rows(cfg, context: Context, tokens, max_new: int) -> list[np.ndarray] | None:
    """What ``decode`` / ``extend`` feed a context, validated: ``tokens`` (None, or one row per
    context row, shaped like the prompts given to ``prefill``), which with ``max_new`` new tokens
    must fit the model's context. Returns the rows (None for none)."""
    L, _, Hk = context.cache.pos.shape[:3]
    made = dict(n_layers=L, n_kv_heads=Hk, vocab_size=context.logits.shape[-1])
    if diff := [
        f"{k} {v} (the model's {getattr(cfg, k)})" for k, v in made.items() if v != getattr(cfg, k)
    ]:
        raise ValueError(f"context: made for another model: {', '.join(diff)}")
    if tokens is None:
        check_context(cfg, int(context.lengths.max()), max_new, what="context length")
        return None
    rows, _ = check_tokens(tokens if context.batched else [np.asarray(tokens)], cfg.vocab_size)
    if len(rows) != len(context.lengths):
        raise ValueError(f"tokens: {len(rows)} rows for a context of {len(context.lengths)} rows")
    check_context(
        cfg,
        int(max(context.lengths + [len(r) for r in rows])),
        max_new,
        what="context plus new tokens",
    )
    return rows


def resume(
    params: Params,
    context: Context,
    rows: list[np.ndarray] | None,
    max_new: int,
    sampling: Sampling,
    seed: int,
    stop_ids: Sequence[int] | None,
    evict: bool = True,
) -> Generation:
    """The ``Generation`` that ``decode`` runs over validated ``rows`` (``_new_rows``; the other
    arguments as there), on the context's mesh."""
    cfg, mesh = params.config, context.mesh
    params = params if mesh is None else shard(params, mesh)
    own_pass = context.ev.policy.scorer.scoring_pass is not None
    ev = context.ev if evict and not own_pass else context.ev.without_eviction()
    out_width, key = round_capacity(max_new), jax.random.key(seed)
    spare = ev.decode_spare(out_width)
    if rows is None:
        copies = jax.tree.map(jnp.copy, (context.cache, context.logits))
        with on_mesh(mesh):
            state = resume_state(
                cfg,
                copies[0],
                jnp.asarray(context.lengths),
                copies[1],
                key,
                ev=ev,
                out_width=out_width,
                spare=spare,
            )
    else:
        padded, lengths = pad_rows(
            rows, prompt_bucket(max(len(r) for r in rows), ev.block_size), cfg.pad_token_id
        )
        if ev.protocol == APPEND:  # room for the appended tokens too
            spare = ev.extend_spare(padded.shape[1]) + out_width
        with on_mesh(mesh):
            state = feed_budget(
                params,
                context.cache,
                jnp.asarray(padded),
                jnp.asarray(context.lengths),
                jnp.asarray(lengths),
                key,
                ev=ev,
                out_width=out_width,
                decode_spare=spare,
            )
    return Generation(params, state, max_new, sampling, stop_ids, ev, mesh)
