"""The attention path both budget caches share (``attend_scored``): a step's attention with
per-slot scores (the cache's kernels over its storage), the modifier's correction of it, the
scorer's state and statistics update, and the eviction inside the layer.

Each cache writes the new tokens into its storage and passes its kernels as two functions over it,
so that kernel dispatch, the correction, the scorer's bookkeeping and the in-layer eviction exist
once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax.model.segment import when

# The leading logical axes of the attention kernels' arguments (q, k, v, slot_pos, query_pos,
# query_weights) and outputs (out, lse, col), for running them per shard.
KV = ("batch", "kv_heads")
ATTENTION_AXES = (("batch", None, "heads"), KV, KV, KV, ("batch",), ("batch",))
ATTENTION_OUT_AXES = (("batch", None, "heads"), ("batch", None, "heads"), KV)

Kernel = Callable[..., tuple[jax.Array, jax.Array, jax.Array | None]]


def scored_attention(
    policy, seg, q: jax.Array, block: Kernel, decode: Kernel, moments, layer_moments, residuals=None
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The output [B, T, H, K] of queries q [B, T, H, K], the scoring queries' per-slot column
    [B, Hk, G, S] (None if none score), the modifier's correction included, and the residual norms
    [B, Hk, S] that ``residuals`` asks a decoding step's kernel for (else None).

    Args:
        policy: the ``kvjax.eviction.Policy``.
        seg: the ``kvjax.cache.Segment``.
        block(weights) -> (out, lse, col): the cache's block kernel over its slots.
        decode(weights, *correction[, residuals=]) -> (out, lse, col[, norms]): its decode
            kernel, corrected by the modifier's arguments (``Modifier.correction``).
        moments: the cache's ``Moments``: the layer's, or every layer's (the carried form's:
            ``kvjax.model.layer_fields``), which the decode kernel reads at its layer in place.
        layer_moments: the layer's (the block kernel's correction reads them).
        residuals: ``Modifier.residuals``' request, or None.
    """
    modifier = policy.modifier_spec
    if q.shape[1] == 1:
        if residuals is None:
            out, _, col = decode(seg.query_weights, *modifier.correction(moments))
            return out, col, None
        out, _, col, norms = decode(
            seg.query_weights, *modifier.correction(moments), residuals=residuals
        )
        return out, col, norms
    out, lse, col = block(seg.query_weights)
    return modifier.correct(out, lse, q, layer_moments), col, None


def fold_scores(
    policy, seg, layer: jax.Array, q: jax.Array, state: jax.Array, stats, col: jax.Array | None
):
    """Layer ``layer``'s scorer state [B, Hk, G, S] and the statistics (stacked over layers) after
    the step (``Base.update_state`` of the column as the state keeps it, ``Policy.fold``;
    ``Base.observe``); under ``seg.fresh_state`` from zeros, the stored state unread (XLA:GPU
    copied each layer's slice out of the stack to add to it)."""
    if col is not None:  # new slots start from zero: empty slots hold a zero state
        before = jnp.zeros_like(state) if seg.fresh_state else state
        has_query = seg.query_weights.sum(-1) > 0
        state = policy.scorer.update_state(before, policy.fold(col), has_query)
    return state, policy.scorer.observe(stats, layer, q, seg.positions, seg.valid, policy)


def attend_scored(
    cache,
    layer: jax.Array,
    q: jax.Array,
    seg,
    decode,
    block: Kernel,
    evict_layer,
    residuals=None,
):
    """The rest of layer ``layer``'s step once ``cache`` (its ``LAYER_FIELDS`` the layer's, or,
    for its moments, every layer's; its statistics stacked) holds the new tokens: the output
    [B, T, H, K] of queries q and the cache with the scorer's state and statistics folded in,
    evicted here when ``seg.evict_in_layer`` says so (then, under ``seg.attend_kept``, the output
    is the attention over the tokens it keeps).

    Args:
        decode(c) -> Kernel: the cache's decode kernel over the storage of cache ``c``.
        block: its block kernel over ``cache``'s storage.
        evict_layer(c, norms, moments): the cache ``c``, its statistics this layer's, after this
            layer's eviction point (which adds to layer ``layer``'s moments); norms: what the
            decode kernel gave for ``residuals``, or None; moments: the layer's, as the eviction
            reads them.
        residuals: the modifier's request for residual norms (``Modifier.residuals``) when this
            layer's eviction point reads them, or None.
    """
    p = seg.policy
    moments = cache.moments.at(layer)
    out, col, norms = scored_attention(
        p, seg, q, block, decode(cache), cache.moments, moments, residuals
    )
    state, stats = fold_scores(p, seg, layer, q, cache.state, cache.stats, col)
    cache = cache.replace(state=state, stats=stats)

    def evict_here(c):  # the eviction reads this layer's statistics
        one_layer = c.replace(stats=jax.tree.map(lambda x: x[layer], c.stats))
        return evict_layer(one_layer, norms, moments).replace(stats=c.stats)

    if seg.evict_in_layer and seg.attend_kept:

        def evict_first(args):
            c = evict_here(args[0])
            return c, kept_attention(p, decode(c), c.moments)

        cache, out = when(seg.evict, evict_first, (cache, out))
    elif seg.evict_in_layer:
        cache = when(seg.evict, evict_here, cache)
    return out, cache


def kept_attention(policy, decode: Kernel, moments) -> jax.Array:
    """Decoding under ``decode_order="evict-first"``: the output over the tokens a layer kept, from
    the cache's decode kernel after its eviction (no scores)."""
    return decode(None, *policy.modifier_spec.correction(moments))[0]
