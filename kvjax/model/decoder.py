"""The decoder as plain functions: embed, a ``lax.scan`` over stacked layers (or a loop over
unstacked ones), final norm and logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model.layer_fields import carried_back, carried_view, join_layers, split_layers
from kvjax.model.params import LayerParams, Params, split_qkv
from kvjax.model.rope import apply_rope, inverse_frequencies
from kvjax.model.segment import Segment


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and returned in x's dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * normed.astype(x.dtype)


def decoder_layer(
    cfg, xs: tuple, p: LayerParams, layer: jax.Array, caches: tuple, segs: tuple, inv_freq
) -> tuple[tuple, tuple]:
    """One pre-norm block over groups of rows that share its weights: a serving step's decode rows
    and prompt chunks (``forward``). The projections and the MLP run once over every group's tokens
    (one read of the weights); each group attends over its own cache.

    Args:
        xs: per group [B, T, D].
        p: the layer's parameter slice.
        caches: per group; its keys and values hold every layer, its ``LAYER_FIELDS`` this layer's
            slice; ``cache.attend(layer, ...)`` reads and updates layer ``layer``.
        segs: per group, its ``Segment``.

    Returns the groups' outputs [B, T, D] and caches.
    """
    x = _joined(xs)  # one group: [B, T, D] itself; several: their tokens as [N, D]
    h = rms_norm(x, p.attn_norm, cfg.norm_eps)
    qkv = jnp.einsum("...d,dngk->...ngk", h, p.wqkv)
    qkv = qkv + p.bqkv if cfg.qkv_bias else qkv
    attn, out_caches = [], []
    for part, cache, seg in zip(_parts(qkv, xs), caches, segs, strict=True):
        q, k, v = split_qkv(part)
        if cfg.qk_norm:
            q, k = rms_norm(q, p.q_norm, cfg.norm_eps), rms_norm(k, p.k_norm, cfg.norm_eps)
        q, k = apply_rope(q, seg.positions, inv_freq), apply_rope(k, seg.positions, inv_freq)
        # k and v whole before the cache write: XLA:GPU fused their projection into the cache's
        # scatter, which then ran serially per element (benchmarks/gpu/NOTES.md)
        k, v = jax.lax.optimization_barrier((k, v))
        out, cache = cache.attend(layer, q, k, v, seg)
        attn.append(out)
        out_caches.append(cache)
    x = x + jnp.einsum("...hk,hkd->...d", _joined(attn), p.wo)
    h = rms_norm(x, p.mlp_norm, cfg.norm_eps)
    gated = jax.nn.silu(jnp.einsum("...d,df->...f", h, p.w_gate)) * jnp.einsum(
        "...d,df->...f", h, p.w_up
    )
    x = x + jnp.einsum("...f,fd->...d", gated, p.w_down)
    return tuple(_parts(x, xs)), tuple(out_caches)


def _joined(xs) -> jax.Array:
    """Groups [B, T, ...] as one array: the group itself, or every group's tokens [N, ...]."""
    if len(xs) == 1:
        return xs[0]
    return jnp.concatenate([x.reshape(-1, *x.shape[2:]) for x in xs])


def _parts(y: jax.Array, xs) -> list[jax.Array]:
    """``_joined``'s result y [..., F...] cut back into the groups of xs: [B, T, F...] each."""
    if len(xs) == 1:
        return [y]
    ends = np.cumsum([x.shape[0] * x.shape[1] for x in xs])[:-1]
    return [
        part.reshape(x.shape[0], x.shape[1], *y.shape[1:])
        for part, x in zip(jnp.split(y, ends), xs, strict=True)
    ]


# Platforms whose layer scan carries the caches' stacked LAYER_FIELDS and writes each layer's in
# place, instead of scanning over them and stacking the outputs. XLA:GPU then keeps one buffer of
# each field (the H200's compile of MomentKV 1024 at batch 64: 1,619 -> 129 MB of temporaries, 1,658
# -> 156 MB copied per step; SnapKV 756 -> 488 and 475 -> 408); XLA:CPU copies every field in every
# layer in that form (docs/performance.md), so elsewhere the fields are scanned.
FIELDS_CARRIED_ON = ("cuda",)


