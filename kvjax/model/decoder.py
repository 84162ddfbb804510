"""The decoder as plain functions: embed, a ``lax.scan`` over stacked layers (or a loop over
unstacked ones), final norm and logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.model.layer_fields import join_layers, split_layers
from kvjax.model.params import LayerParams, Params, split_qkv
from kvjax.model.rope import apply_rope, inverse_frequencies
from kvjax.model.segment import Segment


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and returned in x's dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * normed.astype(x.dtype)


def decoder_layer(
    cfg, x: jax.Array, p: LayerParams, layer: jax.Array, cache, seg: Segment, inv_freq
):
    """One pre-norm block.

    Args:
        x: [B, T, D].
        p: the layer's parameter slice.
        cache: its keys and values hold every layer, its ``LAYER_FIELDS`` this layer's slice;
            ``cache.attend(layer, ...)`` reads and updates layer ``layer``.
    """
    h = rms_norm(x, p.attn_norm, cfg.norm_eps)
    qkv = jnp.einsum("btd,dngk->btngk", h, p.wqkv)
    q, k, v = split_qkv(qkv + p.bqkv if cfg.qkv_bias else qkv)
    if cfg.qk_norm:
        q, k = rms_norm(q, p.q_norm, cfg.norm_eps), rms_norm(k, p.k_norm, cfg.norm_eps)
    q, k = apply_rope(q, seg.positions, inv_freq), apply_rope(k, seg.positions, inv_freq)
    # k and v whole before the cache write: XLA:GPU fused their projection into the cache's scatter,
    # which then ran serially per element (4.3 of the 8B's 10.5 ms batch-1 step on an H200,
    # 2026-11-28, when wk and wv were separate products; benchmarks/gpu/NOTES.md)
    k, v = jax.lax.optimization_barrier((k, v))
    attn, cache = cache.attend(layer, q, k, v, seg)
    x = x + jnp.einsum("bthk,hkd->btd", attn, p.wo)
    h = rms_norm(x, p.mlp_norm, cfg.norm_eps)
    gated = jax.nn.silu(jnp.einsum("btd,df->btf", h, p.w_gate)) * jnp.einsum(
        "btd,df->btf", h, p.w_up
    )
    return x + jnp.einsum("btf,fd->btd", gated, p.w_down), cache


def decode_hidden(params: Params, tokens: jax.Array, cache, seg: Segment):
    """Run new tokens [B, T] at ``seg.positions`` [B, T] through every layer against ``cache``.

    Stacked ``params.layers`` run under ``lax.scan``; a tuple of layers (``unstack_layers``) as an
    unrolled loop. Either carries the cache's keys and values and hands each layer its slice of the
    cache's ``LAYER_FIELDS`` (``kvjax.model.layer_fields``). Returns the final-normed hidden states
    [B, T, D] and the updated cache.
    """
    cfg = params.config
    inv_freq = inverse_frequencies(cfg)
    x = jnp.take(params.embed, tokens, axis=0)
    rest, fields = split_layers(cache)

    def layer_step(x, rest, p, index, here):
        x, cache = decoder_layer(cfg, x, p, index, join_layers(rest, here), seg, inv_freq)
        return x, *split_layers(cache)

    if isinstance(params.layers, tuple):
        done = []
        for index, p in enumerate(params.layers):
            here = jax.tree.map(lambda a: a[index], fields)
            x, rest, here = layer_step(x, rest, p, jnp.int32(index), here)
            done.append(here)
        fields = jax.tree.map(lambda *a: jnp.stack(a), *done)
    else:

        def body(carry, layer):
            x, rest, here = layer_step(*carry, *layer)
            return (x, rest), here

        layers = (params.layers, jnp.arange(cfg.n_layers, dtype=jnp.int32), fields)
        (x, rest), fields = jax.lax.scan(body, (x, rest), layers)
    return rms_norm(x, params.final_norm, cfg.norm_eps), join_layers(rest, fields)


def logits_from_hidden(params: Params, hidden: jax.Array) -> jax.Array:
    """[..., D] -> float32 logits [..., V] (tied embeddings use ``embed``); the matmul runs in the
    params' dtype."""
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", hidden, params.embed).astype(jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden, params.lm_head).astype(jnp.float32)
