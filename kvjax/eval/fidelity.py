"""Distortion of a compressed cache, with no labels: the context is compressed (prefill protocol),
then a continuation of the same text is fed through the compressed and through the full cache;
compared are every layer's attention outputs (relative error ‖o_c − o_f‖ / ‖o_f‖ over the
continuation's tokens and heads) and the next-token distributions (mean KL(full ‖ compressed) per
token). Errors of early layers propagate into later ones, as they do in use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.cache.full import FullCache
from kvjax.eval.haystack import pydoc_prose
from kvjax.eval.sweep import scorer_options
from kvjax.model.decoder import decode_hidden, logits_from_hidden
from kvjax.model.layer_fields import attend_stacked
from kvjax.model.params import Params
from kvjax.model.segment import Segment
from kvjax.runtime.jit import jit
from kvjax.runtime.protocol import Eviction


@struct.dataclass
class OutputRecorder:
    """Wraps any cache and keeps every layer's attention output of the last ``T`` fed tokens: outs
    [L, B, T, H, K]; a ``kvjax.cache.layout.Cache``."""

    inner: object
    outs: jax.Array

    @property
    def kv(self) -> tuple[jax.Array, jax.Array]:
        return self.inner.kv

    def attend(self, layer, q, k, v, seg):
        out, inner = attend_stacked(self.inner, layer, q, k, v, seg)
        T = self.outs.shape[2]
        return out, OutputRecorder(
            inner=inner, outs=self.outs.at[layer].set(out[:, -T:].astype(self.outs.dtype))
        )


def _recorder(params: Params, inner, B: int, T: int) -> OutputRecorder:
    cfg = params.config
    return OutputRecorder(
        inner=inner, outs=jnp.zeros((cfg.n_layers, B, T, cfg.n_heads, cfg.head_dim), jnp.float32)
    )


@jit(static_argnames=("continuation",))
def full_outputs(params: Params, tokens: jax.Array, continuation: int):
    """Full cache over tokens [1, N]: attention outputs [L, 1, C, H, K] and float32 logits [1, C, V]
    of the last C = ``continuation`` tokens."""
    N = tokens.shape[1]
    rec = _recorder(params, FullCache.init(params.config, 1, N, params.dtype), 1, continuation)
    positions = jnp.arange(N, dtype=jnp.int32)[None]
    hidden, rec = decode_hidden(params, tokens, rec, Segment(positions=positions, from_start=True))
    return rec.outs, logits_from_hidden(params, hidden[:, -continuation:])


@jit(static_argnames=("ev",))
def compressed_outputs(params: Params, cache, tokens: jax.Array, start: jax.Array, ev: Eviction):
    """The continuation tokens [1, C] at positions ``start`` + t, appended to a compressed cache
    without eviction (``ev`` from ``Eviction.without_eviction``): attention outputs and logits as
    ``full_outputs``."""
    C = tokens.shape[1]
    cache = ev.fit(cache, params.config, C)
    positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    seg = Segment(
        positions=positions,
        valid=jnp.ones((1, C), bool),
        seen=start + C,
        evict=False,
        policy=ev.policy,
    )
    hidden, rec = decode_hidden(params, tokens, _recorder(params, cache, 1, C), seg)
    return rec.outs, logits_from_hidden(params, hidden)


def kl_per_token(full_logits: jax.Array, logits: jax.Array) -> jax.Array:
    """KL(p_full ‖ p) per position, in nats."""
    log_p, log_q = jax.nn.log_softmax(full_logits, -1), jax.nn.log_softmax(logits, -1)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def layer_errors(full: jax.Array, compressed: jax.Array) -> np.ndarray:
    """[L] relative error ‖o_c − o_f‖ / ‖o_f‖ per layer over all tokens and heads."""
    axes = tuple(range(1, full.ndim))
    return np.asarray(jnp.sqrt(jnp.sum((compressed - full) ** 2, axes) / jnp.sum(full**2, axes)))


def run_fidelity(
    params: Params,
    tokenizer,
    scorers,
    budgets,
    length: int = 2048,
    continuation: int = 64,
    prompts: int = 2,
    options: dict | None = None,
    progress: bool = True,
) -> dict:
    """Per scorer × budget, averaged over ``prompts`` stretches of the real text (``length`` context
    tokens then ``continuation`` tokens): per-layer relative errors, their mean, and the mean KL per
    token."""
    from tqdm import tqdm

    import kvjax

    ids = tokenizer(pydoc_prose(), add_special_tokens=False)["input_ids"]
    total = length + continuation
    if prompts * total > len(ids):
        raise ValueError(
            f"prompts={prompts} × {total} tokens exceeds the {len(ids)} tokens of the text"
        )
    runs = {
        (s, b): {"scorer": s, "budget": b, "layer_errors": [], "kl": []}
        for s in scorers
        for b in budgets
    }
    for p in tqdm(range(prompts), desc="fidelity", disable=not progress):
        tokens = np.asarray(ids[p * total : (p + 1) * total], np.int32)
        full_outs, full_logits = full_outputs(params, jnp.asarray(tokens)[None], continuation)
        shared = kvjax.prefill_full(params, tokens[:length])
        for (scorer, budget), run in runs.items():
            context = shared.compress(
                budget=budget, scorer=scorer, **scorer_options(scorer, options or {})
            )
            outs, logits = compressed_outputs(
                params,
                context.cache,
                jnp.asarray(tokens[length:])[None],
                jnp.asarray(context.lengths),
                context.ev.without_eviction(),
            )
            run["layer_errors"].append(layer_errors(full_outs, outs))
            run["kl"].append(float(kl_per_token(full_logits, logits).mean()))
    out = []
    for run in runs.values():
        errors = np.mean(run["layer_errors"], axis=0)
        out.append(
            {
                "scorer": run["scorer"],
                "budget": run["budget"],
                "layer_errors": errors.tolist(),
                "mean_error": float(errors.mean()),
                "kl": float(np.mean(run["kl"])),
            }
        )
    return {"length": length, "continuation": continuation, "prompts": prompts, "runs": out}


def fidelity_table(result: dict) -> str:
    """Markdown: mean relative attention-output error over layers and mean KL per token, per run."""
    lines = [
        "| scorer | budget | mean layer error | first / middle / last layer | KL (nats/token) |",
        "| --- | ---: | ---: | --- | ---: |",
    ]
    for r in result["runs"]:
        e = r["layer_errors"]
        lines.append(
            f"| {r['scorer']} | {r['budget']} | {r['mean_error']:.4f} | "
            f"{e[0]:.3f} / {e[len(e) // 2]:.3f} / {e[-1]:.3f} | {r['kl']:.4f} |"
        )
    return "\n".join(lines)
