"""Reference of block attention with eviction scores: the XLA computation kvjax runs on CPU.

``attention_with_scores`` takes a dense visibility mask (the full cache calls it directly);
``block_attention_with_scores`` builds that mask from positions — slot s is visible to query t iff
``0 <= slot_pos[s] <= query_pos[t]`` — and is what the kernels are checked against and what the
default ``impl=None`` runs on CPU. Keys and values given as ``Quantized`` are dequantized to q's
dtype first (``quantized.values(k, q.dtype)``); from there the computation is the arrays'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from kvjax.kernels._shared import NEG_INF, SCORE_KINDS, check_score, check_shapes, dequantized


def attention_with_scores(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    query_weights: jax.Array | None = None,
    score: str = "attn",
):
    """Grouped-query attention over cache slots, its log-sum-exp, and per-slot eviction statistics.

    Args:
        q: [B, T, H, K].
        k, v: [B, Hk, S, K], arrays or ``Quantized`` (dequantized to q's dtype).
        mask: [B, Hk or 1, T, S] bool (True = visible).
        query_weights: [B, T] float32 (the scoring queries) or None.

    Returns out [B, T, H, K] (q's dtype), lse [B, T, H] float32 (log Σ_s exp z over visible slots)
    and, unless query_weights is None, col [B, Hk, G, S] float32: Σ_t w_t · s_t(slot) with, for
    query t of query head g, weights A, logits z = q·k/√d, output o (OBCache, Sec. 3.3):
      attn: A;  obcache-value: A² ‖v‖²;  obcache-key: (A z)² ‖v − o‖²;
      obcache-joint: A² ‖v‖² + (A z)² ‖v − o‖² + 2 A² z (‖v‖² − v·o).
    Softmax and statistics are float32; a fully masked query row gets finite garbage, never NaN.
    """
    k, v = dequantized(k, q.dtype), dequantized(v, q.dtype)
    B, T, H, K = q.shape
    Hk = k.shape[1]
    qg = q.reshape(B, T, Hk, H // Hk, K)
    # Matmuls in the activation dtype (as transformers does; XLA:CPU lacks bf16 x bf16 -> f32 dots).
    z = jnp.einsum("bthgk,bhsk->bhgts", qg, k.astype(q.dtype)).astype(jnp.float32) / jnp.sqrt(
        jnp.float32(K)
    )
    visible = mask[:, :, None]
    logits = jnp.where(visible, z, NEG_INF)
    top = jnp.max(logits, axis=-1, keepdims=True)
    unnormalised = jnp.exp(logits - top)
    total = jnp.sum(unnormalised, axis=-1, keepdims=True)
    weights = unnormalised / total
    lse = (top + jnp.log(total))[..., 0]  # [B, Hk, G, T]
    out_f32 = jnp.einsum("bhgts,bhsk->bhgtk", weights.astype(v.dtype), v).astype(jnp.float32)
    out = out_f32.transpose(0, 3, 1, 2, 4).reshape(B, T, H, K).astype(q.dtype)
    lse_out = lse.transpose(0, 3, 1, 2).reshape(B, T, H)
    if query_weights is None:
        return out, lse_out, None
    w = query_weights.astype(jnp.float32)  # [B, T]
    if score == "attn":
        return out, lse_out, query_sum(w, weights)
    vf = v.astype(jnp.float32)
    v_sq = jnp.sum(vf * vf, -1)[:, :, None, :]  # [B, Hk, 1, S]
    z = jnp.where(visible, z, 0.0)  # masked logits must not meet the zero weights as -1e30
    sq = weights * weights
    a2 = w[:, None, None, :, None] * sq  # [B, Hk, G, T, S]
    col = jnp.zeros(weights.shape[:3] + weights.shape[-1:], jnp.float32)
    if score in ("obcache-value", "obcache-joint"):
        col += query_sum(w, sq) * v_sq
    if score in ("obcache-key", "obcache-joint"):
        col += residual_sums(a2 * z * z, vf, out_f32, lambda dist2, v_res: dist2)  # (A z)² ‖v − o‖²
    if score == "obcache-joint":
        col += 2 * residual_sums(a2 * z, vf, out_f32, lambda dist2, v_res: v_res)  # A² z v·(v − o)
    if score not in SCORE_KINDS:
        raise ValueError(f"score={score!r} must be one of {SCORE_KINDS}")
    return out, lse_out, col


def query_sum(w: jax.Array, x: jax.Array) -> jax.Array:
    """Σ_t w[b, t] · x[b, h, g, t, s] -> [B, Hk, G, S], as a matrix–vector product: XLA:CPU runs the
    same sum written as a weighted reduce over the middle axis much slower (docs/performance.md)."""
    return jnp.einsum("bt,bhgts->bhgs", w, x)


RESIDUAL_CHUNK = 8  # queries per step of ``residual_sums``


def residual_sums(coef: jax.Array, v: jax.Array, o: jax.Array, term) -> jax.Array:
    """Σ_t coef[t, s] · term(‖v_s − o_t‖², v_s·(v_s − o_t)) -> [B, Hk, G, S], from the differences
    themselves.

    Args:
        coef: [B, Hk, G, T, S].
        v: [B, Hk, S, K].
        o: [B, Hk, G, T, K] float32.

    Expanding ‖v − o‖² into ‖v‖² − 2 v·o + ‖o‖² cancels catastrophically where a query's output is
    one value (o ≈ v, the tokens that take all the attention), so the differences are formed,
    ``RESIDUAL_CHUNK`` queries at a time.
    """
    B, Hk, G, T, S = coef.shape
    c = min(T, RESIDUAL_CHUNK)
    n = -(-T // c)
    pad = [(0, 0)] * 3 + [(0, n * c - T)]
    coef = jnp.pad(coef, pad + [(0, 0)]).reshape(B, Hk, G, n, c, S)
    o = jnp.pad(o, pad + [(0, 0)]).reshape(B, Hk, G, n, c, -1)

    def chunk(xs):
        coef_c, o_c = xs  # [B, Hk, G, c, S], [B, Hk, G, c, K]

        def weighted():
            diff = v[:, :, None, None] - o_c[:, :, :, :, None, :]  # [B, Hk, G, c, S, K]
            values = term(jnp.sum(diff * diff, -1), jnp.einsum("bhsk,bhgtsk->bhgts", v, diff))
            return jnp.sum(coef_c * values, axis=3)

        # Most queries of a block do not score (SnapKV, TOVA): skip their chunks.
        return jax.lax.cond(
            jnp.any(coef_c != 0), weighted, lambda: jnp.zeros((B, Hk, G, S), jnp.float32)
        )

    return jnp.sum(jax.lax.map(chunk, (jnp.moveaxis(coef, 3, 0), jnp.moveaxis(o, 3, 0))), axis=0)


def visibility(slot_pos: jax.Array, query_pos: jax.Array) -> jax.Array:
    """[B, Hk, T, S] bool: slot s (original position slot_pos [B, Hk, S], -1 = empty) is visible to
    query t (position query_pos [B, T])."""
    return (slot_pos >= 0)[:, :, None, :] & (slot_pos[:, :, None, :] <= query_pos[:, None, :, None])


def block_attention_with_scores(
    q, k, v, slot_pos, query_pos, query_weights=None, score: str = "attn"
):
    """Block attention with eviction scores, with visibility from positions.

    Args:
        q: [B, T, H, K].
        k, v: [B, Hk, S, K], arrays or ``Quantized`` of one kind.
        slot_pos: [B, Hk, S] int32 (-1 = empty).
        query_pos: [B, T] int32.
        query_weights: [B, T] float32 or None.

    Returns (out [B, T, H, K] in q's dtype, lse [B, T, H] float32, col [B, Hk, G, S] float32 or
    None); the formulas are in ``attention_with_scores``.
    """
    check_score(score)
    check_shapes(q, k, v, slot_pos, query_pos, query_weights)
    return attention_with_scores(q, k, v, visibility(slot_pos, query_pos), query_weights, score)
