"""Quantized keys and values (the ``kv_dtype`` eviction keyword): storage, quantization and its
inverse, shared by the caches, the kernels and their references.

A cache stores keys and values either as arrays in the model's dtype or as ``Quantized``: the codes
and one scale per token and KV head (symmetric, no zero point), so that a slot is written, moved
and evicted with its scale and nothing else in the cache changes shape:

- ``"int8"``: codes round-half-to-even(x / s) in [-127, 127], s = max|x| / 127;
- ``"float8_e4m3fn"``: codes x / s rounded to float8 e4m3fn (round to nearest even), s = max|x| /
  448, the format's largest finite value;
- ``"int4"``: codes round-half-to-even(y / s) in [-7, 7] of y = x H, s = max|y| / 7, two per byte:
  channel j in the low nibble and channel j + K/2 in the high one, so that unpacking is two
  contiguous halves (no interleave in a kernel). H is the K × K Hadamard matrix over √K (symmetric,
  H H = I): it spreads a few outlier channels over all of them, so that one scale per token serves
  them (QuaRot's rotation; at 4 bits the attention output's error on SmolLM2's prose is 0.18 with
  it, 0.33 without, against 0.23 for groups of 32 channels, which cost more than the 0.28x budget:
  docs/results.md, "Quantized keys and values").

The scale is stored in bfloat16 and the codes are computed against the stored scale, so
dequantization (codes × scale, in float32: ``dequantize``, the stored domain) is exact arithmetic on
what is stored; a code past ±qmax saturates. A row of zeros has scale 0 and dequantizes to zeros.
``values`` are the keys or values themselves: the dequantized ones, rotated back by H for "int4".
Attention reads the stored domain: q·k = (q H)·(k H) and Σ w v = (Σ w v H) H, so the kernels'
APIs give it q H and rotate its output back (``rotate``); scores, which depend on logits, weights
and norms, are the same in both domains. Keys and values per token and KV head cost K (int8,
float8) or K/2 (int4) bytes plus 2 for the scale: at K = 64, 0.52x and 0.27x of bfloat16.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

KV_DTYPES = ("int8", "float8_e4m3fn", "int4")
ROTATED = ("int4",)  # stored as x H (H: ``hadamard``)
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "int4": 7.0}
SCALE_DTYPE = jnp.bfloat16
CODE_DTYPES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn, "int4": jnp.uint8}


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["data", "scale"], meta_fields=["kind", "dtype"]
)
@dataclasses.dataclass(frozen=True)
class Quantized:
    """Keys or values [..., K] as codes and scales.

    Fields:
        data: [..., K] int8 or float8_e4m3fn codes; for "int4" [..., K/2] uint8, two codes a byte.
        scale: [..., 1] bfloat16, one per token and KV head.
        kind: one of ``KV_DTYPES`` (static).
        dtype: the dtype its values are read in, the model's (static; ``values``' default).

    The leading axes of both leaves are the logical ones ([L, B, Hk, S] in a cache), so an update
    along them is ``jax.tree.map`` of the array update; ``q[i]`` indexes the leading axes.
    """

    data: jax.Array
    scale: jax.Array
    kind: str
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * (2 if self.kind == "int4" else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [..., K] of the values it holds."""
        return (*self.data.shape[:-1], self.head_dim)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    def __getitem__(self, index) -> Quantized:
        return jax.tree.map(lambda x: x[index], self)


def check_kind(kind: str) -> None:
    if kind not in KV_DTYPES:
        raise ValueError(
            f"kv_dtype={kind!r} must be None (the model's dtype) or one of {KV_DTYPES}"
        )


@functools.lru_cache
def hadamard(n: int) -> np.ndarray:
    """The n × n Hadamard matrix (Sylvester's) over √n, float32: symmetric and orthonormal."""
    if n < 1 or n & (n - 1):
        raise ValueError(
            f"kv_dtype='int4' rotates keys and values by a Hadamard matrix: head_dim {n} must be "
            "a power of two"
        )
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate(x: jax.Array, like) -> jax.Array:
    """x [..., K] in the stored domain of keys or values ``like`` (x H for a rotated
    ``Quantized``; H H = I, so rotating twice gives x back), in x's dtype; else x."""
    if not (isinstance(like, Quantized) and like.kind in ROTATED):
        return x
    h = jnp.asarray(hadamard(x.shape[-1]))
    return jnp.matmul(x.astype(jnp.float32), h, precision="highest").astype(x.dtype)


