"""The semantics of ``expected_logits``: Expected Attention's expected logit of every slot under a
query head's Gaussian N(μ, Σ) of the queries before RoPE, rotated by the mean rotation R̄ of the
future positions (Devoto et al. 2025; kvpress's ``ExpectedAttentionPress``), in float32:

    z_gj = μ̃_g·k_j/√d + k_jᵀ Σ̃_g k_j/(2d),   μ̃ = R̄μ, Σ̃ = R̄ΣR̄ᵀ, Σ = Q/n − μμᵀ,

computed as μ·k'_j/√d + (k'_jᵀ Q k'_j/n − (μ·k'_j)²)/(2d) with k'_j = R̄ᵀk_j (Q the sum of the
queries' outer products, n their count): the same value, and neither Σ nor Σ̃ of every head formed.
Queries whose outer products Q does not hold yet (``pending``, p_e) join Q here, Q + Σ_e p_e p_eᵀ,
which is not stored (the kernels add Σ_e (p_e·k'_j)² to k'_jᵀ Q k'_j instead: the same value).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expected_logits(k, rotation, mean, qq_sum, count, pending=None) -> jax.Array:
    """z [B, Hk, G, S] float32 of the slots whose keys are k [B, Hk, S, K] (any float dtype, read
    in float32) under each row's rotation R̄ [B, K, K] and each query head's mean μ [B, Hk, G, K]
    and sum of outer products Q [B, Hk, G, K, K] of its n = count [B] (≥ 1) queries (Q None: the
    linear term alone), of which the queries ``pending`` [B, Hk, G, E, K] (or None) are not in Q
    yet."""
    f32 = jnp.float32
    K = k.shape[-1]
    kr = jnp.einsum("bhsi,bij->bhsj", k.astype(f32), rotation)  # row j: R̄ᵀ k_j
    lin = jnp.einsum("bhgi,bhsi->bhgs", mean, kr)
    z = lin / jnp.sqrt(f32(K))
    if qq_sum is not None:
        if pending is not None:  # the sums with the pending queries' products, not stored
            qq_sum = qq_sum + jnp.einsum("bhgei,bhgej->bhgij", pending, pending)
        quad = jnp.einsum("bhsi,bhgim,bhsm->bhgs", kr, qq_sum, kr)
        z += (quad / count[:, None, None, None] - lin * lin) / (2 * K)
    return z
