"""What the residual-norm kernels share: a tile's residuals, the checks and the read dtype."""

from __future__ import annotations

import math

import jax.numpy as jnp
from kvjax.kernels._shared import stacked_layer
from kvjax.kernels.quantized import ROTATED, Quantized


def residuals(k, v, count, k_sum, v_sum, vk_sum, zeroth: bool, dot):
    """r_j [bk, K] float32 of a tile's keys and values k, v [bk, K] (float32) under one head's
    statistics count [1, 1], k_sum, v_sum [1, K] and vk_sum [K, K] (None if zeroth), as
    ``reference.residual_norms`` forms them; dot(a, b) is a · bᵀ on the platform's matrix unit."""
    n = jnp.maximum(count, 1.0)
    v_bar = v_sum / n
    r = v - v_bar
    if not zeroth:
        m = jnp.sum(k * k_sum, axis=1, keepdims=True)  # [bk, 1]
        a = 1.0 / (n * math.sqrt(k.shape[1]))
        r = r - a * (dot(k, vk_sum) - m * v_bar)  # dot: S k_j
    return jnp.where(count > 0, r, v)


def read_dtype(x):
    """The dtype keys or values are read in before float32: a ``Quantized``'s model dtype (what
    ``quantized.values`` gives), an array's own."""
    return jnp.dtype(x.dtype)


def head_stats(refs, read) -> tuple:
    """(count, k_sum, v_sum, vk_sum) of one head, each ``read(ref)`` of its statistics refs
    (``stat_inputs``'s), vk_sum None where the zeroth order's three are given."""
    count, k_sum, v_sum, *outer = (read(ref) for ref in refs)
    return count, k_sum, v_sum, outer[0] if outer else None


def stats_read(moments, zeroth: bool) -> tuple:
    """The statistics the kernels read of ``moments``: (count, k_sum, v_sum, vk_sum), with
    vk_sum None for the zeroth order (which reads no Σ v kᵀ, and whose caches keep none)."""
    return moments.count, moments.k_sum, moments.v_sum, None if zeroth else moments.vk_sum


def check_inputs(k, v, count, k_sum, v_sum, vk_sum, layer, zeroth: bool):
    """(k, v stacked, ``layer`` as [1] int32, (B, Hk, S, K)) after checking the statistics' shapes
    against one layer of k, v (``stacked_layer``; vk_sum None if and only if zeroth); raises
    ValueError naming the argument."""
    k, v, layer, shape = stacked_layer(k, v, layer)
    B, Hk, S, K = shape.shape
    if (vk_sum is None) != zeroth:
        raise ValueError(
            f"vk_sum must be None for the zeroth order and given otherwise; got zeroth={zeroth} "
            f"and vk_sum {'None' if vk_sum is None else list(vk_sum.shape)}"
        )
    expected = dict(count=(B, Hk), k_sum=(B, Hk, K), v_sum=(B, Hk, K), vk_sum=(B, Hk, K, K))
    for name, x in zip(expected, (count, k_sum, v_sum, vk_sum), strict=True):
        if x is not None and x.shape != expected[name]:
            raise ValueError(
                f"{name} must be {expected[name]} for keys of one layer {shape.shape}; got "
                f"{x.shape}"
            )
    return k, v, layer, (B, Hk, S, K)


def check_unrotated(k) -> None:
    """The kernels read keys stored in the values' own domain: not rotated ``Quantized`` ones."""
    if isinstance(k, Quantized) and k.kind in ROTATED:
        raise ValueError(
            f"kv_dtype={k.kind!r} keys and values are stored rotated: the kernels read them "
            "unrotated only (the API runs the reference for them)"
        )
