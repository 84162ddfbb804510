"""Constants and small helpers shared by the kernels and their references (no kernel code here):
score kinds, shape checks, and the quantized keys and values' checks, block specs and
dequantization of a loaded tile."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from kvjax.kernels.quantized import Quantized, dequantize

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


def check_kv(k, v, names: str = "k, v") -> None:
    """k and v must both be arrays or both ``Quantized`` of one kind, with scales [..., 1]: raises
    ValueError naming them (``names``) otherwise."""

    def describe(x):
        return f"Quantized {x.kind!r}" if isinstance(x, Quantized) else "an array"

    quantized = isinstance(k, Quantized), isinstance(v, Quantized)
    if quantized[0] != quantized[1] or (quantized[0] and k.kind != v.kind):
        raise ValueError(
            f"{names} must both be arrays or both Quantized of one kind; got {describe(k)} and "
            f"{describe(v)}"
        )
    for x in (k, v) if quantized[0] else ():
        if x.scale.shape != (*x.data.shape[:-1], 1):
            raise ValueError(
                f"{names}: scales {x.scale.shape} must be [..., 1] of codes {x.data.shape}"
            )


def dequantized(x, dtype):
    """What the references attend over: a ``Quantized`` x dequantized in its stored domain
    (``quantized.dequantize``; the APIs rotate q and the output for it) in ``dtype`` (q's), an array
    as it is."""
    return dequantize(x, dtype) if isinstance(x, Quantized) else x


def logical(x, shape=None) -> jax.ShapeDtypeStruct:
    """A stand-in of keys or values x of logical ``shape`` (default x's [..., K]) for the checks."""
    dtype = x.data.dtype if isinstance(x, Quantized) else x.dtype
    return jax.ShapeDtypeStruct(x.shape if shape is None else shape, dtype)


def kv_spec(x, block_shape: tuple, index_map):
    """The BlockSpec of keys or values x [..., K] in blocks ``block_shape`` [..., K]; for a
    ``Quantized`` x, a ``Quantized`` of the codes' (last dim the codes' width) and the scales'
    ([..., 1]) specs, tiled alike."""
    if not isinstance(x, Quantized):
        return pl.BlockSpec(block_shape, index_map)
    lead = tuple(block_shape[:-1])
    return dataclasses.replace(
        x,
        data=pl.BlockSpec((*lead, x.data.shape[-1]), index_map),
        scale=pl.BlockSpec((*lead, 1), index_map),
    )


def kv_leaves(x) -> tuple:
    """The arrays (or refs) of keys or values: (codes, scales) of a ``Quantized``, else (x,)."""
    return (x.data, x.scale) if isinstance(x, Quantized) else (x,)


def kv_at(x, *index):
    """``x.at[index]`` of a ref, or of both refs of a ``Quantized`` of refs."""
    if isinstance(x, Quantized):
        return dataclasses.replace(x, data=x.data.at[index], scale=x.scale.at[index])
    return x.at[index]


def dequantize_tile(data, scale, kind: str, dtype, join):
    """The values [bk, K] in ``dtype`` of a loaded tile of codes [bk, K] (int4: [bk, K/2] bytes)
    and scales [bk, 1], with ``quantized.dequantize``'s arithmetic: codes × scale in float32, then
    ``dtype``. int4 codes are the sign-extended nibbles, the low ones then the high ones along the
    head dim: ``join(low, high)`` ([bk, K/2] float32 each) concatenates them as the platform
    lowers."""
    if kind == "int4":
        b = data.astype(jnp.int32)
        low = (((b & 0xF) ^ 8) - 8).astype(jnp.float32)
        high = ((((b >> 4) & 0xF) ^ 8) - 8).astype(jnp.float32)
        codes = join(low, high)
    else:
        codes = data.astype(jnp.float32)
    return (codes * scale.astype(jnp.float32)).astype(dtype)


def check_shapes(
    q, k, v, slot_pos, query_pos, query_weights
) -> tuple[int, int, int, int, int, int]:
    """(B, T, H, Hk, S, K) after checking that the shapes agree — k, v arrays or ``Quantized``
    (``check_kv``) of logical shape [B, Hk, S, K] —; raises ValueError otherwise."""
    check_kv(k, v)
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
    check_kv(k, v)
    if v.shape != k.shape:
        raise ValueError(f"k and v must have one shape; got {k.shape}, {v.shape}")
    if layer is None:
        return logical(k)
    if k.ndim != 5:
        raise ValueError(f"with layer, k and v must be [L, B, Hk, S, K]; got {k.shape}, {v.shape}")
    return logical(k, k.shape[1:])


def stacked_layer(k, v, layer):
    """The decode kernels read their layer of stacked k, v [L, B, Hk, S, K] in place (a slice
    handed to a kernel would be a copy of the layer's keys and values every step): (k, v stacked,
    ``layer`` as [1] int32, ``one_layer``'s stand-in). With ``layer`` None, k, v [B, Hk, S, K] are
    read as a stack of one."""
    shape = one_layer(k, v, layer)
    if layer is None:
        k, v, layer = k[None], v[None], 0
    return k, v, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), shape


def every_layer(count) -> bool:
    """Whether MomentKV's statistics whose count is ``count`` are every layer's ([L, B, Hk]: read in
    place at the kernels' layer, as stacked k and v are) or one layer's ([B, Hk])."""
    return count.ndim == 3


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
