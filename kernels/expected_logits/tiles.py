"""What the expected-logit kernels share: a tile's logits, the checks, and the statistics' operands
and BlockSpecs."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from kvjax.kernels._shared import logical


def logit_terms(kr, mean, qq_sum, inv_count, dot):
    """(lin [bk, K], quad [bk, K] or None) float32, whose row sums l_j and q_j give the expected
    logits l_j/√d + (q_j − l_j²)/(2d) of a tile's rotated keys kr [bk, K] (row j: R̄ᵀ k_j) under
    one query head's mean [1, K] and sum of outer products Q [K, K] of its queries (None: the
    linear term alone), inv_count [1, 1] = 1/n, as ``reference.expected_logits`` forms them;
    dot(a, b) is a · bᵀ on the platform's matrix unit."""
    lin = kr * mean
    return lin, None if qq_sum is None else kr * dot(kr, qq_sum) * inv_count


def pending_terms(kr, pending, inv_count, dot):
    """[E, bk] float32 whose column sums are Σ_e (p_e·k'_j)²/n: the share in q_j/n of the queries
    p [E, K] whose outer products the sums Q do not hold yet."""
    pk = dot(pending, kr)  # [E, bk]
    return pk * pk * inv_count


def pad_pending(pending, multiple: int):
    """The pending queries [B, Hk, G, E, K] with zero queries added up to a multiple of
    ``multiple`` (a zero query adds nothing), or None."""
    if pending is None or pending.shape[3] % multiple == 0:
        return pending
    extra = multiple - pending.shape[3] % multiple
    return jnp.pad(pending, ((0, 0),) * 3 + ((0, extra), (0, 0)))


def combine(lin, quad, head_dim: int):
    """The logits from the row sums of ``logit_terms``."""
    z = lin / math.sqrt(head_dim)
    return z if quad is None else z + (quad - lin * lin) / (2 * head_dim)


def check_inputs(k, rotation, mean, qq_sum, count, pending=None) -> tuple[int, int, int, int, int]:
    """(B, Hk, G, S, K) after checking the other arguments' shapes against the keys [B, Hk, S, K];
    raises ValueError naming the argument."""
    shape = logical(k).shape
    if len(shape) != 4:
        raise ValueError(f"k must be [B, Hk, S, K]; got {shape}")
    B, Hk, S, K = shape
    if mean.ndim != 4 or mean.shape[:2] + mean.shape[3:] != (B, Hk, K):
        raise ValueError(f"mean must be (B, Hk, G, K) = ({B}, {Hk}, G, {K}); got {mean.shape}")
    G = mean.shape[2]
    expected = dict(rotation=(B, K, K), qq_sum=(B, Hk, G, K, K), count=(B,))
    for name, x in zip(expected, (rotation, qq_sum, count), strict=True):
        if x is not None and x.shape != expected[name]:
            raise ValueError(f"{name} must be {expected[name]} for k {shape}; got {x.shape}")
    if (qq_sum is None) != (count is None):
        raise ValueError("qq_sum and count go together (both None: the linear term alone)")
    if pending is not None:
        if qq_sum is None:
            raise ValueError("pending queries need qq_sum and count (the quadratic term)")
        if pending.ndim != 5 or pending.shape[:3] + pending.shape[4:] != (B, Hk, G, K):
            raise ValueError(
                f"pending must be (B, Hk, G, E, K) = ({B}, {Hk}, {G}, E, {K}); got {pending.shape}"
            )
    return B, Hk, G, S, K


def stat_specs(G: int, K: int, with_q: bool, pending: int = 0) -> list:
    """The BlockSpecs of ``operands``' statistics on a grid (B, Hk, key tiles): a row's [K, K]
    rotation, a KV head's [G, K] means and [G, K, K] sums, a row's [1, 1] 1/n (None without Q),
    a KV head's [G, E, K] pending queries (None without: ``pending`` = E = 0)."""

    def head(*block):
        return pl.BlockSpec((None, None, *block), lambda b, h, j: (b, h) + (0,) * len(block))

    def row(*block):
        return pl.BlockSpec((None, *block), lambda b, h, j: (b, 0, 0))

    return [
        row(K, K),
        head(G, K),
        head(G, K, K) if with_q else None,
        row(1, 1) if with_q else None,
        head(G, pending, K) if pending else None,
    ]


def operands(rotation, mean, qq_sum, count, pending=None) -> tuple:
    """The statistics as the kernels read them: R̄ᵀ [B, K, K] (a tile's rows then rotate by one
    a · bᵀ product), the means, the sums and 1/n [B, 1, 1] (None without Q), the pending
    queries."""
    inv = None if qq_sum is None else (1.0 / count.astype(jnp.float32))[:, None, None]
    return jnp.swapaxes(rotation, 1, 2), mean, qq_sum, inv, pending
