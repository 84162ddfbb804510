"""The public face of generation: ``forward``, ``generate`` and ``generate_stream``."""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import FullCache, Segment
from kvjax.decoding import Generation
from kvjax.inputs import check_tokens
from kvjax.model import decode_hidden, logits_from_hidden
from kvjax.options import eviction_from
from kvjax.params import Params
from kvjax.sampling import Sampling


@jax.jit
def _forward(params: Params, tokens: jax.Array) -> jax.Array:
    B, T = tokens.shape
    cache = FullCache.init(params.config, B, T, params.dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _ = decode_hidden(params, tokens, cache, Segment(positions=positions, from_start=True))
    return logits_from_hidden(params, hidden)


def forward(params: Params, tokens) -> jax.Array:
    """Logits [B, T, V] (float32) of a full causal pass over tokens [B, T] (or [T], read as B=1)."""
    rows, _ = check_tokens(tokens, params.config.vocab_size)
    if len({len(r) for r in rows}) != 1:
        raise ValueError("tokens: forward needs rows of equal length")
    return _forward(params, jnp.asarray(np.stack(rows)))


def generate(params: Params, tokens, max_new_tokens: int = 64, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop_ids: Sequence[int] | None = None, **eviction):
    """New tokens for a prompt (1-D ids -> 1-D array) or a batch (2-D array / list of 1-D -> list of arrays).

    ``eviction``: the keywords of ``kvjax.EvictionOptions`` (declared once there, with their defaults).
    ``budget=None`` (the default) keeps the full cache; otherwise every layer keeps at most ``budget`` tokens
    per KV head, chosen by ``scorer`` (``kvjax.SCORERS``; semantics in docs/eviction.md) under ``protocol``.
    Sampling: greedy at temperature 0, else temperature with optional top-k / top-p, seeded. Generation stops
    at ``max_new_tokens`` or after a stop id (default: the model's EOS ids), which is included in the output.
    Rows of a batch are right-padded; each row's tokens equal running it alone.
    """
    ev = eviction_from(**eviction)
    rows, batched = check_tokens(tokens, params.config.vocab_size)
    gen = Generation.from_prompts(params, rows, max_new_tokens, Sampling(temperature, top_k, top_p), seed,
                                  stop_ids, ev)
    out = gen.run(gen.max_new)
    return out if batched else out[0]


def generate_stream(params: Params, tokens, max_new_tokens: int = 64, *, chunk: int = 4, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_ids: Sequence[int] | None = None,
                    **eviction) -> Iterator[list[np.ndarray]]:
    """Like ``generate`` (same keywords) but yields each row's newest tokens every ``chunk`` decode steps."""
    ev = eviction_from(**eviction)
    rows, _ = check_tokens(tokens, params.config.vocab_size)
    gen = Generation.from_prompts(params, rows, max_new_tokens, Sampling(temperature, top_k, top_p), seed,
                                  stop_ids, ev)
    while not gen.finished:
        yield gen.run(chunk)
