"""Why 7-digit needles come back half right under the SnapKV family (query-aware NIAH,
SmolLM2-135M).

    .venv/bin/python benchmarks/needle_digits.py  # default: 12 samples, about 10 minutes on 2 cores
    .venv/bin/python benchmarks/needle_digits.py --lengths 1024 --haystacks pydoc --indices 2 \
        --detail 1  # ~1 min

Findings: docs/eviction.md ("Why numbers come back half right"); the tables of the committed run:
docs/results/needle_digits.md.

For every sample (RULER single-number: "One of the special magic numbers for {key} is: {7 digits}."
in the pydoc or filler haystack, question inside the compressed prompt) this script

1. prefills the prompt once with kvjax's public API (``kvjax.prefill_full``), answers it with the
   full cache, compresses it with each scorer at a quarter and an eighth of the nominal length
   (``Prefilled.compress``, prefill protocol) and answers without eviction
   (``kvjax.decode(..., evict=False)``), as ``kvjax eval niah`` does in the query-aware setting; an
   answer is *right* (the number appears), *prefix k + drift* (its first digit run starts with the
   needle's first k >= 2 digits, then differs or stops), or *wrong*;
2. reads which of the needle's digit tokens every layer and KV head kept (``context.cache.pos``);
3. prefills the prompt a second time through its own recording cache (a ``FullCache`` wrapper passed
   to ``kvjax.model.decoder.decode_hidden``) that stores each layer's attention of the last
   ``obs_window`` queries: SnapKV's raw scores. From them it recomputes SnapKV's selection (checked
   equal to the engine's) and the score profile over the needle (raw and max-pooled, relative to the
   budget's cut);
4. feeds the full-cache answer teacher-forced through a masked full cache (``MaskedCache``: prompt
   slots visible only where the compressed cache kept them, answer slots always visible; numerically
   the compressed cache with the answer appended) and records every layer's attention of the queries
   that produce each digit: which heads copy the next digit of the needle (induction), and what
   happens to them when that digit was evicted;
5. tries fixes: SnapKV options through the engine (kernel 15 / 31, avg pooling, aggregate="layer",
   window 16 / 64, no pooling) and selections the engine does not offer, simulated on the recorded
   scores and decoded greedily through the masked cache (chunk-level selection: chunks of c aligned
   positions scored by the mean or max of their tokens, whole chunks kept; one-sided "forward"
   max-pooling; two
   oracles: SnapKV plus the needle digits, and the full cache minus the needle's last four digits).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import time
from collections import Counter, defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import kvjax
from kvjax.cache.full import FullCache
from kvjax.eval.niah import make_sample
from kvjax.model.decoder import decode_hidden, logits_from_hidden
from kvjax.model.segment import Segment

NEG_INF = -1e30
SCORERS = ["snapkv", "tova", "h2o", "snapkv+obcache-joint"]
# SnapKV with other options, run by the engine: (label, options)
ENGINE_FIXES = [
    ("snapkv pool=none", {"pool": "none"}),
    ("snapkv kernel=15", {"kernel": 15}),
    ("snapkv kernel=31", {"kernel": 31}),
    ("snapkv pool=avg", {"pool": "avg"}),
    ("snapkv pool=avg kernel=15", {"pool": "avg", "kernel": 15}),
    ("snapkv aggregate=layer", {"aggregate": "layer"}),
    ("snapkv window=16", {"window": 16}),
    ("snapkv window=64", {"window": 64}),
    ("snapkv chunk=8", {"chunk": 8}),
    ("snapkv chunk=16", {"chunk": 16}),
]
# selections simulated on the recorded SnapKV scores: (label, spec)
SIM_FIXES = [
    ("chunk8 mean", ("chunk", 8, "mean")),
    ("chunk8 max", ("chunk", 8, "max")),
    ("chunk16 mean", ("chunk", 16, "mean")),
    ("chunk16 max", ("chunk", 16, "max")),
    ("forward max 11", ("forward", 11)),
    ("oracle: snapkv + needle digits", ("oracle_add",)),
    ("oracle: full - digits 4-7", ("oracle_drop",)),
]


# -----------------------------------------------------------------------------------------------
# caches


@struct.dataclass
class ObsRecorder:
    """A full cache that also records, per layer, the attention weights of the last ``W`` prompt
    queries summed over those queries: col [L, B, H, S], SnapKV's raw score per query head and slot.
    """

    inner: FullCache
    col: jax.Array
    length: jax.Array  # [] the prompt length P (queries P-W .. P-1 score)
    W: int = struct.field(pytree_node=False, default=32)

    def attend(self, layer, q, k, v, seg):
        out, inner = self.inner.attend(layer, q, k, v, seg)
        B, _, H, K = q.shape
        Hk = k.shape[2]
        start = self.length - self.W
        qo = jax.lax.dynamic_slice_in_dim(q, start, self.W, axis=1).reshape(
            B, self.W, Hk, H // Hk, K
        )
        keys = inner.k[layer]  # [B, Hk, S, K], after RoPE
        z = jnp.einsum("bthgk,bhsk->bhgts", qo, keys).astype(jnp.float32) / jnp.sqrt(jnp.float32(K))
        visible = jnp.arange(keys.shape[2])[None, :] <= (start + jnp.arange(self.W))[:, None]
        weights = jax.nn.softmax(jnp.where(visible, z, NEG_INF), axis=-1).sum(3)  # [B, Hk, G, S]
        col = self.col.at[layer].set(weights.reshape(B, H, -1))
        return out, ObsRecorder(inner=inner, col=col, length=self.length, W=self.W)


@struct.dataclass
class MaskedCache:
    """A full cache whose prompt slots are visible only where ``keep`` [L, B, Hk, S] is True (the
    slots of the answer are always True): a compressed cache with the answer appended, without
    eviction. Records every layer's attention weights of the fed queries: attn [L, B, T, H, S]."""

    inner: FullCache
    keep: jax.Array
    attn: jax.Array

    def attend(self, layer, q, k, v, seg):
        _, inner = self.inner.attend(layer, q, k, v, seg)  # writes k, v at their positions
        B, T, H, K = q.shape
        Hk = k.shape[2]
        keys, values = inner.k[layer], inner.v[layer]
        S = keys.shape[2]
        z = jnp.einsum("bthgk,bhsk->bhgts", q.reshape(B, T, Hk, H // Hk, K), keys).astype(
            jnp.float32
        )
        z = z / jnp.sqrt(jnp.float32(K))
        visible = (jnp.arange(S)[None, None, :] <= seg.positions[:, :, None])[
            :, None, None
        ]  # [B,1,1,T,S]
        visible = visible & self.keep[layer][:, :, None, None, :]
        a = jax.nn.softmax(jnp.where(visible, z, NEG_INF), axis=-1)  # [B, Hk, G, T, S]
        out = jnp.einsum("bhgts,bhsk->bthgk", a, values).reshape(B, T, H, K)
        attn = self.attn.at[layer].set(a.transpose(0, 3, 1, 2, 4).reshape(B, T, H, S))
        return out.astype(q.dtype), MaskedCache(inner=inner, keep=self.keep, attn=attn)


@functools.partial(jax.jit, static_argnames=("W",))
def _record_prefill(params, tokens, length, W):
    cfg = params.config
    B, S = tokens.shape
    rec = ObsRecorder(
        inner=FullCache.init(cfg, B, S, params.dtype),
        col=jnp.zeros((cfg.n_layers, B, cfg.n_heads, S), jnp.float32),
        length=length,
        W=W,
    )
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    hidden, rec = decode_hidden(params, tokens, rec, Segment(positions=positions, from_start=True))
    last = jax.lax.dynamic_slice_in_dim(hidden, length - 1, 1, axis=1)[:, 0]
    return rec.inner, rec.col, logits_from_hidden(params, last)


@jax.jit
def _masked_step(params, full, keep, tokens, start):
    """tokens [1, T] at positions start … through the masked cache: logits [1, T, V], attn, the
    cache."""
    cfg = params.config
    T = tokens.shape[1]
    cache = MaskedCache(
        inner=full,
        keep=keep,
        attn=jnp.zeros((cfg.n_layers, 1, T, cfg.n_heads, full.k.shape[3]), jnp.float32),
    )
    positions = start + jnp.arange(T, dtype=jnp.int32)[None]
    hidden, cache = decode_hidden(params, tokens, cache, Segment(positions=positions))
    return logits_from_hidden(params, hidden), cache.attn, cache.inner


class Recorded:
    """One prompt prefilled through ``ObsRecorder``: SnapKV's raw scores and a full cache to decode
    from."""

    def __init__(self, params, ids, W: int, room: int = 64):
        self.params, self.P = params, len(ids)
        bucket = (
            -(-self.P // 256) * 256
        )  # a multiple of 256: the full cache's chunked causal prefill
        self.S = bucket + room
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, : self.P] = ids
        full, col, self.first_logits = _record_prefill(
            params, jnp.asarray(tokens), jnp.int32(self.P), W
        )
        pad = ((0, 0),) * 3 + ((0, room), (0, 0))
        self.full = full.replace(k=jnp.pad(full.k, pad), v=jnp.pad(full.v, pad))
        self.col = np.asarray(col[:, 0, :, : self.P])  # [L, H, P]

    def mask(self, keep: np.ndarray) -> jax.Array:
        """keep [L, Hk, P] -> the MaskedCache mask [L, 1, Hk, S] (answer slots visible)."""
        L, Hk, _ = keep.shape
        out = np.ones((L, 1, Hk, self.S), bool)
        out[:, 0, :, : self.P] = keep
        return jnp.asarray(out)

    def greedy(self, keep: np.ndarray, max_new: int, stop: int) -> list[int]:
        mask, full = self.mask(keep), self.full
        token = int(
            np.argmax(self.first_logits[0])
        )  # the prefill protocol's first token: full attention
        out = [token]
        for t in range(max_new - 1):
            if token == stop:
                break
            logits, _, full = _masked_step(
                self.params, full, mask, jnp.asarray([[token]], jnp.int32), jnp.int32(self.P + t)
            )
            token = int(np.argmax(logits[0, -1]))
            out.append(token)
        return out

    def forced(self, keep: np.ndarray, answer: list[int]):
        """answer[:-1] fed teacher-forced: log-probs [T, V] of the next tokens and attention [L, T,
        H, S]."""
        logits, attn, _ = _masked_step(
            self.params,
            self.full,
            self.mask(keep),
            jnp.asarray([answer[:-1]], jnp.int32),
            jnp.int32(self.P),
        )
        return np.asarray(jax.nn.log_softmax(logits[0], -1)), np.asarray(attn[:, 0])


# ---------------------------------------------------------------------------- selection from the
# scores


def _pool(x: np.ndarray, kernel: int, how: str) -> np.ndarray:
    """Pool [..., n] along the last axis as docs/eviction.md: max ignores missing neighbours, avg
    counts them as 0."""
    if how == "none":
        return x
    r, n = kernel // 2, x.shape[-1]
    fill = -np.inf if how == "max" else 0.0
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(r, r)], constant_values=fill)
    stack = np.stack([padded[..., i : i + n] for i in range(kernel)])
    return stack.max(0) if how == "max" else stack.sum(0) / kernel


