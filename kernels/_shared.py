"""Constants and small helpers shared by the kernels and their references (no kernel code here)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

IMPLS = (None, "xla", "pallas", "pallas_tpu", "pallas_gpu")
# The logit of an invisible slot (finite: a fully masked row gives garbage, never NaN).
NEG_INF = -1e30
# What the per-slot score column holds: the attention column, or an OBCache saliency.
SCORE_KINDS = ("attn", "obcache-value", "obcache-key", "obcache-joint")
KEY_KINDS = ("obcache-key", "obcache-joint")  # with the ‖v − o‖² term: they read the outputs o
VALUE_KINDS = ("obcache-value", "obcache-joint")  # with the ‖v‖² term

# Dot dimension numbers: a [M, K] · b [N, K] -> [M, N] (contract the last dims of both, "A Bᵀ").
NT_DIMS = (((1,), (1,)), ((), ()))
NN_DIMS = (((1,), (0,)), ((), ()))


def check_score(score: str) -> None:
    if score not in SCORE_KINDS:
        raise ValueError(f"score={score!r} must be one of {SCORE_KINDS}")


def check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")


def check_shapes(
    q, k, v, slot_pos, query_pos, query_weights
) -> tuple[int, int, int, int, int, int]:
    """(B, T, H, Hk, S, K) after checking that the shapes agree; raises ValueError otherwise."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"q must be [B, T, H, K] and k, v [B, Hk, S, K]; got {q.shape}, {k.shape}, {v.shape}"
        )
    B, T, H, K = q.shape
    _, Hk, S, Kk = k.shape
    if k.shape[0] != B or Kk != K or H % Hk:
        raise ValueError(f"q {q.shape} does not match k/v {k.shape} (H must be a multiple of Hk)")
    if slot_pos.shape != (B, Hk, S):
        raise ValueError(f"slot_pos must be [B, Hk, S] = {(B, Hk, S)}; got {slot_pos.shape}")
    if query_pos.shape != (B, T):
        raise ValueError(f"query_pos must be [B, T] = {(B, T)}; got {query_pos.shape}")
    if query_weights is not None and query_weights.shape != (B, T):
        raise ValueError(f"query_weights must be [B, T] = {(B, T)}; got {query_weights.shape}")
    return B, T, H, Hk, S, K


def one_layer(k, v, layer):
    """A [B, Hk, S, K] stand-in for ``check_shapes`` of one layer of k, v: [L, B, Hk, S, K] with
    ``layer`` (checked), else [B, Hk, S, K] themselves."""
    if layer is None:
        return k
    if k.ndim != 5 or v.shape != k.shape:
        raise ValueError(f"with layer, k and v must be [L, B, Hk, S, K]; got {k.shape}, {v.shape}")
    return jax.ShapeDtypeStruct(k.shape[1:], k.dtype)


def stacked_layer(k, v, layer):
    """The decode kernels read their layer of stacked k, v [L, B, Hk, S, K] in place (a slice
    handed to a kernel would be a copy of the layer's keys and values every step): (k, v stacked,
    ``layer`` as [1] int32, ``one_layer``'s stand-in). With ``layer`` None, k, v [B, Hk, S, K] are
    read as a stack of one."""
    shape = one_layer(k, v, layer)
    if layer is None:
        k, v, layer = k[None], v[None], 0
    return k, v, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), shape


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pad ``x`` at the end of ``axis`` up to ``size`` with ``value`` (no-op when already that
    size)."""
    axis = axis % x.ndim
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)
