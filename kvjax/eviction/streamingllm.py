"""StreamingLLM: the first ``n_sink`` tokens and the most recent ones; no scores."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.eviction.base import Base


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Base):
    name = "streamingllm"
    description = "the n_sink first and the most recent tokens"
    modifiers = ("momentkv-nc",)

    def priority(self, policy, state, pos, unprotected, k, v, order, stats, seen) -> jax.Array:
        """The newest tokens first: the priority is the position."""
        return pos.astype(jnp.float32)
