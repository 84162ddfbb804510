"""Reference of decode attention (one query per sequence) with eviction scores and MomentKV's
normalization-corrected output: ``block_attention.reference`` at T = 1, then, when ``moments`` is given,
``kvjax.moments.corrected_attention`` (lse and col stay those of the attention over the kept slots) —
exactly what ``kvjax.budget_cache.BudgetCache.attend`` computes with XLA.
"""

from __future__ import annotations

from kvjax.kernels.block_attention.reference import block_attention_with_scores

from kvjax.moments import corrected_attention


def check_decode(q) -> None:
    if q.ndim != 4 or q.shape[1] != 1:
        raise ValueError(f"decode attention takes one query per sequence: q must be [B, 1, H, K]; got {q.shape}")


def decode_attention_with_scores(q, k, v, slot_pos, query_pos, query_weights=None, score: str = "attn",
                                 moments=None, zeroth: bool = False):
    """q [B, 1, H, K]; k, v [B, Hk, S, K]; slot_pos [B, Hk, S]; query_pos [B, 1]; query_weights [B, 1] or
    None; moments: one layer's ``kvjax.budget_cache.Moments`` ([B, Hk, ...]) or None. Returns (out
    [B, 1, H, K] — corrected when ``moments`` is given —, lse [B, 1, H], col [B, Hk, G, S] or None)."""
    check_decode(q)
    out, lse, col = block_attention_with_scores(q, k, v, slot_pos, query_pos, query_weights, score)
    if moments is not None:
        out = corrected_attention(out, lse, q, moments, zeroth)
    return out, lse, col