def _aggregate(col: np.ndarray, Hk: int, how: str = "mean") -> np.ndarray:
    """[L, H, P] per query head -> [L, Hk, P] per KV head (query head h is in KV head h // G)."""
    L, H, P = col.shape
    if how == "layer":
        return np.broadcast_to(col.mean(1, keepdims=True), (L, Hk, P))
    return col.reshape(L, Hk, H // Hk, P).mean(2)


def _top(priority: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """The k candidates of highest priority, ties to the later position."""
    return candidates[np.lexsort((-candidates, -priority))[:k]]


def snapkv_select(col, Hk, budget, n_sink=4, window=32, kernel=7, pool="max", aggregate="mean"):
    """SnapKV's prefill-protocol selection from raw scores: keep [L, Hk, P], pooled priorities of
    the unprotected positions [L, Hk, n], those positions, and the cut (the lowest kept priority)
    [L, Hk]."""
    L, _, P = col.shape
    s = _aggregate(col, Hk, aggregate)
    unprotected = np.arange(n_sink, P - window)
    prio = _pool(s[:, :, unprotected], kernel, pool)
    keep = np.zeros((L, Hk, P), bool)
    keep[:, :, :n_sink] = keep[:, :, P - window :] = True
    k = budget - n_sink - window
    cut = np.zeros((L, Hk))
    for layer in range(L):
        for h in range(Hk):
            chosen = _top(prio[layer, h], unprotected, k)
            keep[layer, h, chosen] = True
            cut[layer, h] = prio[layer, h, chosen - n_sink].min()
    return keep, prio, unprotected, cut


def chunk_select(col, Hk, budget, chunk, how, n_sink=4, window=32):
    """Chunk-level selection: unprotected positions in aligned chunks of ``chunk``; a chunk's score
    is the mean or max of its tokens' raw scores (KV-head mean); whole chunks kept by score while
    they fit, the slots left over go to the best single tokens."""
    L, _, P = col.shape
    s = _aggregate(col, Hk)
    unprotected = np.arange(n_sink, P - window)
    ids = unprotected // chunk
    first = ids.min()
    n_chunks = ids.max() - first + 1
    keep = np.zeros((L, Hk, P), bool)
    keep[:, :, :n_sink] = keep[:, :, P - window :] = True
    k = budget - n_sink - window
    for layer in range(L):
        for h in range(Hk):
            x = s[layer, h, unprotected]
            sums, counts = np.zeros(n_chunks), np.bincount(ids - first, minlength=n_chunks)
            np.add.at(sums, ids - first, x)
            maxes = np.full(n_chunks, -np.inf)
            np.maximum.at(maxes, ids - first, x)
            score = sums / np.maximum(counts, 1) if how == "mean" else maxes
            left = k
            for c in np.argsort(-score, kind="stable"):
                if counts[c] <= left:
                    keep[layer, h, unprotected[ids - first == c]] = True
                    left -= counts[c]
                if left < 1:
                    break
            if left > 0:
                rest = unprotected[~keep[layer, h, unprotected]]
                keep[layer, h, _top(s[layer, h, rest], rest, left)] = True
    return keep


def forward_select(col, Hk, budget, width, n_sink=4, window=32):
    """One-sided max-pooling: a token's priority is the max raw score of itself and the ``width`` -
    1 tokens before it (a key's score reaches the value that follows it, not the text before it)."""
    L, _, P = col.shape
    s = _aggregate(col, Hk)
    unprotected = np.arange(n_sink, P - window)
    x = s[:, :, unprotected]
    n = x.shape[-1]
    padded = np.pad(x, [(0, 0), (0, 0), (width - 1, 0)], constant_values=-np.inf)
    prio = np.stack([padded[..., i : i + n] for i in range(width)]).max(0)
    keep = np.zeros((L, Hk, P), bool)
    keep[:, :, :n_sink] = keep[:, :, P - window :] = True
    for layer in range(L):
        for h in range(Hk):
            keep[layer, h, _top(prio[layer, h], unprotected, budget - n_sink - window)] = True
    return keep


def keep_from_context(context, P: int) -> np.ndarray:
    """[L, Hk, P] kept prompt positions of a compressed context (batch row 0)."""
    pos = np.asarray(context.cache.pos)[:, 0]  # [L, Hk, slots]
    L, Hk, _ = pos.shape
    keep = np.zeros((L, Hk, P), bool)
    for layer in range(L):
        for h in range(Hk):
            p = pos[layer, h]
            keep[layer, h, p[(p >= 0) & (p < P)]] = True
    return keep


# -----------------------------------------------------------------------------------------
# bookkeeping


@dataclasses.dataclass
class Run:
    method: str
    budget: int | None
    prediction: str
    outcome: str  # "right" | "prefix" | "wrong"
    prefix: int  # leading needle digits of the first digit run
    digits_kept: np.ndarray  # [L, Hk, 7] bool
    logp: np.ndarray | None = None  # [n digits] log p(correct digit) teacher-forced
    copy_mass: np.ndarray | None = None  # [n digits, L, H] attention on the target digit
    attn_top: list | None = None  # per digit step: the copy heads' top position


def classify(prediction: str, answer: str) -> tuple[str, int]:
    run = re.search(r"\d+", prediction)
    got = run.group(0) if run else ""
    prefix = next(
        (i for i, (a, b) in enumerate(zip(got, answer)) if a != b), min(len(got), len(answer))
    )
    if answer in prediction:
        return "right", len(answer)
    return ("prefix" if prefix >= 2 else "wrong"), prefix


def pattern(kept: np.ndarray) -> str:
    """A KV head's kept digits [7] -> all / none / prefix / suffix / prefix+suffix / scattered."""
    n = len(kept)
    if kept.all():
        return "all"
    if not kept.any():
        return "none"
    k = int(np.argmin(kept))  # first missing digit
    if k > 0 and not kept[k:].any():
        return "prefix"
    first = int(np.argmax(kept))
    if kept[first:].all():
        return "suffix"
    j = n - int(np.argmin(kept[::-1]))  # one past the last missing
    if k > 0 and not kept[k:j].any() and kept[j:].all():
        return "prefix+suffix"
    return "scattered"


def needle_span(tokenizer, ids: list[int], answer: str) -> int:
    """Position of the needle's first digit token (SmolLM2 writes each digit as its own token)."""
    digits = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in answer]
    assert all(len(d) == 1 for d in digits), "expected one token per digit"
    digits = [d[0] for d in digits]
    hits = [i for i in range(len(ids) - len(digits) + 1) if ids[i : i + len(digits)] == digits]
    assert len(hits) == 1, f"needle digits found {len(hits)} times"
    return hits[0]


def teacher_forced(rec: Recorded, keep, answer_ids, digit_steps, start):
    """log p(target digit) per digit step and the attention [steps, L, H] on the target digit's
    position."""
    logp, attn = rec.forced(keep, answer_ids)
    lp = np.array([logp[t, answer_ids[t + 1]] for t, _ in digit_steps])
    mass = np.stack([attn[:, t, :, start + i] for t, i in digit_steps])  # [steps, L, H]
    return lp, mass, attn


# ------------------------------------------------------------------------------------------------
# main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--haystacks", nargs="+", default=["pydoc", "filler"])
    parser.add_argument(
        "--n", type=int, default=5, help="depth grid: sample i of n sits at depth i/(n-1)"
    )
    parser.add_argument(
        "--indices", type=int, nargs="+", default=[1, 2, 3], help="which of the n depths"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fractions", type=int, nargs="+", default=[4, 8], help="budget = length // f"
    )
    parser.add_argument("--scorers", nargs="+", default=SCORERS)
    parser.add_argument(
        "--no-fixes", action="store_true", help="skip the engine-option and simulated fixes"
    )
    parser.add_argument(
        "--detail", type=int, default=2, help="samples shown per layer/head in detail"
    )
    parser.add_argument("--max-new", type=int, default=16)
    args = parser.parse_args()
    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    params = kvjax.load(args.model, dtype="float32")
    tok = kvjax.load_tokenizer(args.model)
    cfg = params.config
    L, H, Hk = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads
    eos = tok.eos_token_id
    W = 32

    print("## Tokenization\n")
    for text in ["2789635", " 2789635", 'is: "3957183".']:
        pieces = [tok.decode([i]) for i in tok(text, add_special_tokens=False)["input_ids"]]
        print(f"- `{text}` -> {pieces}")
    print()

    samples = [
        make_sample(tok, "single-number", hay, length, i, args.n, args.seed)
        for length in args.lengths
        for hay in args.haystacks
        for i in args.indices
    ]
    methods = [(s, {}) for s in args.scorers]
    if not args.no_fixes:
        methods += ENGINE_FIXES
    sims = [] if args.no_fixes else SIM_FIXES

    results = []  # per sample: dict
    for n_sample, sample in enumerate(samples):
        ids, answer = list(sample.prompt), sample.answers[0]
        P, start = len(ids), needle_span(tok, list(sample.prompt), answer)
        say(
            f"sample {n_sample + 1}/{len(samples)} {sample.id}: {P} tokens, needle at {start}, "
            f"{answer}"
        )
        shared = kvjax.prefill_full(params, ids)
        full_ids = [int(t) for t in shared.generate(args.max_new)]
        full_text = tok.decode(full_ids, skip_special_tokens=True)
        rec = Recorded(params, ids, W)
        # the answer as the model writes it with the full cache (teacher forcing): digit steps (t,
        # i) = the query of answer token t produces needle digit i
        answer_ids = full_ids if classify(full_text, answer)[0] == "right" else None
        digit_steps = []
        if answer_ids is not None:
            dig = ids[start : start + 7]
            at = next(j for j in range(len(answer_ids)) if answer_ids[j : j + 7] == dig)
            digit_steps = [(at + i - 1, i) for i in range(7) if at + i - 1 >= 0]
        res = {
            "sample": sample,
            "P": P,
            "start": start,
            "full": full_text,
            "col": rec.col,
            "runs": [],
            "answer_ids": answer_ids,
            "digit_steps": digit_steps,
            "ids": ids,
        }
        all_kept = np.ones((L, Hk, P), bool)
        if answer_ids is not None:
            lp, mass, attn_full = teacher_forced(rec, all_kept, answer_ids, digit_steps, start)
            res["full_logp"], res["full_mass"] = lp, mass
        budgets = [sample.length // f for f in args.fractions]

        def add(label, budget, keep, prediction):
            outcome, prefix = classify(prediction, answer)
            run = Run(
                label, budget, prediction, outcome, prefix, keep[:, :, start : start + 7].copy()
            )
            if answer_ids is not None:
                run.logp, run.copy_mass, _ = teacher_forced(
                    rec, keep, answer_ids, digit_steps, start
                )
            res["runs"].append(run)
            res.setdefault("keeps", {})[(label, budget)] = keep[
                :, :, max(0, start - 16) : start + 9
            ].copy()

        for budget in budgets:
            for label, opts in methods:
                scorer = label if not opts else "snapkv"
                context = shared.compress(budget=budget, scorer=scorer, **opts)
                out = kvjax.decode(params, context, None, args.max_new, evict=False)
                keep = keep_from_context(context, P)
                add(label, budget, keep, tok.decode(out, skip_special_tokens=True))
                if label == "snapkv":  # the recorded scores reproduce the engine's choice exactly
                    mine, prio, unprotected, cut = snapkv_select(rec.col, Hk, budget, window=W)
                    res.setdefault("check", []).append(int((mine != keep).sum()))
                    res.setdefault("cut", {})[budget] = cut
                    res.setdefault("prio", {})[budget] = prio[:, :, start - 8 - 4 : start + 9 - 4]
            for label, spec in sims:
                if spec[0] == "chunk":
                    keep = chunk_select(rec.col, Hk, budget, spec[1], spec[2], window=W)
                elif spec[0] == "forward":
                    keep = forward_select(rec.col, Hk, budget, spec[1], window=W)
                elif spec[0] == "oracle_add":
                    keep = snapkv_select(rec.col, Hk, budget, window=W)[0]
                    keep[:, :, start : start + 7] = True  # 7 more slots at most
                else:
                    if budget != budgets[0]:
                        continue
                    keep = np.ones((L, Hk, P), bool)
                    keep[:, :, start + 3 : start + 7] = False
                out = rec.greedy(keep, args.max_new, eos)
                add(
                    label,
                    budget if spec[0] != "oracle_drop" else None,
                    keep,
                    tok.decode(out, skip_special_tokens=True),
                )
        # the prompt tokens around the needle, for the tables
        res["window_tokens"] = [tok.decode([t]) for t in ids[max(0, start - 16) : start + 9]]
        results.append(res)
        say(
            "  full: "
            + repr(full_text)
            + "; "
            + "; ".join(
                f"{r.method}@{r.budget}: {r.prediction.strip()[:12]!r}"
                for r in res["runs"]
                if r.method in args.scorers
            )
        )

    report(results, args, L, H, Hk, W)
    say("done")


# ---------------------------------------------------------------------------------------------
# tables


def report(results, args, L, H, Hk, W):
    fr = args.fractions
    print("## Samples and outcomes (scorers at length/" + " and length/".join(map(str, fr)) + ")\n")
    print(
        "Cells: the first digit run of the answer; ✓ right, `k+` first k digits right then drift, "
        "✗ wrong.\n"
    )
    head = ["sample", "depth", "needle", "full"] + [f"{s} /{f}" for s in args.scorers for f in fr]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for res in results:
        s = res["sample"]
        cells = [
            f"{s.haystack}/{s.length}",
            f"{s.depth:.2f}",
            s.answers[0],
            mark(res["full"], s.answers[0]),
        ]
        for scorer in args.scorers:
            for f in fr:
                run = find(res, scorer, s.length // f)
                cells.append(mark(run.prediction, s.answers[0]))
        print("| " + " | ".join(cells) + " |")
    print()
    checks = [c for res in results for c in res.get("check", [])]
    print(
        f"SnapKV selection recomputed from the recorded scores vs the engine's: {sum(checks)} "
        "positions differ "
        f"over {len(checks)} (sample, budget) pairs × {L} layers × {Hk} KV heads.\n"
    )

    # --- counts per method
    labels = []
    for res in results:
        for r in res["runs"]:
            if r.method not in labels:
                labels.append(r.method)
    print("## Outcome counts per method and budget\n")
    print(
        "right / prefix+drift / wrong over the samples; mean prefix = mean number of leading "
        "needle digits "
        "right; heads all-7 = mean share of (layer, KV head) holding all seven digits; p(next "
        "digit) = mean "
        "teacher-forced probability of the correct digit over the seven digit steps.\n"
    )
    print(
        "| method | budget | right | prefix+drift | wrong | mean prefix | heads all-7 | p(next "
        "digit) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    full_right = sum(
        classify(res["full"], res["sample"].answers[0])[0] == "right" for res in results
    )
    print(
        f"| full | - | {full_right} | - | {len(results) - full_right} | - | 100% | "
        f"{np.mean([np.exp(r['full_logp']).mean() for r in results if 'full_logp' in r]):.2f} |"
    )
    for label in labels:
        for f in fr + [None]:
            runs = [
                r
                for res in results
                for r in res["runs"]
                if r.method == label and (r.budget == (res["sample"].length // f if f else None))
            ]
            if not runs:
                continue
            c = Counter(r.outcome for r in runs)
            allk = np.mean([r.digits_kept.all(-1).mean() for r in runs])
            pnext = [np.exp(r.logp).mean() for r in runs if r.logp is not None]
            print(
                f"| {label} | {'length/' + str(f) if f else '-'} | {c['right']} | {c['prefix']} | "
                f"{c['wrong']} | "
                f"{np.mean([r.prefix for r in runs]):.1f} | {allk:.0%} | "
                f"{np.mean(pnext) if pnext else float('nan'):.2f} |"
            )
    print()

    # --- which digits are kept
    print("## Which needle digits are kept (all samples)\n")
    print(
        "Share of (layer, KV head) pairs that keep needle digit d1 … d7, and the pattern of the "
        "kept digits "
        "per (layer, KV head): all, none, a prefix (d1..dk), a suffix, prefix+suffix, scattered.\n"
    )
    print(
        "| method | budget | d1 | d2 | d3 | d4 | d5 | d6 | d7 | all | prefix | none | suffix | "
        "prefix+suffix | scattered |"
    )
    print("|---|---|" + "---:|" * 13)
    for label in args.scorers + [lab for lab, _ in ENGINE_FIXES[1:3]] + ["chunk16 max"]:
        for f in fr:
            runs = [
                r
                for res in results
                for r in res["runs"]
                if r.method == label and r.budget == res["sample"].length // f
            ]
            if not runs:
                continue
            kept = np.stack([r.digits_kept for r in runs])  # [n, L, Hk, 7]
            pats = Counter(pattern(k) for k in kept.reshape(-1, 7))
            total = sum(pats.values())
            share = kept.reshape(-1, 7).mean(0)
            print(
                f"| {label} | length/{f} | "
                + " | ".join(f"{x:.0%}" for x in share)
                + " | "
                + " | ".join(
                    f"{pats[p] / total:.0%}"
                    for p in ("all", "prefix", "none", "suffix", "prefix+suffix", "scattered")
                )
                + " |"
            )
    print()

    # --- score profile over the needle, all samples
    print("## SnapKV scores over the needle (all samples)\n")
    print(
        "Per (layer, KV head): the raw score (attention of the last 32 queries, mean over the KV "
        "head's 3 "
        "query heads) and the max-pooled priority (kernel 7) of each token from 4 before the first "
        "digit to "
        "one after the last, divided by the budget's cut (the lowest kept priority; >= 1 is kept). "
        "Median "
        "over layers, KV heads and samples, and the share of (layer, KV head) where the token is "
        "kept.\n"
    )
    offs = list(range(-4, 8))
    names = ["key-4", "key-3", "key-2", "key-1"] + [f"d{i}" for i in range(1, 8)] + ["after"]
    for f in fr:
        print(f"budget length/{f}:\n")
        print("| | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        raw_r, pool_r = [], []
        for res in results:
            b = res["sample"].length // f
            if b not in res.get("cut", {}):
                continue
            cut = res["cut"][b][:, :, None]
            s = _aggregate(res["col"], Hk)[:, :, [res["start"] + o for o in offs]]
            raw_r.append((s / cut).reshape(-1, len(offs)))
            pool_r.append(
                (res["prio"][b][:, :, [o + 8 for o in offs]] / cut).reshape(-1, len(offs))
            )
        raw_r, pool_r = np.concatenate(raw_r), np.concatenate(pool_r)
        print(
            "| raw / cut (median) | " + " | ".join(f"{x:.2f}" for x in np.median(raw_r, 0)) + " |"
        )
        print("| raw >= cut | " + " | ".join(f"{x:.0%}" for x in (raw_r >= 1).mean(0)) + " |")
        print(
            "| pooled / cut (median) | "
            + " | ".join(f"{x:.2f}" for x in np.median(pool_r, 0))
            + " |"
        )
        print(
            "| pooled >= cut (kept) | "
            + " | ".join(f"{x:.0%}" for x in (pool_r >= 1).mean(0))
            + " |"
        )
        print()
    # where is the peak that pooling spreads from?
    print(
        "Raw score of each digit relative to the highest raw score among the 8 tokens before the "
        "number "
        "(the key and `is:`), median over (layer, KV head, sample):\n"
    )
    rel = []
    for res in results:
        s = _aggregate(res["col"], Hk)
        key = s[:, :, res["start"] - 8 : res["start"]].max(-1, keepdims=True)
        rel.append((s[:, :, res["start"] : res["start"] + 7] / key).reshape(-1, 7))
    rel = np.concatenate(rel)
    print("| d1 | d2 | d3 | d4 | d5 | d6 | d7 |\n|" + "---:|" * 7)
    print("| " + " | ".join(f"{x:.3f}" for x in np.median(rel, 0)) + " |\n")
    peak = []
    for res in results:
        s = _aggregate(res["col"], Hk)[:, :, res["start"] - 8 : res["start"] + 8]
        peak.append(np.argmax(s, -1).ravel() - 8)
    c = Counter(np.concatenate(peak).tolist())
    print(
        "Offset of the highest raw score among the 16 tokens around the number (0 = d1), share of "
        "(layer, KV head, sample): "
        + ", ".join(f"{o:+d}: {c[o] / sum(c.values()):.0%}" for o in sorted(c))
        + "\n"
    )

    # --- copy heads
    rs = [res for res in results if "full_mass" in res]
    if rs:
        print("## The heads that copy the next digit (full cache, teacher-forced)\n")
        mean_mass = np.stack([res["full_mass"].mean(0) for res in rs])  # [n, L, H]
        avg = mean_mass.mean(0)
        top = np.argsort(-avg.ravel())[:10]
        print(
            "Attention of the query that writes needle digit i on needle digit i's position (the "
            "digit after "
            "the one just written: induction/copy), mean over the 7 digit steps and the samples; "
            "the 10 "
            "strongest query heads:\n"
        )
        print(
            "| layer | query head | KV head | mean attention on the digit to write | samples where "
            ">= 0.5 |"
        )
        print("|---:|---:|---:|---:|---:|")
        for i in top:
            layer, h = divmod(int(i), H)
            print(
                f"| {layer} | {h} | {h // (H // Hk)} | {avg[layer, h]:.2f} | "
                f"{(mean_mass[:, layer, h] >= 0.5).sum()}/{len(rs)} |"
            )
        print()
        print(
            "Teacher-forced, per digit step: is the digit to write kept in the KV heads of the "
            "copy heads "
            "(query heads whose full-cache attention on it is >= 0.5 at that step), and the "
            "probability "
            "of the right digit:\n"
        )
        print(
            "| method | budget | steps | kept in every copy head | p(right) if kept | kept in none "
            "| "
            "p(right) if in none | partly | p(right) if partly |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for label in args.scorers + ["snapkv kernel=31", "chunk16 max"]:
            for f in fr:
                groups = defaultdict(list)
                for res in rs:
                    run = find(res, label, res["sample"].length // f)
                    if run is None or run.logp is None:
                        continue
                    for step in range(len(res["digit_steps"])):
                        heads = np.argwhere(res["full_mass"][step] >= 0.5)
                        if len(heads) == 0:
                            continue
                        i = res["digit_steps"][step][1]
                        kept = [run.digits_kept[layer, h // (H // Hk), i] for layer, h in heads]
                        g = "all" if all(kept) else "none" if not any(kept) else "part"
                        groups[g].append(np.exp(run.logp[step]))
                if not groups:
                    continue
                n = sum(len(v) for v in groups.values())
                cells = []
                for g in ("all", "none", "part"):
                    v = groups.get(g, [])
                    cells += [f"{len(v)}", f"{np.mean(v):.2f}" if v else "-"]
                print(f"| {label} | length/{f} | {n} | " + " | ".join(cells) + " |")
        print()

    # --- details of a few half-right samples
    shown = 0
    for res in results:
        if shown >= args.detail:
            break
        s = res["sample"]
        b = s.length // fr[-1]
        run = find(res, "snapkv", b)
        if run is None or run.outcome != "prefix":
            run = find(res, "snapkv", s.length // fr[0])
            if run is None or run.outcome != "prefix":
                continue
            b = run.budget
        shown += 1
        detail(res, run, b, L, H, Hk)


def detail(res, run, budget, L, H, Hk):
    s = res["sample"]
    start = res["start"]
    lo = max(0, start - 16)
    toks = res["window_tokens"]
    print(
        f"## Detail: {s.id}, snapkv at budget {budget}: {run.prediction.strip()!r} (needle "
        f"{s.answers[0]}, "
        f"full cache {res['full'].strip()!r})\n"
    )
    print(
        "Kept (#) or evicted (.) per layer and KV head, for the 16 tokens before the number, "
        "its 7 digits (between |) and 2 after:\n"
    )
    print("```")
    print("tokens: " + " ".join(repr(t) for t in toks))
    keep = res["keeps"][("snapkv", budget)]
    cut = start - lo
    for layer in range(L):
        cells = []
        for h in range(Hk):
            row = "".join("#" if k else "." for k in keep[layer, h])
            cells.append(row[:cut] + "|" + row[cut : cut + 7] + "|" + row[cut + 7 :])
        print(f"L{layer:02d}  " + "   ".join(cells))
    print("```\n")
    sc = _aggregate(res["col"], Hk)
    cutv = res["cut"][budget]
    prio = res["prio"][budget]
    print(
        "Raw SnapKV score / cut (pooled / cut in brackets) of 4 key tokens, the digits and the "
        "token after, "
        "for the KV heads of the strongest copy heads:\n"
    )
    names = [repr(t) for t in toks[cut - 4 : cut + 8]]
    print("| layer | KV head | " + " | ".join(names) + " |")
    print("|---:|---:|" + "---|" * len(names))
    heads = (
        sorted(
            {
                (int(i) // H, (int(i) % H) // (H // Hk))
                for i in np.argsort(-res["full_mass"].mean(0).ravel())[:6]
            }
        )
        if "full_mass" in res
        else []
    )
    for layer, h in heads:
        cells = [
            f"{sc[layer, h, start + o] / cutv[layer, h]:.2f} "
            f"({prio[layer, h, o + 8] / cutv[layer, h]:.2f})"
            for o in range(-4, 8)
        ]
        print(f"| {layer} | {h} | " + " | ".join(cells) + " |")
    print()
    if run.logp is None:
        return
    print(
        "Teacher-forced answer (the full cache's answer fed to both caches): per digit step, the "
        "probability "
        "of the right digit and, for the 4 strongest copy heads, the attention on the digit to "
        "write "
        "(full → snapkv) and whether the snapkv cache kept it:\n"
    )
    heads = np.argsort(-res["full_mass"].mean(0).ravel())[:4]
    names = [f"L{int(i) // H}.{int(i) % H}" for i in heads]
    print("| step | writes | p full | p snapkv | " + " | ".join(names) + " |")
    print("|---:|---|---:|---:|" + "---|" * len(names))
    for step, (t, i) in enumerate(res["digit_steps"]):
        cells = []
        for x in heads:
            layer, h = divmod(int(x), H)
            kept = run.digits_kept[layer, h // (H // Hk), i]
            cells.append(
                f"{res['full_mass'][step, layer, h]:.2f} → {run.copy_mass[step, layer, h]:.2f} "
                f"{'kept' if kept else 'EVICTED'}"
            )
        print(
            f"| {step} | d{i + 1}={s.answers[0][i]} | {np.exp(res['full_logp'][step]):.2f} | "
            f"{np.exp(run.logp[step]):.2f} | " + " | ".join(cells) + " |"
        )
    print()


def find(res, label, budget):
    return next((r for r in res["runs"] if r.method == label and r.budget == budget), None)


def mark(prediction: str, answer: str) -> str:
    outcome, prefix = classify(prediction, answer)
    got = re.search(r"\d+", prediction)
    got = got.group(0) if got else "-"
    return (
        f"{got} ✓"
        if outcome == "right"
        else f"{got} {prefix}+"
        if outcome == "prefix"
        else f"{got[:10]} ✗"
    )


if __name__ == "__main__":
    main()
