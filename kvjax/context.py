"""Compress once, ask many times: ``kvjax.prefill`` returns a compressed context, ``kvjax.decode`` continues it.

The context is never consumed: every ``decode`` starts from a copy, so one compressed cache can answer
several questions (KVzip's query-agnostic setting). ``kvjax.extend`` continues a context and returns the
longer one as well (a conversation whose turns stay inside the budget).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kvjax.budget_cache import BudgetCache
from kvjax.decoding import Context, DecodeState, Generation, prefill_budget_cache
from kvjax.engine import APPEND, Eviction
from kvjax.inputs import check_context, check_max_new, check_tokens, pad_rows, prompt_bucket, round_capacity
from kvjax.options import eviction_from
from kvjax.paged_cache import PagedCache
from kvjax.params import Params
from kvjax.prefilled import Prefilled
from kvjax.sampling import Sampling
from kvjax.sharding import auto_mesh, check_batch, constrain, on_mesh, shard, to_host


def prefill(params: Params, tokens, *, mesh: Mesh | None = None, **eviction) -> Context:
    """Prefill and compress prompts (1-D or a batch) under a budget. ``eviction``: the keywords of
    ``kvjax.EvictionOptions``, as ``kvjax.generate``; ``budget`` is required. ``mesh``: a device mesh
    (``kvjax.sharding.make_mesh``) to place the params and the context on (the batch must split over its
    ``data`` axis); the context's ``decode`` runs there too."""
    rows, batched = check_tokens(tokens, params.config.vocab_size)
    longest = max(len(r) for r in rows)
    ev = eviction_from(context=longest, **eviction)
    if ev is None:
        raise ValueError("budget=None: prefill builds a compressed context and needs a budget; use "
                         "kvjax.generate (or kvjax.prefill_full) for a full cache")
    check_context(params.config, longest, 0)
    mesh = auto_mesh(mesh)
    check_batch(len(rows), mesh)
    if ev.policy.base_spec.scoring_pass is not None:  # KVzip: a scoring pass over the whole prefilled prompt
        return Prefilled(params, rows if batched else rows[0], mesh=mesh).compress(**eviction)
    padded, lengths = pad_rows(rows, prompt_bucket(longest, ev.block_size), params.config.pad_token_id)
    params = params if mesh is None else shard(params, mesh)
    with on_mesh(mesh):
        state = prefill_budget_cache(params, None, jnp.asarray(padded), jnp.zeros(len(rows), jnp.int32),
                                     jnp.asarray(lengths), jax.random.key(0), ev=ev, out_width=1,
                                     decode_spare=ev.decode_spare(0))
    return Context(cache=state.cache, lengths=lengths, logits=state.logits, ev=ev, batched=batched, mesh=mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "ev", "out_width", "spare"))
def _resume(cfg, cache: BudgetCache | PagedCache, lengths, logits, key, ev: Eviction, out_width: int,
            spare: int) -> DecodeState:
    """A decode state over the context's cache (pass copies: jit may forward inputs that decode donates)."""
    B = lengths.shape[0]
    return constrain(DecodeState(cache=ev.fit(cache, cfg, spare), out=jnp.zeros((B, out_width), jnp.int32),
                                 lengths=lengths, n_new=jnp.zeros(B, jnp.int32), done=jnp.zeros(B, bool),
                                 logits=logits, key=key, step=jnp.zeros((), jnp.int32)))


def decode(params: Params, context: Context, tokens=None, max_new_tokens: int = 64, *, evict: bool = True,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           stop_ids: Sequence[int] | None = None):
    """Continue a context: feed ``tokens`` (e.g. a question; one row per context row, optional) under the
    context's protocol, then generate. Returns new tokens shaped like the prompts given to ``prefill``.

    evict=False appends the tokens and the answer to the compressed context without evicting anything
    (KVzip's and kvpress's query-agnostic setting: only the context is compressed); MomentKV's correction
    still applies. A context compressed by a scorer with a scoring pass of its own (kvzip, kvzip-head) is
    always continued that way: it has no scores for later tokens."""
    max_new = check_max_new(max_new_tokens)
    gen = resume(params, context, tokens, max_new, Sampling(temperature, top_k, top_p), seed, stop_ids, evict)
    out = gen.run(max_new)
    return out if context.batched else out[0]


