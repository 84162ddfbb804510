"""Next-token selection, the one sampler of every decode loop: greedy, or temperature with optional
top-k / top-p (nucleus) truncation, set once for a batch (``Sampling``) or per row (serving)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.runtime.inputs import plain_numbers


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static sampling settings.

    Fields:
        temperature: 0 is greedy (top_k/top_p ignored).
        top_k: 0 is off.
        top_p: 1 is off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        plain_numbers(self)
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k={self.top_k} must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def sample(logits: jax.Array, key: jax.Array, s) -> jax.Array:
    """logits [B, V] float32 -> token ids [B] int32: greedy at temperature 0, else a draw at the
    temperature among the ``top_k`` likeliest tokens whose probability mass before them is below
    ``top_p``.

    s: a ``Sampling`` (one setting for the batch, fixed when compiling) with ``key`` one PRNG key
    for the batch; or per-row settings (``temperature``, ``top_p`` [B] float32, ``top_k`` [B] int32:
    the serving engine's ``Settings``) with ``key`` [B] PRNG keys, one per row.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if isinstance(s, Sampling):
        return greedy if s.temperature == 0 else _draw(logits, key, s)
    hot = s.temperature > 0
    return jax.lax.cond(
        jnp.any(hot), lambda: jnp.where(hot, _draw(logits, key, s), greedy), lambda: greedy
    )


def _draw(logits: jax.Array, key: jax.Array, s) -> jax.Array:
    """One draw per row of logits [B, V] -> ids [B] int32 (settings and keys as ``sample``): a
    categorical over the vocabulary, in vocabulary order, at the temperature, the tokens that top-k
    and top-p leave out masked. A ``Sampling`` and per-row settings draw alike, so a request served
    with a seed gets the tokens ``kvjax.generate`` gets with it; a ``Sampling`` fixes when compiling
    how many candidates top-k sorts."""
    fixed, V = isinstance(s, Sampling), logits.shape[-1]
    scaled = logits / (
        s.temperature if fixed else jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    )
    if fixed and not s.top_k and s.top_p == 1:  # nothing truncated
        return _categorical(key, scaled)
    values, ids = jax.lax.top_k(scaled, min(s.top_k or V, V) if fixed else V)  # sorted descending
    keep = (
        jnp.ones(values.shape, bool)
        if fixed  # every candidate is within the fixed top k
        else jnp.arange(V) < jnp.where(s.top_k > 0, s.top_k, V)[:, None]
    )
    if not fixed or s.top_p < 1:
        probs = jax.nn.softmax(jnp.where(keep, values, -jnp.inf), axis=-1)
        top_p = s.top_p if fixed else s.top_p[:, None]
        keep &= jnp.cumsum(probs, axis=-1) - probs < top_p  # keeps at least the top token
    rows = jnp.arange(keep.shape[0])[:, None]
    keep = jnp.zeros(logits.shape, bool).at[rows, ids].set(keep)  # in vocabulary order
    return _categorical(key, jnp.where(keep, scaled, -jnp.inf))


def _categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """A draw per row of logits [B, C] -> [B] int32: ``key`` one key for the batch or [B] keys."""
    draw = jax.random.categorical if key.ndim == 0 else jax.vmap(jax.random.categorical)
    return draw(key, logits).astype(jnp.int32)
