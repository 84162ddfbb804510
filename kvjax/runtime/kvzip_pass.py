"""KVzip: query-agnostic importance by context reconstruction (Algorithm 1 of
``kvzip-appendix.tex``).

After the context c (n_c tokens) is prefilled, it is cut into chunks of m tokens and each chunk is
fed again as the answer to a repeat prompt — "Repeat the previous context:" + c_1, then "Repeat the
previous context starting with" + the last 8 tokens of c_(t−1) + ":" + c_t — through the model with
the prefilled cache (the repeat tokens take positions n_c, n_c + 1, …; their own keys and values
are discarded afterwards). In every layer, the repeat queries' softmax over [the chunk's keys, the
repeat input's keys (causal)] gives each chunk token the maximum attention it receives over the
queries and over the query heads of its KV head: its score. The "kvpress" form of the prompt
(``kvzip_prompt``) is NVIDIA kvpress's ``KVzipPress``: other wording inside the chat template's
assistant turn, the template's head not repeated, 4 sink tokens in every softmax. The
context-independent mode keeps per head only the maximum over positions (``head_scores``), saved
once from a calibration context and used later with no scoring pass.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.cache.full import FullCache
from kvjax.eviction.kvzip import TRAIL, RepeatPrompt
from kvjax.kernels import NEG_INF
from kvjax.kernels.quantized import values as read
from kvjax.model.config import ModelConfig
from kvjax.model.decoder import decode_hidden
from kvjax.model.params import Params
from kvjax.model.segment import Segment
from kvjax.runtime.jit import jit

CHUNK = 2048  # m: context tokens per repeat input (the paper's 2K)
QUERY_BLOCK = 256  # repeat queries attended and scored at once
# a context shorter than a chunk is fed as one chunk of its length rounded up to this
WIDTH_STEP = 256
# The scores come from the attention's exponentials (shifted by a query's largest visible logit)
# unless some query's exponentials sum to less than e^-SHIFT over the scored slots: then the chunk
# is scored again from the scored logits alone (``RepeatScoring.exact``). Its largest scored logit
# is then within SHIFT + log(slots) of its largest visible one, and a weight rounds to 0 only below
# about e^-(87 − SHIFT − log(slots)) of the largest, where float32's exponential underflows.
SHIFT = 20.0


@struct.dataclass
class RepeatScoring:
    """A full cache fed one repeat input, recording the chunk's scores.

    Fields:
        full: the prefilled full cache (the repeat tokens are written after each row's context).
        scores: [L, B, Hk, C] the scores so far, per cache slot.
        start, stop: [B] the chunk's slots.
        context: [B] each row's context length (the repeat input's first slot).
        far: [] bool, some query's exponentials summed to less than e^-SHIFT over the scored slots.
        sinks: slots below it join every score's softmax.
        exact: the weights from the scored logits alone (``SHIFT``).
    """

    full: FullCache
    scores: jax.Array
    start: jax.Array
    stop: jax.Array
    context: jax.Array
    far: jax.Array
    sinks: int = struct.field(pytree_node=False, default=0)
    exact: bool = struct.field(pytree_node=False, default=False)

    AXES = dict(
        scores=("layers", "batch", "kv_heads", "slots"),
        start=("batch",),
        stop=("batch",),
        context=("batch",),
        far=(),
    )

    def attend(self, layer, q, k, v, seg: Segment):
        """Write k, v [B, T, Hk, K], attend q [B, T, H, K] causally over the context and the repeat
        input, and keep each chunk slot's largest score: its softmax weight among [sinks, chunk,
        repeat input] (the attention's logits over fewer keys), maxed over the queries and the
        group's heads.

        Queries lo … hi − 1 read only the slots below C + hi (C: the context's slots; a row's repeat
        token t sits at its context length + t). One product per block of queries gives the
        attention's numerator and two sums of its exponentials, over all slots and over the scored
        ones: a scored slot's weight is its exponential over the latter (``SHIFT``; ``exact``:
        from the scored logits instead)."""
        B, T, H, K = q.shape
        Hk = k.shape[2]
        C = self.scores.shape[-1]
        full = self.full.write(layer, k, v, seg.positions)
        # [B, Hk, S, K], as attention reads them
        keys, values = (read(x[layer], q.dtype) for x in (full.k, full.v))
        qg = q.reshape(B, T, Hk, H // Hk, K)
        best, outs, far = jnp.zeros((B, Hk, C), jnp.float32), [], self.far
        for lo in range(0, T, QUERY_BLOCK):  # no [T, S] matrix at once
            hi = min(lo + QUERY_BLOCK, T)
            n = min(full.capacity, C + hi)
            slots = jnp.arange(n)
            in_chunk = (slots >= self.start[:, None]) & (slots < self.stop[:, None])  # [B, n]
            scored = in_chunk | (slots < self.sinks) | (slots >= self.context[:, None])
            z = jnp.einsum("bthgk,bhsk->bhgts", qg[:, lo:hi], keys[:, :, :n]).astype(
                jnp.float32
            ) / jnp.sqrt(jnp.float32(K))
            visible = slots[None, None, :] <= seg.positions[:, lo:hi, None]  # [B, hi − lo, n]
            z = jnp.where(visible[:, None, None], z, NEG_INF)
            e = jnp.exp(z - z.max(-1, keepdims=True))
            # [values, 1, scored], in float32 for a bfloat16 model's scores too: XLA:CPU's row sums
            # cost more than this wider product
            sums = jnp.stack([jnp.ones_like(scored), scored], -1)  # [B, n, 2]
            r = jnp.einsum(
                "bhgts,bhsk->bthgk",
                e,
                jnp.concatenate(
                    [
                        values[:, :, :n].astype(jnp.float32),
                        jnp.broadcast_to(sums[:, None], (B, Hk, n, 2)).astype(jnp.float32),
                    ],
                    -1,
                ),
            )  # [B, hi − lo, Hk, G, K + 2]
            outs.append((r[..., :K] / r[..., K : K + 1]).astype(q.dtype))
            valid = seg.valid[:, None, None, lo:hi, None]  # [B, 1, 1, hi − lo, 1]
            if self.exact:
                zs = jnp.where(scored[:, None, None, None], z, NEG_INF)
                w = jnp.exp(zs - zs.max(-1, keepdims=True))
                w = w / w.sum(-1, keepdims=True)
            else:
                kept = r[..., K + 1].transpose(0, 2, 3, 1)[..., None]  # [B, Hk, G, hi − lo, 1]
                far = far | jnp.any(valid & (kept < np.exp(-SHIFT)))
                w = e / kept
            w = jnp.where(valid & in_chunk[:, None, None, None], w, 0.0)
            best = jnp.maximum(best, w.max(axis=(2, 3))[..., :C])
        out = jnp.concatenate(outs, axis=1).reshape(B, T, H, K)
        return out, self.replace(full=full, scores=self.scores.at[layer].max(best), far=far)


@jit
def _score_chunk(
    params: Params, scoring: RepeatScoring, tokens: jax.Array, lengths: jax.Array
) -> RepeatScoring:
    """Feed repeat inputs tokens [B, W] (``lengths`` [B] valid) at positions ``scoring.context``
    [B] + t."""
    positions = scoring.context[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    valid = jnp.arange(tokens.shape[1]) < lengths[:, None]
    _, scoring = decode_hidden(params, tokens, scoring, Segment(positions=positions, valid=valid))
    return scoring


def kvzip_scores(
    params: Params,
    full: FullCache,
    rows: list[np.ndarray],
    prompt: RepeatPrompt,
    chunk: int = CHUNK,
) -> jax.Array:
    """KVzip's score [L, B, Hk, C] of every context token (0 past each row's context and in its
    first ``prompt.skip`` tokens) from the prefilled full cache of the contexts ``rows`` (C slots),
    the repeated part cut in chunks of ``chunk`` tokens. ``full`` is not changed: the repeat inputs
    go to a copy. Contexts that fit in one chunk are fed as one chunk of their longest length
    (rounded up to ``WIDTH_STEP``, to bound recompilation), not padded to ``chunk``."""
    B, skip = len(rows), prompt.skip
    longest = max(len(r) for r in rows)
    # one chunk if it covers every row
    chunk = min(chunk, -(-max(longest - skip, 1) // WIDTH_STEP) * WIDTH_STEP)
    width = chunk + max(len(prompt.first), len(prompt.later) + TRAIL + len(prompt.colon))
    L, _, Hk, C, _ = full.k.shape
    # a copy with room for a repeat input
    grow = [(0, 0)] * 3 + [(0, max(0, longest + width - C)), (0, 0)]
    k, v = (jax.tree.map(lambda x: jnp.pad(x, grow), kv) for kv in (full.k, full.v))
    scoring = RepeatScoring(
        full=full.replace(k=k, v=v),
        scores=jnp.zeros((L, B, Hk, C), jnp.float32),
        start=jnp.zeros(B, jnp.int32),
        stop=jnp.zeros(B, jnp.int32),
        context=jnp.asarray([len(r) for r in rows], jnp.int32),
        far=jnp.zeros((), bool),
        sinks=prompt.sinks,
    )
    for start in range(skip, longest, chunk):
        inputs = [
            prompt.input_for(r, start, min(start + chunk, len(r)))
            if start < len(r)
            else np.zeros(0, np.int32)
            for r in rows
        ]
        tokens = np.zeros((B, width), np.int32)
        for b, ids in enumerate(inputs):
            tokens[b, : len(ids)] = ids
        stop = np.array([min(start + chunk, len(r)) for r in rows], np.int32)
        before = scoring.replace(start=jnp.full(B, start, jnp.int32), stop=jnp.asarray(stop))
        args = jnp.asarray(tokens), jnp.asarray([len(i) for i in inputs], np.int32)
        scoring = _score_chunk(params, before, *args)
        if scoring.far:  # weights that could underflow: this chunk from the scored logits alone
            # (the exact run leaves ``far`` as ``before`` had it: False)
            scoring = _score_chunk(params, before.replace(exact=True), *args).replace(exact=False)
    return scoring.scores


def config_fingerprint(cfg: ModelConfig) -> str:
    """A short hash of a model's configuration: what head scores and saved contexts are checked
    against."""
    return hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16]


def head_scores(scores: jax.Array, lengths) -> np.ndarray:
    """S_head [L, Hk]: each head's largest token score over the contexts (scores [L, B, Hk, C] of
    ``kvzip_scores``; lengths [B])."""
    scores = np.asarray(scores)
    mask = np.arange(scores.shape[-1]) < np.asarray(lengths)[:, None]  # [B, C]
    return np.where(mask[None, :, None], scores, 0.0).max(axis=(1, 3))


def save_head_scores(path: str, scores: np.ndarray, cfg: ModelConfig) -> None:
    """Write head scores [L, Hk] and the model's fingerprint to ``path`` (JSON, atomically)."""
    if np.shape(scores) != (cfg.n_layers, cfg.n_kv_heads):
        raise ValueError(
            f"head scores must be [{cfg.n_layers}, {cfg.n_kv_heads}], got {np.shape(scores)}"
        )
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"model": config_fingerprint(cfg), "scores": np.asarray(scores).tolist()}, f)
    os.replace(tmp, path)


def load_head_scores(path: str, cfg: ModelConfig) -> np.ndarray:
    """Head scores [L, Hk] saved by ``save_head_scores`` for this model; a clear error otherwise."""
    try:
        with open(path) as f:
            saved = json.load(f)
        scores = np.asarray(saved["scores"], np.float64)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"head_scores={path!r} is not a head-scores file of kvjax ({e})") from e
    if saved.get("model") != config_fingerprint(cfg) or scores.shape != (
        cfg.n_layers,
        cfg.n_kv_heads,
    ):
        raise ValueError(
            f"head_scores={path!r} was made for another model "
            f"(fingerprint {saved.get('model')}, shape {scores.shape}); "
            f"this one is {config_fingerprint(cfg)}, "
            f"[{cfg.n_layers}, {cfg.n_kv_heads}]"
        )
    return scores