def forward(params: Params, groups: tuple) -> tuple[tuple, tuple]:
    """Run groups of new tokens through every layer, each against its own cache: ``groups`` holds
    (tokens [B, T], cache, seg) per group, rows of any count and lengths (``decoder_layer``).

    Stacked ``params.layers`` run under ``lax.scan``; a tuple of layers (``unstack_layers``) as an
    unrolled loop. Either carries the caches' keys and values and hands each layer its slice of the
    caches' ``LAYER_FIELDS`` (``kvjax.model.layer_fields``). Returns each group's final-normed
    hidden states [B, T, D] and updated cache.
    """
    cfg = params.config
    inv_freq = inverse_frequencies(cfg)
    xs = tuple(jnp.take(params.embed, tokens, axis=0) for tokens, _, _ in groups)
    segs = tuple(seg for _, _, seg in groups)
    rest, fields = zip(*(split_layers(cache, seg) for _, cache, seg in groups), strict=True)

    def layer_step(xs, rest, p, index, here):
        caches = tuple(join_layers(r, f) for r, f in zip(rest, here, strict=True))
        xs, caches = decoder_layer(cfg, xs, p, index, caches, segs, inv_freq)
        rest, here = zip(*(split_layers(c, s) for c, s in zip(caches, segs)), strict=True)
        return xs, rest, here

    if isinstance(params.layers, tuple):
        done = []
        for index, p in enumerate(params.layers):
            here = jax.tree.map(lambda a: a[index], fields)
            xs, rest, here = layer_step(xs, rest, p, jnp.int32(index), here)
            done.append(here)
        fields = jax.tree.map(lambda *a: jnp.stack(a), *done)
    else:
        index = jnp.arange(cfg.n_layers, dtype=jnp.int32)

        def scanned(xs, rest, fields):  # the fields as the scan's inputs and stacked outputs
            def body(carry, layer):
                xs, rest, here = layer_step(*carry, *layer)
                return (xs, rest), here

            (xs, rest), fields = jax.lax.scan(body, (xs, rest), (params.layers, index, fields))
            return xs, rest, fields

        def carried(xs, rest, fields):  # the stacked fields carried, each layer's written in place
            def body(carry, layer):
                xs, rest, stacked = carry
                xs, rest, here = layer_step(xs, rest, *layer, carried_view(stacked, layer[1]))
                return (xs, rest, carried_back(stacked, here, layer[1])), None

            return jax.lax.scan(body, (xs, rest, fields), (params.layers, index))[0]

        if not jax.tree.leaves(fields) or not FIELDS_CARRIED_ON:
            xs, rest, fields = scanned(xs, rest, fields)
        else:
            xs, rest, fields = jax.lax.platform_dependent(
                xs,
                rest,
                fields,
                **dict.fromkeys(FIELDS_CARRIED_ON, carried),
                default=scanned,
            )
    hidden = tuple(rms_norm(x, params.final_norm, cfg.norm_eps) for x in xs)
    return hidden, tuple(join_layers(r, f) for r, f in zip(rest, fields, strict=True))


def decode_hidden(params: Params, tokens: jax.Array, cache, seg: Segment):
    """``forward`` of one group: new tokens [B, T] at ``seg.positions`` [B, T] against ``cache``.
    Returns the final-normed hidden states [B, T, D] and the updated cache."""
    (hidden,), (cache,) = forward(params, ((tokens, cache, seg),))
    return hidden, cache


def logits_from_hidden(params: Params, hidden: jax.Array) -> jax.Array:
    """[..., D] -> float32 logits [..., V] (tied embeddings use ``embed``); the matmul runs in the
    params' dtype."""
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", hidden, params.embed).astype(jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden, params.lm_head).astype(jnp.float32)
