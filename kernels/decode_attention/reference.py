"""Reference of decode attention (one query per sequence) with eviction scores and MomentKV's
normalization-corrected output (NC): ``block_attention.reference`` at T = 1, then, when ``moments``
is given, ``corrected_attention`` (lse and col stay those of the attention over the kept slots) —
exactly what the budget cache computes with XLA.

MomentKV's statistics per (row, KV head) of the evicted set E: n = |E|, s_k = Σ k, s_v = Σ v,
S = Σ v kᵀ (``moments``: count [B, Hk], k_sum, v_sum [B, Hk, K], vk_sum [B, Hk, K, K]). Means
k̄ = s_k/n, v̄ = s_v/n; centred S̃ = S − s_v s_kᵀ/n (MomentKV Eq. 9).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from kvjax.kernels.block_attention.reference import block_attention_with_scores
from kvjax.kernels.quantized import ROTATED, Quantized

CLAMP = 1e-6  # entries of S̃ below this magnitude are set to zero (MomentKV App. C.2)


def centred_outer(
    count: jax.Array, k_sum: jax.Array, v_sum: jax.Array, vk_sum: jax.Array
) -> jax.Array:
    """S̃ [..., K, K] with the App. C.2 clamp; zero where count == 0."""
    n = jnp.maximum(count, 1.0)[..., None, None]
    s = vk_sum - v_sum[..., :, None] * k_sum[..., None, :] / n
    return jnp.where((jnp.abs(s) < CLAMP) | (count[..., None, None] == 0), 0.0, s)


def correction_terms(q: jax.Array, moments, zeroth: bool) -> tuple[jax.Array, jax.Array]:
    """MomentKV's estimate of the evicted tokens' share of the attention of queries q [B, T, H, K]
    under one layer's ``moments`` (n = count):

    (log_mass [B, T, Hk, G] = log n + q·k̄/√d, -inf where nothing is evicted; estimate
    [B, T, Hk, G, K] float32 = f̂_E = v̄ + S̃ q/(n√d), v̄ alone if zeroth). The decode kernels form
    the same terms from the statistics they read (``corrected_attention`` mixes them in)."""
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
        estimate = estimate + jnp.einsum("bhij,bthgj->bthgi", s_tilde, qg) / (
            safe_n[:, None, :, None, None] * scale
        )
    log_mass = jnp.log(safe_n)[:, None, :, None] + mean_logit
    return jnp.where((n > 0)[:, None, :, None], log_mass, -jnp.inf), estimate


def mixed_attention(
    out: jax.Array, lse: jax.Array, log_mass: jax.Array, estimate: jax.Array
) -> jax.Array:
    """ŵ f_R + (1 − ŵ) f̂_E in out's dtype, with log ŵ = log Z_R − logaddexp(log Z_R, log_mass):
    the attention out [B, T, H, K] over the kept slots (lse [B, T, H] = log Z_R) mixed with
    ``correction_terms``' estimate in log space (unchanged where log_mass is -inf)."""
    B, T, H, K = out.shape
    Hk = log_mass.shape[2]
    lse_r = lse.reshape(B, T, Hk, H // Hk)
    w = jnp.exp(lse_r - jnp.logaddexp(lse_r, log_mass))[..., None]
    mixed = w * out.astype(jnp.float32).reshape(estimate.shape) + (1.0 - w) * estimate
    return mixed.reshape(B, T, H, K).astype(out.dtype)


def corrected_attention(
    out: jax.Array, lse: jax.Array, q: jax.Array, moments, zeroth: bool
) -> jax.Array:
    """NC: mix the attention over kept slots with the moment estimate of the evicted ones
    (in log space).

    Args:
        out: [B, T, H, K] attention over the kept slots f_R.
        lse: [B, T, H] = log Z_R.
        q: [B, T, H, K].
        moments: one layer's Moments ([B, Hk, ...]).

    Returns ŵ f_R + (1 − ŵ) f̂_E, with log ŵ = log Z_R − logaddexp(log Z_R, log n + q·k̄/√d) and
    f̂_E = v̄ + S̃ q/(n√d) (v̄ alone if zeroth); rows and heads with nothing evicted are returned
    unchanged (``correction_terms``, ``mixed_attention``).
    """
    return mixed_attention(out, lse, *correction_terms(q, moments, zeroth))


def check_decode(q) -> None:
    if q.ndim != 4 or q.shape[1] != 1:
        raise ValueError(
            f"decode attention takes one query per sequence: q must be [B, 1, H, K]; got {q.shape}"
        )


def fusable(q, k) -> bool:
    """Whether a decode kernel can give MomentKV's residual norms from the tiles its softmax reads:
    keys and values read in q's dtype (as ``moment_residual_norms`` reads them) and not stored
    rotated."""
    return jnp.dtype(k.dtype) == jnp.dtype(q.dtype) and correctable(k)


def correctable(k) -> bool:
    """Whether a decode kernel can form MomentKV's correction terms from the query it attends with:
    keys not stored rotated (rotated ones attend with a rotated query)."""
    return not (isinstance(k, Quantized) and k.kind in ROTATED)


def check_correctable(k) -> None:
    if not correctable(k):
        raise ValueError(
            f"MomentKV's correction in the decode kernel needs keys not stored rotated; got "
            f"kv_dtype={k.kind!r}"
        )


def check_fusable(q, k) -> None:
    if not fusable(q, k):
        raise ValueError(
            f"residual norms in the decode kernel need keys read in q's dtype {q.dtype} and not "
            f"stored rotated; got {k.dtype}"
            + (f", kv_dtype={k.kind!r}" if isinstance(k, Quantized) else "")
        )


def decode_attention_with_scores(
    q,
    k,
    v,
    slot_pos,
    query_pos,
    query_weights=None,
    score: str = "attn",
    moments=None,
    zeroth: bool = False,
):
    """Decode attention with eviction scores, corrected when ``moments`` is given.

    Args:
        q: [B, 1, H, K].
        k, v: [B, Hk, S, K], arrays or ``Quantized`` of one kind (dequantized to q's dtype).
        slot_pos: [B, Hk, S].
        query_pos: [B, 1].
        query_weights: [B, 1] or None.
        moments: one layer's ``kvjax.cache.dense.Moments`` ([B, Hk, ...]) or None.

    Returns (out [B, 1, H, K] — corrected when ``moments`` is given —, lse [B, 1, H],
    col [B, Hk, G, S] or None).
    """
    check_decode(q)
    out, lse, col = block_attention_with_scores(q, k, v, slot_pos, query_pos, query_weights, score)
    if moments is not None:
        out = corrected_attention(out, lse, q, moments, zeroth)
    return out, lse, col
