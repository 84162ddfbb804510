"""MomentKV on one layer's slice: moment-informed eviction (MI) and normalization-corrected attention (NC).

Statistics per (row, KV head) of the evicted set E (``kvjax.budget_cache.Moments``): n = |E|, s_k = Σ k,
s_v = Σ v, S = Σ v kᵀ. Means k̄ = s_k/n, v̄ = s_v/n; centred S̃ = S − s_v s_kᵀ/n (MomentKV Eq. 9).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CLAMP = 1e-6  # entries of S̃ below this magnitude are set to zero (MomentKV App. C.2)


def centred_outer(count: jax.Array, k_sum: jax.Array, v_sum: jax.Array, vk_sum: jax.Array) -> jax.Array:
    """S̃ [..., K, K] with the App. C.2 clamp; zero where count == 0."""
    n = jnp.maximum(count, 1.0)[..., None, None]
    s = vk_sum - v_sum[..., :, None] * k_sum[..., None, :] / n
    return jnp.where((jnp.abs(s) < CLAMP) | (count[..., None, None] == 0), 0.0, s)


def corrected_attention(out: jax.Array, lse: jax.Array, q: jax.Array, moments, zeroth: bool) -> jax.Array:
    """NC: mix the attention over kept slots with the moment estimate of the evicted ones (in log space).

    out: [B, T, H, K] attention over the kept slots f_R; lse: [B, T, H] = log Z_R; q: [B, T, H, K];
    moments: one layer's Moments ([B, Hk, ...]). Returns ŵ f_R + (1 − ŵ) f̂_E, with
    log ŵ = log Z_R − logaddexp(log Z_R, log n + q·k̄/√d) and f̂_E = v̄ + S̃ q/(n√d) (v̄ alone if zeroth);
    rows and heads with nothing evicted are returned unchanged.
    """
    B, T, H, K = q.shape
    Hk = moments.count.shape[1]
    G = H // Hk
    n = moments.count  # [B, Hk]
    safe_n = jnp.maximum(n, 1.0)
    k_mean = moments.k_sum / safe_n[..., None]
    v_mean = moments.v_sum / safe_n[..., None]
    qg = q.astype(jnp.float32).reshape(B, T, Hk, G, K)
    scale = jnp.sqrt(jnp.float32(K))
    mean_logit = jnp.einsum("bthgk,bhk->bthg", qg, k_mean) / scale
    estimate = jnp.broadcast_to(v_mean[:, None, :, None, :], qg.shape)
    if not zeroth:
        s_tilde = centred_outer(n, moments.k_sum, moments.v_sum, moments.vk_sum)
        estimate = estimate + jnp.einsum("bhij,bthgj->bthgi", s_tilde, qg) / (safe_n[:, None, :, None, None] * scale)
    lse_r = lse.reshape(B, T, Hk, G)
    log_w = lse_r - jnp.logaddexp(lse_r, jnp.log(safe_n)[:, None, :, None] + mean_logit)
    w = jnp.where((n > 0)[:, None, :, None], jnp.exp(log_w), 1.0)[..., None]
    mixed = w * out.astype(jnp.float32).reshape(B, T, Hk, G, K) + (1.0 - w) * estimate
    return mixed.reshape(B, T, H, K).astype(out.dtype)


def moment_informed_eviction(priority: jax.Array, candidates: jax.Array, n_evict: jax.Array, k: jax.Array,
                             v: jax.Array, pos: jax.Array, moments, zeroth: bool, max_evict: int) -> jax.Array:
    """Algorithm 1's eviction loop, exactly: evict one token at a time, the candidate of lowest
    ``priority · ‖r_j‖`` with r_j = v_j − v̄ − S̃ k_j/(n√d) (r_j = v_j − v̄ if zeroth; r_j = v_j while nothing
    is evicted), then add it to the statistics before choosing the next. Ties evict the earlier position.

    priority, candidates, pos: [B, Hk, S]; n_evict: [B, Hk] tokens to evict; k, v: [B, Hk, S, K]; moments: one
    layer's Moments; max_evict: static bound on n_evict. S̃ k_j is kept up to date with rank-one updates
    (S k_j and s_k·k_j), so a step costs O(S·K); MI uses S̃ without the App. C.2 clamp, which guards S̃ q
    in the correction. Returns the evicted mask [B, Hk, S].
    """
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    scale = jnp.sqrt(jnp.float32(k.shape[-1]))
    count, k_sum, v_sum = moments.count, moments.k_sum, moments.v_sum
    sk = jnp.einsum("bhij,bhsj->bhsi", moments.vk_sum, kf)  # S k_j
    kk_sum = jnp.einsum("bhk,bhsk->bhs", k_sum, kf)  # s_k·k_j

    def step(t, carry):
        evicted, count, k_sum, v_sum, sk, kk_sum = carry
        n = jnp.maximum(count, 1.0)[..., None, None]
        resid = vf - v_sum[:, :, None, :] / n
        if not zeroth:
            resid = resid - (sk - v_sum[:, :, None, :] * kk_sum[..., None] / n) / (n * scale)
        resid = jnp.where((count > 0)[..., None, None], resid, vf)
        score = jnp.where(candidates & ~evicted, priority * jnp.linalg.norm(resid, axis=-1), jnp.inf)
        lowest = score == score.min(-1, keepdims=True)
        j = jnp.argmin(jnp.where(lowest, pos, jnp.iinfo(jnp.int32).max), axis=-1)  # the earliest position
        active = t < n_evict  # [B, Hk]
        chosen = (jnp.arange(k.shape[2]) == j[..., None]) & active[..., None]
        k_j = jnp.take_along_axis(kf, j[..., None, None], axis=2)[:, :, 0]
        v_j = jnp.take_along_axis(vf, j[..., None, None], axis=2)[:, :, 0]
        a = active[..., None].astype(jnp.float32)
        dots = jnp.einsum("bhk,bhsk->bhs", k_j, kf) * a
        return (evicted | chosen, count + a[..., 0], k_sum + a * k_j, v_sum + a * v_j,
                sk + dots[..., None] * v_j[:, :, None, :], kk_sum + dots)

    init = (jnp.zeros(priority.shape, bool), count, k_sum, v_sum, sk, kk_sum)
    return jax.lax.fori_loop(0, max_evict, step, init)[0]
