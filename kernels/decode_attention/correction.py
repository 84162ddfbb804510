"""MomentKV's correction terms for one KV head, as the decode kernels form them (Triton and Mosaic
alike) from the statistics they read in place: ``reference.correction_terms`` per head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from kvjax.kernels.decode_attention.reference import CLAMP


def head_terms(q, count, k_sum, v_sum, vk_sum, zeroth: bool, dot):
    """(log_mass [R, 1], estimate [R, K]) of query rows q [R, K] float32 under one head's
    statistics count [1, 1], k_sum, v_sum [1, K] and vk_sum [K, K] (float32; None if zeroth), as
    ``reference.correction_terms``; dot(a, b) is a · bᵀ on the platform's matrix unit."""
    K = q.shape[1]
    n = jnp.maximum(count, 1.0)
    scale = math.sqrt(K)
    mean_logit = jnp.sum(q * (k_sum / n), axis=1, keepdims=True) / scale  # [R, 1]
    estimate = jnp.broadcast_to(v_sum / n, q.shape)
    if not zeroth:
        # v_sum as a column by a masked row sum: neither backend transposes a [1, K] row cheaply
        row = jax.lax.broadcasted_iota(jnp.int32, (K, K), 0)
        col = jax.lax.broadcasted_iota(jnp.int32, (K, K), 1)
        v_col = jnp.sum(jnp.where(row == col, v_sum, 0.0), axis=1, keepdims=True)  # [K, 1]
        s = vk_sum - v_col * k_sum / n  # S̃ (MomentKV Eq. 9), with App. C.2's clamp
        s = jnp.where((jnp.abs(s) < CLAMP) | (count == 0), 0.0, s)
        estimate = estimate + dot(q, s) / (n * scale)
    log_mass = jnp.where(count > 0, jnp.log(n) + mean_logit, -jnp.inf)
    return log_mass, estimate
