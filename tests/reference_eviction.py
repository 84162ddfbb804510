"""Plain-NumPy (float64) reference of the eviction semantics of ``docs/eviction.md``.

This module is deliberately independent of the JAX engine (``kvjax.engine``, ``kvjax.budget_cache``,
``kvjax.scorers``, ``kvjax.ops``): it re-implements the decoder of ``kvjax.model`` for one sequence in
float64 NumPy and keeps, per (layer, KV head), a Python list of kept tokens exactly as the contract
describes. Clarity over speed: loops are used wherever they make the semantics easier to check.

Entry point: :func:`run_reference`. Lower-level pieces used by the self-tests: :class:`Reference`,
:func:`select_kept`, :func:`pool_priorities`, :func:`full_forward`.

Readings chosen where ``docs/eviction.md`` leaves room (see the module's tests and report):

* "max over the ``kernel`` neighbours centred on the token": for an even ``kernel`` the window of index
  ``i`` is ``i - kernel // 2 … i - kernel // 2 + kernel - 1`` (PyTorch ``pool1d(padding=kernel // 2)``
  truncated to the input length, as in SnapKV's code). For odd kernels this is the symmetric window.
* Pooling neighbours are the *kept unprotected tokens* only; protected tokens are not neighbours, and
  neighbours past either end of that sequence are "missing".
* ``near_ties`` counts decisions with ``|a - b| <= 1e-6 * max(|a|, |b|)`` (exact ties included, also
  ``0 == 0``); ``exact_ties`` (extra key) counts the subset with ``a == b`` exactly.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.params import params_to_flat
from kvjax.rope import inverse_frequencies

SCORERS = ("streamingllm", "h2o", "tova", "snapkv")
PROTOCOLS = ("blockwise", "prefill")
POOLS = ("max", "avg", "none")
AGGREGATES = ("sum", "mean", "max")
NEAR_TIE_RTOL = 1e-6


# ----------------------------------------------------------------------------------------------------
# The decoder math (float64)
# ----------------------------------------------------------------------------------------------------

def numpy_params(params) -> dict[str, np.ndarray]:
    """``params_to_flat(params)`` as float64 NumPy arrays."""
    return {k: np.asarray(v, dtype=np.float64) for k, v in params_to_flat(params).items()}


def rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    """HF RMSNorm over the last axis: x * rsqrt(mean(x²) + eps) * scale."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE. x: [T, N, K]; positions: [T]."""
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]  # [T, K/2]
    emb = np.concatenate([angles, angles], axis=-1)  # [T, K]
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(z: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; ``-inf`` entries get weight 0."""
    z = z - np.max(z, axis=-1, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=-1, keepdims=True)


def qkv(cfg, w: dict, layer: int, x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray):
    """Queries [T, H, K], keys [T, Hk, K] (both after RoPE) and values [T, Hk, K] of layer ``layer``."""
    h = rms_norm(x, w["layers.attn_norm"][layer], cfg.norm_eps)
    q = np.einsum("td,dhk->thk", h, w["layers.wq"][layer])
    k = np.einsum("td,dhk->thk", h, w["layers.wk"][layer])
    v = np.einsum("td,dhk->thk", h, w["layers.wv"][layer])
    if cfg.qkv_bias:
        q = q + w["layers.bq"][layer]
        k = k + w["layers.bk"][layer]
        v = v + w["layers.bv"][layer]
    if cfg.qk_norm:
        q = rms_norm(q, w["layers.q_norm"][layer], cfg.norm_eps)
        k = rms_norm(k, w["layers.k_norm"][layer], cfg.norm_eps)
    return rope(q, positions, inv_freq), rope(k, positions, inv_freq), v


def finish_layer(cfg, w: dict, layer: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
    """Output projection + residual, then the SiLU-gated MLP + residual. attn: [T, H, K]."""
    x = x + np.einsum("thk,hkd->td", attn, w["layers.wo"][layer])
    h = rms_norm(x, w["layers.mlp_norm"][layer], cfg.norm_eps)
    gated = silu(h @ w["layers.w_gate"][layer]) * (h @ w["layers.w_up"][layer])
    return x + gated @ w["layers.w_down"][layer]


def logits_of(cfg, w: dict, x: np.ndarray) -> np.ndarray:
    """Final norm and output projection of hidden states [..., D] -> [..., V]."""
    h = rms_norm(x, w["final_norm"], cfg.norm_eps)
    return h @ w["embed"].T if "lm_head" not in w else h @ w["lm_head"]


def full_forward(params, tokens) -> np.ndarray:
    """Logits [T, V] of a plain full causal pass (no cache, no eviction), in float64."""
    cfg, w = params.config, numpy_params(params)
    inv_freq = np.asarray(inverse_frequencies(cfg), np.float64)
    tokens = np.asarray(tokens)
    T, G = len(tokens), cfg.n_heads // cfg.n_kv_heads
    positions = np.arange(T)
    causal = positions[None, :] <= positions[:, None]
    x = w["embed"][tokens]
    for layer in range(cfg.n_layers):
        q, k, v = qkv(cfg, w, layer, x, positions, inv_freq)
        attn = np.zeros_like(q)
        for h in range(cfg.n_heads):
            z = q[:, h] @ k[:, h // G].T / np.sqrt(cfg.head_dim)
            attn[:, h] = softmax(np.where(causal, z, -np.inf)) @ v[:, h // G]
        x = finish_layer(cfg, w, layer, x, attn)
    return logits_of(cfg, w, x)


# ----------------------------------------------------------------------------------------------------
# Eviction decision (pure functions, also used directly by the tests)
# ----------------------------------------------------------------------------------------------------

def aggregate_states(states: np.ndarray, aggregate: str) -> np.ndarray:
    """Group aggregate of states [N, G] over the G query heads -> [N]."""
    if aggregate == "sum":
        return states.sum(axis=1)
    if aggregate == "mean":
        return states.mean(axis=1)
    if aggregate == "max":
        return states.max(axis=1)
    raise ValueError(f"aggregate={aggregate!r}")


def pool_priorities(values: np.ndarray, pool: str, kernel: int) -> np.ndarray:
    """SnapKV 1-D pooling of ``values`` [N] (already in position order).

    ``max``: max over the window, neighbours outside 0…N-1 ignored. ``avg``: window sum / kernel, neighbours
    outside count as 0. Window of index i: ``i - kernel // 2 … i - kernel // 2 + kernel - 1``.
    """
    values = np.asarray(values, np.float64)
    if pool == "none":
        return values.copy()
    n, left = len(values), kernel // 2
    out = np.empty(n)
    for i in range(n):
        lo, hi = max(0, i - left), min(n, i - left + kernel)  # [lo, hi) clipped to the sequence
        window = values[lo:hi]
        if pool == "max":
            out[i] = window.max()
        elif pool == "avg":
            out[i] = window.sum() / kernel
        else:
            raise ValueError(f"pool={pool!r}")
    return out


@dataclasses.dataclass
class Decision:
    keep: np.ndarray  # [N] bool, over the input tokens
    priorities: np.ndarray  # [number of unprotected] in position order (after pooling)
    near_tie: bool
    exact_tie: bool


def select_kept(positions, states, *, scorer: str, budget: int, seen: int, n_sink: int, window: int,
                pool: str = "max", kernel: int = 7, aggregate: str = "mean") -> Decision:
    """Which of the kept tokens (``positions`` [N] ascending, ``states`` [N, G]) survive an eviction point."""
    positions = np.asarray(positions, np.int64)
    n = len(positions)
    assert np.all(np.diff(positions) > 0), "kept tokens must be in position order"
    protected = (positions < n_sink) | (positions >= seen - window)
    unprotected = np.flatnonzero(~protected)
    if scorer == "streamingllm":
        prio = positions[unprotected].astype(np.float64)
    else:
        prio = aggregate_states(np.asarray(states, np.float64)[unprotected].reshape(len(unprotected), -1),
                                aggregate)
        if scorer == "snapkv":
            prio = pool_priorities(prio, pool, kernel)
    if n <= budget:
        return Decision(np.ones(n, bool), prio, False, False)
    n_free = budget - int(protected.sum())
    assert 0 < n_free < len(unprotected), "budget > n_sink + window guarantees this"
    # Highest priority first; among equal priorities the later position first.
    order = sorted(range(len(unprotected)), key=lambda i: (prio[i], positions[unprotected[i]]), reverse=True)
    keep = protected.copy()
    keep[unprotected[order[:n_free]]] = True
    last_kept, first_evicted = prio[order[n_free - 1]], prio[order[n_free]]
    gap = abs(last_kept - first_evicted)
    near = bool(gap <= NEAR_TIE_RTOL * max(abs(last_kept), abs(first_evicted)))
    return Decision(keep, prio, near, bool(last_kept == first_evicted))


# ----------------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Slot:
    """One kept token of one (layer, KV head)."""
    position: int
    key: np.ndarray  # [K], after RoPE
    value: np.ndarray  # [K]
    state: np.ndarray  # [G]


class Reference:
    """One sequence through the model with the eviction engine of docs/eviction.md.

    ``budget=None`` means no eviction at all (every eviction point is a no-op).
    """

    def __init__(self, params, *, scorer: str, budget: int | None, protocol: str = "blockwise",
                 block_size: int = 16, n_sink: int = 0, window: int = 0, obs_window: int = 32, pool: str = "max",
                 kernel: int = 7, aggregate: str = "mean", evict_every: int = 1, decode_evict: bool = True):
        if scorer not in SCORERS:
            raise ValueError(f"scorer={scorer!r}; expected one of {SCORERS}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r}; expected one of {PROTOCOLS}")
        if pool not in POOLS:
            raise ValueError(f"pool={pool!r}; expected one of {POOLS}")
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate={aggregate!r}; expected one of {AGGREGATES}")
        for name, val in (("block_size", block_size), ("obs_window", obs_window), ("kernel", kernel),
                          ("evict_every", evict_every)):
            if val < 1:
                raise ValueError(f"{name}={val} must be >= 1")
        if n_sink < 0 or window < 0:
            raise ValueError("n_sink and window must be >= 0")
        if budget is not None and not budget > n_sink + window:
            raise ValueError(f"budget={budget} must exceed n_sink + window = {n_sink + window}")
        self.cfg = cfg = params.config
        self.w = numpy_params(params)
        self.inv_freq = np.asarray(inverse_frequencies(cfg), np.float64)
        self.scorer, self.budget, self.protocol, self.block_size = scorer, budget, protocol, block_size
        self.n_sink, self.window, self.obs_window = n_sink, window, obs_window
        self.pool, self.kernel, self.aggregate = pool, kernel, aggregate
        self.evict_every, self.decode_evict = evict_every, decode_evict

        L, Hk, K = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self.G = cfg.n_heads // cfg.n_kv_heads
        self.cache: list[list[list[Slot]]] = [[[] for _ in range(Hk)] for _ in range(L)]
        self.count = np.zeros((L, Hk), np.int64)
        self.k_sum = np.zeros((L, Hk, K))
        self.v_sum = np.zeros((L, Hk, K))
        self.vk_sum = np.zeros((L, Hk, K, K))  # [i, j] = Σ v_i k_j
        self.seen = 0
        self.near_ties = 0
        self.exact_ties = 0
        # Diagnostics for the tests: every query/key/value ever computed, by layer and position, and a log
        # of every eviction decision.
        self.history = [{"q": {}, "k": {}, "v": {}} for _ in range(L)]
        self.evictions: list[dict] = []

    # -- one step ---------------------------------------------------------------------------------------
    def step(self, tokens, positions, scoring, evict_point: bool) -> np.ndarray:
        """Feed ``tokens`` [T] at consecutive ``positions`` [T]; ``scoring`` [T] bool marks the step's scoring
        queries. Returns the logits [T, V]."""
        cfg, w, G = self.cfg, self.w, self.G
        tokens, positions = np.asarray(tokens), np.asarray(positions, np.int64)
        scoring = np.asarray(scoring, bool)
        assert positions[0] == self.seen and np.all(np.diff(positions) == 1)
        self.seen = int(positions[-1]) + 1
        x = w["embed"][tokens]
        for layer in range(cfg.n_layers):
            q, k, v = qkv(cfg, w, layer, x, positions, self.inv_freq)
            for t, p in enumerate(positions):
                self.history[layer]["q"][int(p)] = q[t].copy()
                self.history[layer]["k"][int(p)] = k[t].copy()
                self.history[layer]["v"][int(p)] = v[t].copy()
            attn = np.zeros_like(q)
            for kh in range(cfg.n_kv_heads):
                slots = self.cache[layer][kh]
                # 1. append
                for t, p in enumerate(positions):
                    slots.append(Slot(int(p), k[t, kh].copy(), v[t, kh].copy(), np.zeros(G)))
                keys = np.stack([s.key for s in slots])
                vals = np.stack([s.value for s in slots])
                kept_pos = np.array([s.position for s in slots])
                visible = kept_pos[None, :] <= positions[:, None]  # [T, N]
                for g in range(G):
                    h = kh * G + g
                    # 2. attend
                    z = q[:, h] @ keys.T / np.sqrt(cfg.head_dim)
                    A = softmax(np.where(visible, z, -np.inf))  # [T, N]
                    attn[:, h] = A @ vals
                    # 3. score update
                    if scoring.any() and self.scorer != "streamingllm":
                        col = A[scoring].sum(axis=0)  # [N]
                        for j, s in enumerate(slots):
                            if self.scorer == "tova":
                                s.state[g] = col[j]
                            else:  # h2o, snapkv
                                s.state[g] += col[j]
                # 4. evict
                if evict_point:
                    self._evict(layer, kh)
            # 5. the rest of the layer (eviction above did not touch this step's attention output)
            x = finish_layer(cfg, w, layer, x, attn)
        return logits_of(cfg, w, x)

    def _evict(self, layer: int, kh: int):
        slots = self.cache[layer][kh]
        if self.budget is None:
            return
        if len(slots) <= self.budget:
            if self.scorer in ("tova", "snapkv"):  # the reset happens at every eviction point
                for s in slots:
                    s.state[:] = 0.0
            return
        positions = [s.position for s in slots]
        states = np.stack([s.state for s in slots])
        d = select_kept(positions, states, scorer=self.scorer, budget=self.budget, seen=self.seen,
                        n_sink=self.n_sink, window=self.window, pool=self.pool, kernel=self.kernel,
                        aggregate=self.aggregate)
        self.near_ties += d.near_tie
        self.exact_ties += d.exact_tie
        evicted = [s for s, keep in zip(slots, d.keep) if not keep]
        kept = [s for s, keep in zip(slots, d.keep) if keep]
        for s in evicted:
            self.count[layer, kh] += 1
            self.k_sum[layer, kh] += s.key
            self.v_sum[layer, kh] += s.value
            self.vk_sum[layer, kh] += np.outer(s.value, s.key)
        if self.scorer in ("tova", "snapkv"):
            for s in kept:
                s.state[:] = 0.0
        self.cache[layer][kh] = kept
        self.evictions.append({"layer": layer, "kv_head": kh, "seen": self.seen, "before": positions,
                               "kept": [s.position for s in kept], "evicted": [s.position for s in evicted],
                               "near_tie": d.near_tie})

    # -- protocols --------------------------------------------------------------------------------------
    def kept_positions(self) -> list[list[list[int]]]:
        return [[sorted(s.position for s in slots) for slots in layer] for layer in self.cache]

    def _prompt_scoring(self, positions: np.ndarray, block_end: int, prompt_len: int) -> np.ndarray:
        if self.scorer == "streamingllm":
            return np.zeros(len(positions), bool)
        if self.scorer == "h2o":
            return np.ones(len(positions), bool)
        end = block_end if self.protocol == "blockwise" else prompt_len
        if self.scorer == "tova":
            return positions == end - 1
        return positions >= end - self.obs_window  # snapkv; W capped by the block / prompt automatically

    def run(self, prompt, max_new_tokens: int) -> dict:
        prompt = [int(t) for t in prompt]
        P, m = len(prompt), self.block_size
        if P < 1:
            raise ValueError("empty prompt")
        kept_after_blocks = []
        logits = None
        for start in range(0, P, m):
            end = min(start + m, P)
            positions = np.arange(start, end)
            scoring = self._prompt_scoring(positions, end, P)
            evict_point = self.protocol == "blockwise" or end == P
            logits = self.step(prompt[start:end], positions, scoring, evict_point)
            if self.protocol == "blockwise":
                kept_after_blocks.append(self.kept_positions())
        if self.protocol == "prefill":
            kept_after_blocks.append(self.kept_positions())
        prefill_logits = logits[-1]
        kept_after_prefill = self.kept_positions()

        tokens, step_logits, kept_after_steps = [], [], []
        tok = int(np.argmax(prefill_logits))
        for s in range(1, max_new_tokens + 1):
            tokens.append(tok)
            evict_point = self.decode_evict and s % self.evict_every == 0
            out = self.step([tok], [P + s - 1], [True], evict_point)[-1]
            step_logits.append(out)
            kept_after_steps.append(self.kept_positions())
            tok = int(np.argmax(out))
        return {
            "prefill_logits": prefill_logits,
            "tokens": tokens,
            "step_logits": step_logits,
            "kept_after_prefill": kept_after_prefill,
            "kept_after_blocks": kept_after_blocks,
            "kept_after_steps": kept_after_steps,
            "moments": {"count": self.count.copy(), "k_sum": self.k_sum.copy(), "v_sum": self.v_sum.copy(),
                        "vk_sum": self.vk_sum.copy()},
            "near_ties": self.near_ties,
            "exact_ties": self.exact_ties,
        }


def run_reference(params, prompt, max_new_tokens, *, scorer, budget, protocol, block_size, n_sink, window,
                  obs_window=32, pool="max", kernel=7, aggregate="mean", evict_every=1,
                  decode_evict=True) -> dict:
    """Prefill ``prompt`` under ``protocol`` then greedily decode ``max_new_tokens`` tokens; see module doc."""
    ref = Reference(params, scorer=scorer, budget=budget, protocol=protocol, block_size=block_size,
                    n_sink=n_sink, window=window, obs_window=obs_window, pool=pool, kernel=kernel,
                    aggregate=aggregate, evict_every=evict_every, decode_evict=decode_evict)
    return ref.run(prompt, max_new_tokens)
