"""Perplexity of a long real text under decoding-time eviction (the StreamingLLM protocol of
OBCache's language-modelling experiment): the text is fed one token at a time, every token predicts
the next, and the cache is cut back to the budget after every token (``n_sink`` first tokens
protected).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.full import FullCache
from kvjax.eval.haystack import pydoc_prose
from kvjax.model.decoder import decode_hidden, logits_from_hidden
from kvjax.model.params import Params
from kvjax.model.segment import Segment
from kvjax.runtime.jit import jit
from kvjax.runtime.options import eviction_from
from kvjax.runtime.protocol import Eviction, decode_segment, step

LOGIT_CHUNK = 256  # positions per logits computation of the full-cache pass


def _nll(params: Params, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """-log p(target) [..., T] from final-normed hidden states [..., T, D]."""
    logits = logits_from_hidden(params, hidden)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


@jit(static_argnames=("kv_dtype",))
def full_cache_nll(params: Params, tokens: jax.Array, kv_dtype: str | None = None) -> jax.Array:
    """[N - 1] negative log-likelihoods of tokens [N] with the full cache (one causal pass; keys
    and values stored as ``kv_dtype`` says)."""
    N = tokens.shape[0]
    cache = FullCache.init(params.config, 1, N, params.dtype, kv_dtype=kv_dtype)
    positions = jnp.arange(N, dtype=jnp.int32)[None]
    hidden, _ = decode_hidden(
        params, tokens[None], cache, Segment(positions=positions, from_start=True)
    )
    hidden, targets = hidden[0, :-1], tokens[1:]
    out = [
        _nll(params, hidden[i : i + LOGIT_CHUNK], targets[i : i + LOGIT_CHUNK])
        for i in range(0, N - 1, LOGIT_CHUNK)
    ]
    return jnp.concatenate(out)


@jit(static_argnames=("ev",))
def evicting_nll(params: Params, tokens: jax.Array, ev: Eviction) -> jax.Array:
    """[N - 1] negative log-likelihoods of tokens [N] fed one at a time as decode steps of
    ``ev``."""
    cache = ev.empty_cache(params.config, 1, ev.decode_spare(0), params.dtype)

    def feed(cache, t):
        seg = decode_segment(ev, t, t[None], jnp.ones(1, bool))
        hidden, cache = step(params, tokens[t][None, None], cache, seg)
        return cache, _nll(params, hidden[0, 0], tokens[t + 1])

    return jax.lax.scan(feed, cache, jnp.arange(tokens.shape[0] - 1, dtype=jnp.int32))[1]


def text_tokens(tokenizer, length: int) -> np.ndarray:
    """The first ``length`` tokens of the real-text haystack (``kvjax.eval.haystack``)."""
    ids = tokenizer(pydoc_prose(), add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        raise ValueError(f"length={length} exceeds the {len(ids)} tokens of the text")
    return np.asarray(ids[:length], np.int32)


def run_perplexity(
    params: Params,
    tokenizer,
    scorers,
    budgets,
    length: int = 4096,
    options: dict | None = None,
    window_edges=(256, 512, 1024, 2048, 4096),
    progress: bool = True,
) -> dict:
    """Perplexity over the text's positions (prev edge, edge] for the full cache and every scorer ×
    budget; ``options``: further eviction keywords (``kvjax.EvictionOptions``) shared by every run.

    Returns {"length", "edges", "full": [ppl per segment],
    "runs": [{"scorer", "budget", "ppl": [...], "seconds"}]}.
    """
    import time

    from tqdm import tqdm

    if length > params.config.max_seq_len:
        raise ValueError(
            f"length={length} exceeds the model's context of {params.config.max_seq_len} tokens"
        )
    edges = [e for e in window_edges if e <= length]
    if not edges or edges[-1] != length:
        edges.append(length)
    tokens = jnp.asarray(text_tokens(tokenizer, length))

    def segments(nll: np.ndarray) -> list[float]:
        bounds = [0] + [e - 1 for e in edges]  # nll[i] scores token i + 1
        return [math.exp(float(nll[a:b].mean())) for a, b in zip(bounds, bounds[1:], strict=False)]

    configs = [(s, b) for s in scorers for b in budgets]
    options = dict(options or {})
    result = {
        "length": length,
        "edges": edges,
        "options": options,
        "full": segments(np.asarray(full_cache_nll(params, tokens, options.get("kv_dtype")))),
        "runs": [],
    }
    for scorer, budget in tqdm(configs, desc="ppl", disable=not progress):
        ev = eviction_from(budget=budget, scorer=scorer, **options).decoding()
        start = time.perf_counter()
        nll = np.asarray(evicting_nll(params, tokens, ev))
        result["runs"].append(
            {
                "scorer": scorer,
                "budget": budget,
                "ppl": segments(nll),
                "seconds": time.perf_counter() - start,
            }
        )
    return result


def perplexity_table(result: dict) -> str:
    """Markdown: one row per run, one column per text segment."""
    edges = result["edges"]
    spans = [f"{a}–{b}" for a, b in zip([0] + edges, edges, strict=False)]
    lines = [
        "| scorer | budget | " + " | ".join(spans) + " |",
        "| --- | ---: |" + " ---: |" * len(spans),
        "| full cache | – | " + " | ".join(f"{p:.2f}" for p in result["full"]) + " |",
    ]
    lines += [
        f"| {r['scorer']} | {r['budget']} | " + " | ".join(f"{p:.2f}" for p in r["ppl"]) + " |"
        for r in result["runs"]
    ]
    return "\n".join(lines)
