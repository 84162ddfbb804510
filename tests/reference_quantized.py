"""Plain-NumPy reference of the quantized keys and values (``kvjax.kernels.quantized``), written
from its docstring: one bfloat16 scale per token and KV head, max|y| / qmax rounded to bfloat16, of
y = x (int8, float8) or y = x H (int4; H the Hadamard matrix over √K); codes of y / scale in
float32, rounded half to even (int8, int4) or to the nearest float8 e4m3fn (ml_dtypes), clipped at
±qmax; values = codes × scale in float32, times H again for int4.

Roundings the reference cannot decide for the engine: the engine computes keys and values in
float32, the reference in float64, and they differ by up to about 2e-6 relative, so a value that
lies that close to a rounding midpoint may round the other way in the engine (measured on an AMD
EPYC, 2026-12-01: an int4 row's scale 2.1e-6 from its bfloat16 midpoint rounded up in the engine
and down here, and the logits differed by 2e-3). A row is *ambiguous* when its scale lies within
``TIE_RTOL`` of its bfloat16 midpoint, or an int4 code within ``TIE_RTOL × qmax`` of its own, or a
normal float8 code within ``TIE_RTOL × |code|`` of its own. int8's codes are left out: with steps
of 1/127 of the row's largest value about 4% of rows of 8 lie that close to some midpoint, too many
to try, and one code off moves one element by one such step. Under ``resolving(flipped)`` every
row quantized is numbered in the order the reference quantizes them, ambiguous rows are recorded,
and rows whose number is in ``flipped`` round each of their ambiguous roundings the other way."""

import contextlib
import itertools
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

QMAX = {"int8": 127, "float8_e4m3fn": 448, "int4": 7}
ROTATED = ("int4",)
TIE_RTOL = 2e-5


@dataclass
class Resolution:
    """One reference run's roundings: ``flipped`` (row numbers) resolved the other way;
    ``ambiguous`` collects the numbers of the ambiguous rows; ``seen`` counts the rows so far."""

    flipped: frozenset = frozenset()
    ambiguous: list = field(default_factory=list)
    seen: int = 0


_RESOLUTION: Resolution | None = None


@contextlib.contextmanager
def resolving(flipped=()):
    """Within: number the rows quantized, record the ambiguous ones, flip those in ``flipped``."""
    global _RESOLUTION
    saved, _RESOLUTION = _RESOLUTION, Resolution(frozenset(flipped))
    try:
        yield _RESOLUTION
    finally:
        _RESOLUTION = saved


def hadamard(n: int) -> np.ndarray:
    """Sylvester's n × n Hadamard matrix over √n (float32)."""
    h = np.array([[1.0]])
    while len(h) < n:
        h = np.vstack([np.hstack([h, h]), np.hstack([h, -h])])
    return (h / np.sqrt(n)).astype(np.float32)


def _step_toward(x, target, dtype):
    """The value of ``dtype`` next to ``x`` (of that dtype) toward ``target``, as float32. Both
    formats hold sign and magnitude, so one more (less) in the bits is the next larger (smaller)
    magnitude."""
    bits = np.asarray(x, np.float32).astype(dtype).view(f"u{np.dtype(dtype).itemsize}")
    sign_bit = bits.dtype.type(1 << (8 * bits.dtype.itemsize - 1))
    outward = np.abs(target) > np.abs(np.asarray(x, np.float32))
    from_zero = (bits & ~sign_bit) == 0  # ±0: the smallest magnitude of the target's sign
    bits = np.where(
        from_zero,
        np.where(target < 0, sign_bit | 1, 1).astype(bits.dtype),
        np.where(outward, bits + 1, bits - 1).astype(bits.dtype),
    )
    return bits.view(dtype).astype(np.float32)


def _near(value, other, exact, rtol_of):
    """Where ``exact`` lies within ``rtol_of`` of the midpoint of ``value`` and ``other``."""
    mid = (value.astype(np.float64) + other) / 2
    return np.abs(exact.astype(np.float64) - mid) < rtol_of


def quantize(x, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes [..., K] float32, scale [..., 1] float32) of x [..., K] (of x H for int4)."""
    x = np.asarray(x, np.float32)
    if kind in ROTATED:
        x = (x @ hadamard(x.shape[-1])).astype(np.float32)
    qmax = np.float32(QMAX[kind])
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    exact = (absmax / qmax).astype(np.float32)
    scale = exact.astype(ml_dtypes.bfloat16).astype(np.float32)
    resolution, numbers = _RESOLUTION, _next_rows(x.shape[:-1])
    if resolution is not None:
        other = _step_toward(scale, exact, ml_dtypes.bfloat16)
        tie = (exact > 0) & _near(scale, other, exact, TIE_RTOL * exact)
        flip = np.isin(numbers, list(resolution.flipped))[..., None]
        scale = np.where(flip & tie, other, scale)

    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(scale > 0, x / np.where(scale > 0, scale, np.float32(1)), np.float32(0))
    scaled = scaled.astype(np.float32)
    if kind == "float8_e4m3fn":
        codes = np.clip(scaled, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        codes = np.clip(np.rint(scaled), -qmax, qmax).astype(np.float32)
    if resolution is not None:
        if kind == "float8_e4m3fn":
            alt = _step_toward(codes, scaled, ml_dtypes.float8_e4m3fn)
            normal = np.abs(codes) >= 2.0**-6
            ties = normal & (np.abs(alt) <= qmax)
            ties &= _near(codes, alt, scaled, TIE_RTOL * np.abs(codes))
        else:
            alt = np.clip(codes + np.sign(scaled - codes), -qmax, qmax).astype(np.float32)
            ties = (kind == "int4") & (alt != codes) & _near(codes, alt, scaled, TIE_RTOL * qmax)
        codes = np.where(flip & ties, alt, codes)
        resolution.ambiguous.extend(int(n) for n in numbers[tie[..., 0] | ties.any(axis=-1)])
    return codes, scale


def _next_rows(rows: tuple) -> np.ndarray | None:
    """Under ``resolving``: the numbers [*rows] of the rows quantized next (counted as seen);
    None outside."""
    if _RESOLUTION is None:
        return None
    numbers = _RESOLUTION.seen + np.arange(int(np.prod(rows))).reshape(rows)
    _RESOLUTION.seen += numbers.size
    return numbers


def round_trip(x, kind: str | None) -> np.ndarray:
    """The values a cache of ``kind`` holds for x (float64; x itself for kind None)."""
    if kind is None:
        return np.asarray(x, np.float64)
    codes, scale = quantize(x, kind)
    y = (codes * scale).astype(np.float32)
    if kind in ROTATED:
        y = (y @ hadamard(y.shape[-1])).astype(np.float32)
    return y.astype(np.float64)


def resolved(run, compare, most: int = 2):
    """The result of ``run()`` that ``compare`` accepts (it raises AssertionError otherwise): the
    plain run's, or, where that fails, a run's with some of the plain run's ambiguous rows
    flipped (each single row, then each pair up to ``most``), so that the engine must equal the
    reference under some resolution of what the reference cannot decide. Raises the plain run's
    failure if none is accepted."""
    with resolving() as plain:
        result = run()
    try:
        compare(result)
        return result
    except AssertionError as failure:
        for n in range(1, most + 1):
            for flipped in itertools.combinations(plain.ambiguous, n):
                with resolving(flipped):
                    result = run()
                try:
                    compare(result)
                    return result
                except AssertionError:
                    continue
        raise failure