def codes(x: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """The codes of x [..., K] (float32) against the stored scale [..., 1] (float32), before
    packing: int32 for the integer kinds, float8 for "float8_e4m3fn"."""
    qmax = QMAX[kind]
    scaled = jnp.where(scale > 0, x / jnp.where(scale > 0, scale, 1.0), 0.0)
    if kind == "float8_e4m3fn":
        return jnp.clip(scaled, -qmax, qmax).astype(jnp.float8_e4m3fn)
    return jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int32)


def quantize(x: jax.Array, kind: str) -> Quantized:
    """x [..., K] (any float dtype, which its values are read in) as ``Quantized`` of ``kind``."""
    check_kind(kind)
    if kind == "int4" and x.shape[-1] % 2:
        raise ValueError(
            f"kv_dtype='int4' packs two channels a byte: head_dim {x.shape[-1]} is odd"
        )
    dtype = jnp.dtype(x.dtype).name
    x = x.astype(jnp.float32)
    if kind in ROTATED:
        x = jnp.matmul(x, jnp.asarray(hadamard(x.shape[-1])), precision="highest")
    scale = (jnp.max(jnp.abs(x), -1, keepdims=True) / QMAX[kind]).astype(SCALE_DTYPE)
    c = codes(x, scale.astype(jnp.float32), kind)
    if kind == "int4":
        half = x.shape[-1] // 2
        low, high = c[..., :half] & 0xF, (c[..., half:] & 0xF) << 4
        data = (low | high).astype(jnp.uint8)
    else:
        data = c.astype(CODE_DTYPES[kind])
    return Quantized(data=data, scale=scale, kind=kind, dtype=dtype)


def unpack_int4(data: jax.Array) -> jax.Array:
    """[..., K/2] uint8 -> [..., K] int32 codes in [-8, 7] (low nibbles, then high nibbles)."""
    b = data.astype(jnp.int32)
    low = ((b & 0xF) ^ 8) - 8
    high = (((b >> 4) & 0xF) ^ 8) - 8
    return jnp.concatenate([low, high], -1)


def dequantize(q: Quantized, dtype=jnp.float32) -> jax.Array:
    """[..., K] codes × scale in float32, then ``dtype``: the stored domain (``values`` rotated by
    H for "int4")."""
    c = unpack_int4(q.data) if q.kind == "int4" else q.data
    return (c.astype(jnp.float32) * q.scale.astype(jnp.float32)).astype(dtype)


def values(x, dtype=None) -> jax.Array:
    """What keys or values ``x`` hold: an array as it is (cast to ``dtype`` if given), a
    ``Quantized`` dequantized (to ``dtype``, by default the dtype it was quantized from)."""
    if isinstance(x, Quantized):
        dtype = x.dtype if dtype is None else dtype
        if x.kind not in ROTATED:
            return dequantize(x, dtype)
        return rotate(dequantize(x), x).astype(dtype)
    return x if dtype is None else x.astype(dtype)


def stored(x: jax.Array, like) -> jax.Array | Quantized:
    """x [..., K] as ``like`` stores it: cast to ``like``'s dtype, or quantized as ``like``."""
    if isinstance(like, Quantized):
        return quantize(x.astype(like.dtype), like.kind)
    return x.astype(like.dtype)


def zeros(shape: tuple[int, ...], dtype, kind: str | None):
    """Storage of zeros for keys or values of logical ``shape`` [..., K]: an array of ``dtype``
    (kind None), else ``Quantized`` of ``kind``."""
    if kind is None:
        return jnp.zeros(shape, dtype)
    check_kind(kind)
    width = shape[-1] // 2 if kind == "int4" else shape[-1]
    return Quantized(
        data=jnp.zeros((*shape[:-1], width), CODE_DTYPES[kind]),
        scale=jnp.zeros((*shape[:-1], 1), SCALE_DTYPE),
        kind=kind,
        dtype=jnp.dtype(dtype).name,
    )


def kind_of(x) -> str | None:
    """The ``kv_dtype`` of stored keys or values (None: an array in the model's dtype)."""
    return x.kind if isinstance(x, Quantized) else None


def bytes_per_token(head_dim: int, model_bytes: int, kind: str | None) -> int:
    """Bytes of one token's key and value for one KV head, scales included."""
    if kind is None:
        return 2 * head_dim * model_bytes
    check_kind(kind)
    width = head_dim // 2 if kind == "int4" else head_dim
    return 2 * (width + jnp.dtype(SCALE_DTYPE).itemsize)
