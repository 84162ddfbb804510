"""Plain-NumPy reference of the quantized keys and values (``kvjax.kernels.quantized``), written
from its docstring: one bfloat16 scale per token and KV head, max|y| / qmax rounded to bfloat16, of
y = x (int8, float8) or y = x H (int4; H the Hadamard matrix over √K); codes of y / scale in
float32, rounded half to even (int8, int4) or to the nearest float8 e4m3fn (ml_dtypes), clipped at
±qmax; values = codes × scale in float32, times H again for int4."""

import ml_dtypes
import numpy as np

QMAX = {"int8": 127, "float8_e4m3fn": 448, "int4": 7}
ROTATED = ("int4",)


def hadamard(n: int) -> np.ndarray:
    """Sylvester's n × n Hadamard matrix over √n (float32)."""
    h = np.array([[1.0]])
    while len(h) < n:
        h = np.vstack([np.hstack([h, h]), np.hstack([h, -h])])
    return (h / np.sqrt(n)).astype(np.float32)


def quantize(x, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes [..., K] float32, scale [..., 1] float32) of x [..., K] (of x H for int4)."""
    x = np.asarray(x, np.float32)
    if kind in ROTATED:
        x = (x @ hadamard(x.shape[-1])).astype(np.float32)
    qmax = np.float32(QMAX[kind])
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    scale = (absmax / qmax).astype(ml_dtypes.bfloat16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(scale > 0, x / np.where(scale > 0, scale, np.float32(1)), np.float32(0))
    scaled = scaled.astype(np.float32)
    if kind == "float8_e4m3fn":
        codes = np.clip(scaled, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        codes = np.clip(np.rint(scaled), -qmax, qmax).astype(np.float32)
    return codes, scale


def round_trip(x, kind: str | None) -> np.ndarray:
    """The values a cache of ``kind`` holds for x (float64; x itself for kind None)."""
    if kind is None:
        return np.asarray(x, np.float64)
    codes, scale = quantize(x, kind)
    y = (codes * scale).astype(np.float32)
    if kind in ROTATED:
        y = (y @ hadamard(y.shape[-1])).astype(np.float32)
    return y.astype(np.float64)
