"""Next-token selection: greedy, or temperature with optional top-k / top-p (nucleus) truncation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static sampling settings. temperature=0 is greedy (top_k/top_p ignored); top_k=0 and top_p=1 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k={self.top_k} must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """logits [B, V] float32 -> token ids [B] int32."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    if s.top_k or s.top_p < 1:
        k = min(s.top_k or logits.shape[-1], logits.shape[-1])
        values, ids = jax.lax.top_k(logits, k)  # sorted descending
        if s.top_p < 1:
            probs = jax.nn.softmax(values, axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            values = jnp.where(mass_before < s.top_p, values, -jnp.inf)  # keeps at least the top token
        choice = jax.random.categorical(key, values, axis=-1)
        return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
