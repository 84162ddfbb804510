"""The semantics of ``moment_residual_norms``: MomentKV's residual of every slot under one layer's
statistics of the evicted tokens (MomentKV Eq. 9 and Algorithm 1), in float32 from the vectors
themselves (no cancelling sums).

With n = |E|, s_k = Σ k, s_v = Σ v, S = Σ v kᵀ over the evicted set E, v̄ = s_v / n and
m_j = s_k · k_j: r_j = v_j − v̄ − (S k_j − m_j v̄) / (n √d), which is S̃ k_j / (n √d) with the
centred S̃ = S − v̄ s_kᵀ; zeroth order: r_j = v_j − v̄; nothing evicted (n = 0): r_j = v_j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def residual_norms(k, v, count, k_sum, v_sum, vk_sum, zeroth: bool) -> jax.Array:
    """‖r_j‖ [B, Hk, M] float32 of the slots whose keys and values are k, v [B, Hk, M, K] (any float
    dtype, read in float32) under the statistics count [B, Hk], k_sum, v_sum [B, Hk, K] and vk_sum
    [B, Hk, K, K] ([i, j] = Σ v_i k_j)."""
    f32 = jnp.float32
    k, v = k.astype(f32), v.astype(f32)
    n = jnp.maximum(count, 1.0)
    v_bar = (v_sum / n[..., None])[:, :, None]
    r = v - v_bar
    if not zeroth:
        m = jnp.einsum("bhk,bhsk->bhs", k_sum, k)[..., None]
        a = (1.0 / (n * jnp.sqrt(f32(k.shape[-1]))))[..., None, None]
        r = r - a * (jnp.einsum("bhij,bhsj->bhsi", vk_sum, k) - m * v_bar)
    r = jnp.where((count > 0)[..., None, None], r, v)
    return jnp.sqrt(jnp.sum(r * r, axis=-1))
