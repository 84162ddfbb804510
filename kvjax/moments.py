"""MomentKV's statistics of the evicted tokens (``Moments``) and its moment-informed eviction (MI) on one layer's
slice. Its normalization-corrected attention (NC) is part of the attention kernels' semantics:
``kvjax.kernels.decode_attention.reference.corrected_attention``.

Statistics per (row, KV head) of the evicted set E: n = |E|, s_k = Σ k, s_v = Σ v, S = Σ v kᵀ. Means
k̄ = s_k/n, v̄ = s_v/n; centred S̃ = S − s_v s_kᵀ/n (MomentKV Eq. 9).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.slots import max_slots


@struct.dataclass
class Moments:
    """Statistics of the evicted tokens per (layer, row, KV head), float32.

    count: [L, B, Hk]; k_sum, v_sum: [L, B, Hk, K]; vk_sum: [L, B, Hk, K, K] with [i, j] = Σ v_i k_j.
    """

    count: jax.Array
    k_sum: jax.Array
    v_sum: jax.Array
    vk_sum: jax.Array

    AXES = dict(count=("layers", "batch", "kv_heads"), k_sum=("layers", "batch", "kv_heads", "head_dim"),
                v_sum=("layers", "batch", "kv_heads", "head_dim"),
                vk_sum=("layers", "batch", "kv_heads", "head_dim", "head_dim"))

    @classmethod
    def zeros(cls, lead: tuple[int, ...], head_dim: int) -> Moments:
        """Empty statistics for the leading axes ``lead`` (e.g. (L, B, Hk))."""
        f32 = jnp.float32
        return cls(count=jnp.zeros(lead, f32), k_sum=jnp.zeros(lead + (head_dim,), f32),
                   v_sum=jnp.zeros(lead + (head_dim,), f32), vk_sum=jnp.zeros(lead + (head_dim, head_dim), f32))

    def add(self, weight: jax.Array, k: jax.Array, v: jax.Array) -> Moments:
        """Add tokens k, v [B, Hk, E, K] with 0/1 weight [B, Hk, E] (one layer's slice)."""
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        return Moments(count=self.count + weight.sum(-1),
                       k_sum=self.k_sum + jnp.einsum("bhe,bhek->bhk", weight, k),
                       v_sum=self.v_sum + jnp.einsum("bhe,bhek->bhk", weight, v),
                       vk_sum=self.vk_sum + jnp.einsum("bhe,bhei,bhej->bhij", weight, v, k))


def moment_informed_eviction(priority: jax.Array, candidates: jax.Array, n_evict: jax.Array, k: jax.Array,
                             v: jax.Array, pos: jax.Array, moments, zeroth: bool, max_evict: int,
                             batch: int = 1) -> jax.Array:
    """Algorithm 1's eviction loop: evict the candidate of lowest ``priority · ‖r_j‖`` with
    r_j = v_j − v̄ − S̃ k_j/(n√d) (r_j = v_j − v̄ if zeroth; r_j = v_j while nothing is evicted), add it to the
    statistics, then choose the next. Ties evict the earlier position.

    priority, candidates, pos: [B, Hk, S]; n_evict: [B, Hk] tokens to evict; k, v: [B, Hk, S, K]; moments: one
    layer's Moments; max_evict: static bound on n_evict. S k_j and s_k·k_j are kept up to date with low-rank
    updates, so a step costs O(S·K·batch); MI uses S̃ without the App. C.2 clamp, which guards S̃ q in the
    correction. Returns the evicted mask [B, Hk, S].

    batch = 1 is Algorithm 1 exactly. batch > 1, a faster approximation when a prefill evicts thousands of
    tokens, evicts the ``batch`` candidates of lowest score under the current statistics per step, then adds
    them all.
    """
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    scale = jnp.sqrt(jnp.float32(k.shape[-1]))
    sk = jnp.einsum("bhij,bhsj->bhsi", moments.vk_sum, kf)  # S k_j
    kk_sum = jnp.einsum("bhk,bhsk->bhs", moments.k_sum, kf)  # s_k·k_j

    def step(t, carry):
        evicted, count, k_sum, v_sum, sk, kk_sum = carry
        n = jnp.maximum(count, 1.0)[..., None, None]
        resid = vf - v_sum[:, :, None, :] / n
        if not zeroth:
            resid = resid - (sk - v_sum[:, :, None, :] * kk_sum[..., None] / n) / (n * scale)
        resid = jnp.where((count > 0)[..., None, None], resid, vf)
        score = jnp.where(candidates & ~evicted, priority * jnp.linalg.norm(resid, axis=-1), jnp.inf)
        if batch == 1:  # argmin, the earliest position among equal scores
            lowest = score == score.min(-1, keepdims=True)
            chosen = jnp.argmin(jnp.where(lowest, pos, jnp.iinfo(jnp.int32).max), axis=-1)[..., None]
        else:
            index = jnp.broadcast_to(jnp.arange(k.shape[2]), pos.shape)
            chosen = jax.lax.sort((score, pos, index), dimension=-1, num_keys=2)[2][..., :batch]
        # [B, Hk, batch] chosen slots, of which the first ``take`` are evicted (the rest weigh 0)
        take = jnp.clip(n_evict - evicted.sum(-1), 0, batch)
        w = (jnp.arange(chosen.shape[-1]) < take[..., None]).astype(jnp.float32)
        k_c = jnp.take_along_axis(kf, chosen[..., None], axis=2) * w[..., None]
        v_c = jnp.take_along_axis(vf, chosen[..., None], axis=2)
        dots = jnp.einsum("bhck,bhsk->bhsc", k_c, kf)  # w_c (k_c·k_j)
        evicted = max_slots(evicted, chosen, w > 0)
        return (evicted, count + w.sum(-1), k_sum + k_c.sum(2), v_sum + jnp.einsum("bhc,bhck->bhk", w, v_c),
                sk + jnp.einsum("bhsc,bhck->bhsk", dots, v_c), kk_sum + dots.sum(-1))

    init = (jnp.zeros(priority.shape, bool), moments.count, moments.k_sum, moments.v_sum, sk, kk_sum)
    return jax.lax.fori_loop(0, -(-max_evict // batch), step, init)[0]
