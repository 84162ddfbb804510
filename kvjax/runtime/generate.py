"""The public face of generation: ``forward``, ``generate`` and ``generate_stream``."""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kvjax.cache.full import FullCache
from kvjax.model.decoder import decode_hidden, logits_from_hidden
from kvjax.model.params import Params
from kvjax.model.segment import Segment
from kvjax.runtime.context import resume
from kvjax.runtime.decoding import Generation
from kvjax.runtime.inputs import check_context, check_count, check_tokens, config_of
from kvjax.runtime.jit import jit
from kvjax.runtime.options import EvictionOptions
from kvjax.runtime.prefilled import compress_rows
from kvjax.runtime.sampling import Sampling
from kvjax.sharding import auto_mesh, data_size, shard


@jit
def _forward(params: Params, tokens: jax.Array) -> jax.Array:
    B, T = tokens.shape
    cache = FullCache.init(params.config, B, T, params.dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _ = decode_hidden(params, tokens, cache, Segment(positions=positions, from_start=True))
    return logits_from_hidden(params, hidden)


def forward(params: Params, tokens) -> jax.Array:
    """Logits [B, T, V] (float32) of a full causal pass over tokens [B, T] (or [T], read as B=1)."""
    rows, _ = check_tokens(tokens, config_of(params).vocab_size)
    if len({len(r) for r in rows}) != 1:
        raise ValueError("tokens: forward needs rows of equal length")
    return _forward(params, jnp.asarray(np.stack(rows)))


def generate(
    params: Params,
    tokens,
    max_new_tokens: int = 64,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    **eviction,
):
    """New tokens for a prompt (1-D ids -> 1-D array) or a batch (2-D array / list of 1-D -> list
    of arrays).

    ``eviction``: the keywords of ``kvjax.EvictionOptions`` (declared once there, with their
    defaults). ``budget=None`` (the default) keeps the full cache; otherwise every layer keeps at
    most ``budget`` tokens per KV head, chosen by ``scorer`` (``kvjax.SCORERS``; semantics in
    docs/eviction.md) under ``protocol``. Sampling: greedy at temperature 0, else temperature with
    optional top-k / top-p, seeded. Generation stops at ``max_new_tokens`` or after a stop id
    (default: the model's EOS ids), which is included in the output. Rows of a batch are
    right-padded; each row's tokens equal running it alone. ``mesh``: a device mesh
    (``kvjax.sharding.make_mesh``) to run on, the params placed with ``kvjax.shard`` and the batch
    padded to a multiple of its ``data`` axis.
    """
    rows, batched = check_tokens(tokens, config_of(params).vocab_size)
    gen = _generation(
        params,
        rows,
        max_new_tokens,
        Sampling(temperature, top_k, top_p),
        seed,
        stop_ids,
        eviction,
        mesh,
    )
    out = gen.run(gen.max_new)[: len(rows)]
    return out if batched else out[0]


def generate_stream(
    params: Params,
    tokens,
    max_new_tokens: int = 64,
    *,
    every: int = 4,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    **eviction,
) -> Iterator[list[np.ndarray]]:
    """Like ``generate`` (same keywords) but yields each row's newest tokens every ``every`` decode
    steps."""
    rows, _ = check_tokens(tokens, config_of(params).vocab_size)
    every = check_count(every, "every")
    gen = _generation(
        params,
        rows,
        max_new_tokens,
        Sampling(temperature, top_k, top_p),
        seed,
        stop_ids,
        eviction,
        mesh,
    )
    while not gen.finished:
        yield gen.run(every)[: len(rows)]


def _generation(
    params: Params,
    rows: list[np.ndarray],
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    stop_ids: Sequence[int] | None,
    eviction: dict,
    mesh: Mesh | None,
) -> Generation:
    """Validate the rest of a call on its prompt rows (``check_tokens``), prefill them under the
    eviction keywords (a scorer with a scoring pass of its own compresses the whole prompt first, as
    ``kvjax.prefill``) and return the decoding ``Generation``. On a mesh, rows of one pad token fill
    the batch up to a multiple of its ``data`` axis (their outputs come last)."""
    longest = max(len(r) for r in rows)
    options = EvictionOptions.of(**eviction)
    ev = options.resolve(context=longest, model=params)
    mesh = auto_mesh(mesh)
    max_new = check_count(max_new_tokens)
    check_context(params.config, longest, max_new)
    rows = rows + [np.full(1, params.config.pad_token_id, np.int32)] * (
        -len(rows) % data_size(mesh)
    )
    if mesh is not None:
        params = shard(params, mesh)
    if ev is not None and ev.policy.scorer.scoring_pass is not None:
        context = compress_rows(params, rows, True, ev, options.scoring_data(params.config), mesh)
        return resume(params, context, None, max_new, sampling, seed, stop_ids)
    return Generation.from_prompts(
        params, rows, max_new, sampling, seed, stop_ids, ev, mesh, **options.full_cache
    )