def extend(params: Params, context: Context, tokens=None, max_new_tokens: int = 64, *, every: int = 8,
           on_tokens: Callable[[list[np.ndarray]], None] | None = None, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, stop_ids: Sequence[int] | None = None) -> tuple[object, Context]:
    """As ``decode`` (evicting), and also return the context that now holds ``tokens`` and the answer, evicted
    under the context's scorer: the next turn of a conversation continues it without prefilling again.
    ``on_tokens`` (optional) receives each row's new tokens every ``every`` decode steps (streaming).

    The context must evict as it decodes, one token at a time (``decode_evict`` on, ``evict_every=1``), so
    that it holds at most the budget between turns; a scorer with a scoring pass of its own (kvzip) cannot
    (it compresses once: ``decode(..., evict=False)``)."""
    ev = context.ev
    if ev.policy.base_spec.scoring_pass is not None:
        raise ValueError(f"scorer={ev.policy.name!r} compresses a context once in a scoring pass of its own and "
                         "cannot evict later turns; a conversation needs a scorer that evicts as it decodes")
    if not ev.decode_evict or ev.evict_every != 1:
        raise ValueError(f"decode_evict={ev.decode_evict!r}, evict_every={ev.evict_every!r}: a context extended "
                         "turn after turn must evict after every decoded token (decode_evict=True, evict_every=1)")
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"every={every!r} must be an integer >= 1")
    max_new = check_max_new(max_new_tokens)
    gen = resume(params, context, tokens, max_new, Sampling(temperature, top_k, top_p), seed, stop_ids)
    pieces: list[list[np.ndarray]] = []
    while not gen.finished and int(to_host(gen.state.n_new).max()) < max_new:
        pieces.append(gen.run(every if on_tokens is not None else max_new))
        if on_tokens is not None:
            on_tokens(pieces[-1])
    out = [np.concatenate([p[i] for p in pieces]).astype(np.int32) if pieces else np.zeros(0, np.int32)
           for i in range(len(context.lengths))]
    state = gen.state
    longer = Context(cache=ev.fit(state.cache, params.config, ev.decode_spare(0)), lengths=to_host(state.lengths),
                     logits=state.logits, ev=ev, batched=context.batched, mesh=context.mesh)
    return (out if context.batched else out[0]), longer


def resume(params: Params, context: Context, tokens, max_new: int, sampling: Sampling, seed: int,
           stop_ids: Sequence[int] | None, evict: bool = True) -> Generation:
    """The ``Generation`` that ``decode`` runs (arguments as there), on the context's mesh."""
    cfg, mesh = params.config, context.mesh
    params = params if mesh is None else shard(params, mesh)
    own_pass = context.ev.policy.base_spec.scoring_pass is not None
    ev = context.ev if evict and not own_pass else context.ev.without_eviction()
    out_width, key = round_capacity(max_new), jax.random.key(seed)
    spare = ev.decode_spare(out_width)
    if tokens is None:
        check_context(cfg, int(context.lengths.max()), max_new, what="context length")
        copies = jax.tree.map(jnp.copy, (context.cache, context.logits))
        with on_mesh(mesh):
            state = _resume(cfg, copies[0], jnp.asarray(context.lengths), copies[1], key, ev=ev,
                            out_width=out_width, spare=spare)
    else:
        rows, _ = check_tokens(tokens if context.batched else [np.asarray(tokens)], cfg.vocab_size)
        if len(rows) != len(context.lengths):
            raise ValueError(f"tokens: {len(rows)} rows for a context of {len(context.lengths)} rows")
        check_context(cfg, int(max(context.lengths + [len(r) for r in rows])), max_new,
                      what="context plus new tokens")
        padded, lengths = pad_rows(rows, prompt_bucket(max(len(r) for r in rows), ev.block_size), cfg.pad_token_id)
        if ev.protocol == APPEND:  # room for the appended tokens too
            spare = ev.extend_spare(padded.shape[1]) + out_width
        with on_mesh(mesh):
            state = prefill_budget_cache(params, context.cache, jnp.asarray(padded), jnp.asarray(context.lengths),
                                         jnp.asarray(lengths), key, ev=ev, out_width=out_width, decode_spare=spare)
    return Generation(params, state, max_new, sampling, stop_ids, ev, mesh)
