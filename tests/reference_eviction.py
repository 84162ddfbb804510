"""Plain-NumPy (float64) reference of the eviction semantics of ``docs/eviction.md``.

This module is deliberately independent of the JAX engine (``kvjax.runtime.protocol``,
``kvjax.cache.dense``, ``kvjax.eviction``, ``kvjax.kernels``): it re-implements the decoder of
``kvjax.model.decoder`` for one sequence in float64 NumPy and keeps, per (layer, KV head), a Python
list of kept tokens exactly as the contract describes. Clarity over speed: loops are used wherever
they make the semantics easier to check.

Entry points: :func:`run_reference`; :func:`run_kvzip_reference` for KVzip's names (``kvzip``,
``kvzip-head``: a repeat pass of their own, :func:`repeat_scores`). Lower-level pieces used by the
self-tests: :class:`Reference`, :func:`parse_scorer`, :func:`select_kept`, :func:`keep_highest`,
:func:`pool_priorities`, :func:`attention`, :func:`obcache_columns`, :func:`caote_priorities`,
:func:`select_moment_informed`, :func:`moment_terms`, :func:`nc_correct`, :func:`full_forward`.

One oracle entry per base scorer (:class:`OracleBase` and its subclasses, registered in
:data:`ORACLE_BASES`) and per modifier (:class:`OracleModifier`'s, in :data:`ORACLE_MODIFIERS`), as
the engine registers its own: what the base's state accumulates and how it ranks, what the modifier
changes. Scorer names (the grammar of docs/eviction.md, "Modifiers"): a base, ``base+modifier`` for
each modifier the base takes, and the alias ``momentkv`` = ``snapkv+momentkv``. See :data:`SCORERS`.

Readings chosen where ``docs/eviction.md`` leaves room (see the module's tests and report):

* "max over the ``kernel`` neighbours centred on the token": for an even ``kernel`` the window of
  index ``i`` is ``i - kernel // 2 … i - kernel // 2 + kernel - 1`` (PyTorch
  ``pool1d(padding=kernel // 2)`` truncated to the input length, as in SnapKV's code). For odd
  kernels this is the symmetric window.
* Pooling neighbours are the *kept unprotected tokens* only; protected tokens are not neighbours,
  and neighbours past either end of that sequence are "missing".
* ``near_ties`` counts decisions with ``|a - b| <= 1e-6 * max(|a|, |b|)`` (exact ties included, also
  ``0 == 0``); ``exact_ties`` (extra key) counts the subset with ``a == b`` exactly. A top-``b``
  selection is one decision (last kept vs first evicted); under MomentKV MI every single eviction is
  one decision (the chosen minimum vs the next smallest score).
* OBCache: ``z_ij`` is the raw logit ``q·k/√d`` (not shifted); tokens a scoring query cannot see
  have ``A_ij = 0`` and contribute nothing (their ``A_ij z_ij`` is taken as 0).
* CAOTE: ``c_j = +inf`` where ``h_j = 1`` (the token holds all of the normalised mass; the doc's
  formula divides by zero there). Unreachable with softmax states unless every other weight
  underflows to 0.
* MomentKV MI: the base priorities ``P_j`` are computed once per eviction point, over the kept
  unprotected tokens at its start (snapkv pooling is *not* redone after each single eviction); only
  the residuals are recomputed, from the statistics updated by each single eviction.
* MomentKV NC: ``1 − ŵ`` is computed as ``1 − exp(log ŵ)``.
"""

from __future__ import annotations

import dataclasses
import decimal
import sys

import numpy as np
from reference_quantized import round_trip

from kvjax.model.params import params_to_flat
from kvjax.model.rope import inverse_frequencies

# Expected Attention: future positions its mean rotation averages over (kvpress's default)
EA_FUTURE = 512
PROTOCOLS = ("blockwise", "prefill")
POOLS = ("max", "avg", "none")
AGGREGATES = ("sum", "mean", "max", "layer")
ALLOCATIONS = ("uniform", "pyramidkv", "adakv", "global")
NEAR_TIE_RTOL = 1e-6
S_TILDE_CLAMP = 1e-6  # NC: entries of S̃ of magnitude below this are set to 0 (App. C.2)


# --------------------------------------------------------------------------------------------------
# One oracle entry per base scorer and per modifier (docs/eviction.md), registered below:
# ORACLE_BASES, ORACLE_MODIFIERS. Their math functions follow further down.
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OracleBase:
    """A base scorer: which prompt queries score (``queries``: "none", "all", "last" of the span,
    "window": its last ``obs_window``; decoding queries always score unless "none"), whether a
    step's column replaces the state (``replace``) or adds to it, whether the state resets at every
    eviction point (``resets``), whether its aggregated priorities are pooled along positions
    (``pools``), the modifiers it takes. Its priority: the aggregated state (pooled if ``pools``).
    """

    name: str
    queries: str
    replace: bool = False
    resets: bool = False
    pools: bool = False
    modifiers: tuple[str, ...] = ()

    def priorities(
        self, positions, states, protected, *, pool, kernel, aggregate, ref=None, layer=0, kh=0
    ):
        """Priorities of the unprotected tokens (in position order); ``ref``, ``layer``, ``kh``: the
        :class:`Reference` it runs in (for bases that read more than the state)."""
        unprotected = np.flatnonzero(~np.asarray(protected, bool))
        prio = aggregate_states(
            np.asarray(states, np.float64)[unprotected].reshape(len(unprotected), -1), aggregate
        )
        return pool_priorities(prio, pool, kernel) if self.pools else prio

    def observe(self, ref, layer: int, x: np.ndarray, positions: np.ndarray) -> None:
        """Statistics of its own from a step's hidden states x [T, D] (none by default)."""


@dataclasses.dataclass(frozen=True)
class ByPosition(OracleBase):
    """StreamingLLM: the later position first."""

    def priorities(self, positions, states, protected, **_):
        return np.asarray(positions, np.int64)[~np.asarray(protected, bool)].astype(np.float64)


@dataclasses.dataclass(frozen=True)
class ExpectedAttentionOracle(OracleBase):
    """Expected Attention: statistics of the queries before RoPE past the sinks;
    :func:`expected_attention_priorities`."""

    def observe(self, ref, layer, x, positions):
        raw = qkv(ref.cfg, ref.w, layer, x, np.zeros_like(positions), ref.inv_freq)[0]
        ref.raw_queries[layer] += [raw[t] for t, p in enumerate(positions) if p >= ref.n_sink]

    def priorities(self, positions, states, protected, *, aggregate, ref=None, layer=0, kh=0, **_):
        slots = ref.cache[layer][kh]
        raw = np.asarray(ref.raw_queries[layer]).reshape(-1, ref.cfg.n_heads, ref.cfg.head_dim)
        return expected_attention_priorities(
            positions,
            np.stack([s.key for s in slots]),
            np.stack([s.value for s in slots]),
            raw[:, kh * ref.G : (kh + 1) * ref.G],
            protected,
            seen=ref.seen,
            n_sink=ref.n_sink,
            inv_freq=ref.inv_freq,
            aggregate=aggregate,
        )


@dataclasses.dataclass(frozen=True)
class OracleModifier:
    """A modifier: what it changes in its base. ``OracleModifier()`` changes nothing."""

    name: str = ""
    moment_informed: bool = False  # its eviction is Algorithm 1's loop (select_moment_informed)

    def column(self, A: np.ndarray, z: np.ndarray, values: np.ndarray, o: np.ndarray) -> np.ndarray:
        """The per-slot column [N] a step's scoring queries add (A, z [n, N]; values [N, K]; o [n,
        K])."""
        return A.sum(axis=0)

    def priorities(
        self, base: OracleBase, positions, states, values, protected, **opts
    ) -> np.ndarray:
        """Priorities of the unprotected tokens: the base's."""
        return base.priorities(positions, states, protected, **opts)

    def correct(self, q: np.ndarray, o: np.ndarray, log_z: np.ndarray, moments) -> np.ndarray:
        """The attention output the layer uses (o [T, K] of queries q, log-normaliser log_z [T])."""
        return o

    @property
    def wraps_priority(self) -> bool:
        return type(self).priorities is not OracleModifier.priorities


@dataclasses.dataclass(frozen=True)
class OBCacheOracle(OracleModifier):
    """OBCache: its saliency (:func:`obcache_columns`) replaces the attention column; summed over
    the heads."""

    def column(self, A, z, values, o):
        return obcache_columns(self.name.removeprefix("obcache-"), A, z, values, o)


@dataclasses.dataclass(frozen=True)
class CAOTEOracle(OracleModifier):
    """CAOTE / FastCAOTE: :func:`caote_priorities` over the base's state."""

    fast: bool = False

    def priorities(
        self, base, positions, states, values, protected, *, pool, kernel, aggregate, **_
    ):
        return caote_priorities(
            states,
            values,
            protected,
            base=base.name,
            fast=self.fast,
            pool=pool,
            kernel=kernel,
            aggregate=aggregate,
        )


@dataclasses.dataclass(frozen=True)
class MomentKVOracle(OracleModifier):
    """MomentKV: moment-informed eviction (``moment_informed``) and the normalization-corrected
    output (``nc``), zeroth order when ``zeroth``."""

    nc: bool = False
    zeroth: bool = False

    def correct(self, q, o, log_z, moments):
        return nc_correct(q, o, log_z, moments, zeroth=self.zeroth) if self.nc else o


ORACLE_MODIFIERS = {
    m.name: m
    for m in (
        OBCacheOracle("obcache-value"),
        OBCacheOracle("obcache-key"),
        OBCacheOracle("obcache-joint"),
        CAOTEOracle("caote"),
        CAOTEOracle("fastcaote", fast=True),
        MomentKVOracle("momentkv", moment_informed=True, nc=True),
        MomentKVOracle("momentkv-mi", moment_informed=True),
        MomentKVOracle("momentkv-nc", nc=True),
        MomentKVOracle("momentkv-zeroth", moment_informed=True, nc=True, zeroth=True),
    )
}
MODIFIERS = tuple(ORACLE_MODIFIERS)
OBCACHE = tuple(m for m, s in ORACLE_MODIFIERS.items() if isinstance(s, OBCacheOracle))
CAOTE = tuple(m for m, s in ORACLE_MODIFIERS.items() if isinstance(s, CAOTEOracle))
MOMENTKV = tuple(m for m, s in ORACLE_MODIFIERS.items() if isinstance(s, MomentKVOracle))
ORACLE_BASES = {
    b.name: b
    for b in (
        ByPosition("streamingllm", "none", modifiers=("momentkv-nc",)),
        OracleBase("h2o", "all", modifiers=MODIFIERS),
        OracleBase("h2o-window", "window", modifiers=MODIFIERS),
        OracleBase("tova", "last", replace=True, resets=True, modifiers=MODIFIERS),
        OracleBase("snapkv", "window", resets=True, pools=True, modifiers=MODIFIERS),
        ExpectedAttentionOracle("expected-attention", "none"),
    )
}
BASES = tuple(ORACLE_BASES)
NEW_BASES = (
    "expected-attention",
)  # bases added after the seed grammar of SCORERS; valid names too
ALIASES = {"momentkv": "snapkv+momentkv"}
# Every scorer name of the seed grammar: its bases, each base+modifier a base takes, the aliases.
SCORERS = (
    tuple(b for b in BASES if b not in NEW_BASES)
    + tuple(f"{b}+{m}" for b, spec in ORACLE_BASES.items() for m in spec.modifiers)
    + tuple(ALIASES)
)


def parse_scorer(name: str) -> tuple[str, str | None]:
    """``(base, modifier)`` of a scorer name (``modifier`` None for a plain base); ValueError if
    invalid."""
    if name not in SCORERS + NEW_BASES:
        raise ValueError(f"scorer={name!r}; expected one of {SCORERS + NEW_BASES}")
    name = ALIASES.get(name, name)
    base, _, modifier = name.partition("+")
    return base, modifier or None


def kept_sums(scorer: str) -> tuple[str, ...]:
    """The ``Moments`` sums a cache keeps under ``scorer`` (any base, KVzip's included): none
    unless MomentKV reads them, and no Σ v kᵀ for its zeroth order."""
    modifier = ORACLE_MODIFIERS.get(ALIASES.get(scorer, scorer).rpartition("+")[2])
    if not isinstance(modifier, MomentKVOracle):
        return ()
    return ("k_sum", "v_sum") if modifier.zeroth else ("k_sum", "v_sum", "vk_sum")


def assert_kept_sums(moments, scorer: str) -> tuple[str, ...]:
    """``kept_sums(scorer)``, after checking that ``moments`` keeps those sums (non-empty) and no
    others (K = 0)."""
    sums = kept_sums(scorer)
    sizes = {name: getattr(moments, name).size for name in ("k_sum", "v_sum", "vk_sum")}
    assert {name for name, size in sizes.items() if size} == set(sums), (scorer, sizes)
    return sums


def default_aggregate(scorer: str) -> str:
    """``sum`` for the OBCache modifiers (OBCache App. B.5), ``mean`` otherwise."""
    return (
        "sum"
        if isinstance(ORACLE_MODIFIERS.get(parse_scorer(scorer)[1]), OBCacheOracle)
        else "mean"
    )


# --------------------------------------------------------------------------------------------------
# The decoder math (float64)
# --------------------------------------------------------------------------------------------------


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
    """Queries [T, H, K], keys [T, Hk, K] (both after RoPE) and values [T, Hk, K] of layer
    ``layer``."""
    h = rms_norm(x, w["layers.attn_norm"][layer], cfg.norm_eps)
    # wqkv [D, Hk, G + 2, K]: per KV head, its G query heads (query head h is in group h // G), its
    # key, its value
    G = cfg.n_heads // cfg.n_kv_heads
    wqkv = w["layers.wqkv"][layer]
    q = np.einsum("td,dhk->thk", h, wqkv[:, :, :G].reshape(wqkv.shape[0], cfg.n_heads, -1))
    k = np.einsum("td,dhk->thk", h, wqkv[:, :, G])
    v = np.einsum("td,dhk->thk", h, wqkv[:, :, G + 1])
    if cfg.qkv_bias:
        b = w["layers.bqkv"][layer]
        q = q + b[:, :G].reshape(cfg.n_heads, -1)
        k = k + b[:, G]
        v = v + b[:, G + 1]
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


# --------------------------------------------------------------------------------------------------
# Attention of one query head, OBCache columns, NC correction (pure functions)
# --------------------------------------------------------------------------------------------------


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray):
    """One query head over the kept tokens of its KV head. q [T, K], keys/values [N, K], visible [T,
    N] bool.

    Returns ``z`` [T, N] (raw logits ``q·k/√d``, also where not visible), ``A`` [T, N] (softmax over
    the visible tokens, 0 elsewhere), ``o`` [T, K] = ``A @ values`` and ``log_z`` [T] =
    ``log Σ_visible exp z``."""
    z = q @ keys.T / np.sqrt(q.shape[-1])
    masked = np.where(visible, z, -np.inf)
    top = masked.max(axis=-1, keepdims=True)
    e = np.exp(masked - top)
    total = e.sum(axis=-1, keepdims=True)
    A = e / total
    return z, A, A @ values, (top + np.log(total))[:, 0]


def obcache_columns(
    kind: str, A: np.ndarray, z: np.ndarray, values: np.ndarray, o: np.ndarray
) -> np.ndarray:
    """OBCache saliency [N] summed over the scoring queries (rows of ``A``, ``z``, ``o``).

    value: ``Σ_i A_ij² ‖v_j‖²``; key: ``Σ_i (A_ij z_ij)² ‖v_j − o_i‖²``;
    joint: value + key + ``2 Σ_i A_ij² z_ij (‖v_j‖² − v_j·o_i)``. ``kind`` is ``value``, ``key`` or
    ``joint``."""
    v_sq = np.sum(values * values, axis=1)  # [N]
    Az = np.where(A > 0, A * z, 0.0)  # a token a query does not see contributes nothing
    value = np.sum(A * A, axis=0) * v_sq
    diff = values[None, :, :] - o[:, None, :]  # [S, N, K]: v_j − o_i
    key = np.sum(Az * Az * np.sum(diff * diff, axis=-1), axis=0)
    if kind == "value":
        return value
    if kind == "key":
        return key
    if kind == "joint":
        cross = 2.0 * np.sum(A * Az * (v_sq[None, :] - o @ values.T), axis=0)  # A² z (‖v‖² − v·o)
        return value + key + cross
    raise ValueError(f"OBCache kind={kind!r}")


@dataclasses.dataclass
class Moments:
    """Moment statistics of the evicted tokens of one (layer, KV head)."""

    count: int
    k_sum: np.ndarray  # [K]
    v_sum: np.ndarray  # [K]
    vk_sum: np.ndarray  # [K, K], [i, j] = Σ v_i k_j


def moment_terms(m: Moments, *, clamp: bool):
    """``(k̄, v̄, S̃)`` with ``S̃ = S − s_v s_kᵀ / n`` (n > 0); ``clamp`` sets entries with
    ``|S̃| < 1e-6`` to 0."""
    n = m.count
    assert n > 0
    s_tilde = m.vk_sum - np.outer(m.v_sum, m.k_sum) / n
    if clamp:
        s_tilde = np.where(np.abs(s_tilde) < S_TILDE_CLAMP, 0.0, s_tilde)
    return m.k_sum / n, m.v_sum / n, s_tilde


def nc_correct(
    q: np.ndarray, o: np.ndarray, log_z: np.ndarray, m: Moments, *, zeroth: bool
) -> np.ndarray:
    """MomentKV normalization-corrected outputs [T, K] of queries ``q`` [T, K] (one query head)
    whose plain outputs over the visible kept tokens are ``o`` [T, K] with ``log_z`` [T]. ``m`` =
    the KV head's statistics.

    ``ŵ o + (1 − ŵ) f̂`` with ``log ŵ = log Z − logaddexp(log Z, log n + q·k̄/√d)`` and
    ``f̂ = v̄ + S̃ q / (n √d)`` (``v̄`` for the zeroth-order variant), S̃ clamped. Unchanged when
    ``n = 0``."""
    if m.count == 0:
        return o.copy()
    n, sqrt_d = m.count, np.sqrt(q.shape[-1])
    k_bar, v_bar, s_tilde = moment_terms(m, clamp=True)
    out = np.empty_like(o)
    for t in range(len(q)):
        log_w = log_z[t] - np.logaddexp(log_z[t], np.log(n) + q[t] @ k_bar / sqrt_d)
        w = np.exp(log_w)
        f_hat = v_bar if zeroth else v_bar + s_tilde @ q[t] / (n * sqrt_d)
        out[t] = w * o[t] + (1.0 - w) * f_hat
    return out


# --------------------------------------------------------------------------------------------------
# Eviction decision (pure functions, also used directly by the tests)
# --------------------------------------------------------------------------------------------------


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

    ``max``: max over the window, neighbours outside 0…N-1 ignored. ``avg``: window sum / kernel,
    neighbours outside count as 0. Window of index i:
    ``i - kernel // 2 … i - kernel // 2 + kernel - 1``.
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


def protected_mask(positions, *, seen: int, n_sink: int, window: int) -> np.ndarray:
    """[N] bool: ``position < n_sink`` or ``position >= seen - window``."""
    positions = np.asarray(positions, np.int64)
    return (positions < n_sink) | (positions >= seen - window)


def base_priorities(
    positions,
    states,
    protected,
    *,
    base: str,
    pool: str = "max",
    kernel: int = 7,
    aggregate: str = "mean",
) -> np.ndarray:
    """Priorities of the unprotected tokens (in position order) under a base scorer (step 4 of the
    doc)."""
    return ORACLE_BASES[base].priorities(
        positions, states, protected, pool=pool, kernel=kernel, aggregate=aggregate
    )


def expected_attention_priorities(
    positions,
    keys,
    values,
    queries,
    protected,
    *,
    seen: int,
    n_sink: int,
    inv_freq,
    aggregate: str = "mean",
) -> np.ndarray:
    """Expected Attention's priorities of the unprotected tokens (in position order), as kvpress's
    ``ExpectedAttentionPress`` computes them: queries [n, G, K] before RoPE (of the positions past
    the sinks) give a mean and a (biased) covariance per query head; both are rotated by the mean
    RoPE matrix of positions ``seen … seen + 511``; a key k gets the logit μ̃·k/√K + kᵀΣ̃k/(2K); a
    softmax over the keys past the sinks; the aggregate over the G heads; times ‖v‖; returned as its
    logarithm (the engine's priority). keys, values: [N, K] after RoPE."""
    positions = np.asarray(positions, np.int64)
    keys, values, queries = (np.asarray(x, np.float64) for x in (keys, values, queries))
    K = keys.shape[-1]
    half = K // 2
    angles = np.arange(seen, seen + EA_FUTURE, dtype=np.float64)[:, None] * np.asarray(
        inv_freq, np.float64
    )
    cos, sin = (
        np.cos(np.concatenate([angles, angles], 1)),
        np.sin(np.concatenate([angles, angles], 1)),
    )
    turn = np.zeros((K, K))
    turn[half:, :half], turn[:half, half:] = np.eye(half), -np.eye(half)
    rot = np.mean([np.diag(c) + np.diag(s_) @ turn for c, s_ in zip(cos, sin)], axis=0)
    scored = positions >= n_sink
    probs = []
    for g in range(queries.shape[1]):
        qg = queries[:, g] if len(queries) else np.zeros((1, K))
        mean = qg.mean(0)
        cov = (qg - mean).T @ (qg - mean) / len(qg)
        mu, sigma = rot @ mean, rot @ cov @ rot.T
        logits = keys @ mu / np.sqrt(K) + np.einsum("ni,ij,nj->n", keys, sigma, keys) / (2 * K)
        z = np.where(scored, logits, -np.inf)
        top = z.max()
        probs.append(z - top - np.log(np.exp(z - top).sum()))  # log-softmax
    log_p = np.stack(probs, 1)  # [N, G]
    top = log_p.max(1, keepdims=True)
    with np.errstate(divide="ignore"):
        if aggregate == "max":
            agg = log_p.max(1)
        else:  # log Σ_g p_g (− log G for the mean)
            agg = (
                top[:, 0]
                + np.log(np.exp(log_p - np.where(np.isfinite(top), top, 0)).sum(1))
                - (np.log(log_p.shape[1]) if aggregate == "mean" else 0.0)
            )
        prio = agg + np.log(np.linalg.norm(values, axis=-1))
    return prio[~np.asarray(protected, bool)]


def caote_priorities(
    states,
    values,
    protected,
    *,
    base: str,
    fast: bool,
    pool: str = "max",
    kernel: int = 7,
    aggregate: str = "mean",
) -> np.ndarray:
    """CAOTE / FastCAOTE priorities of the unprotected tokens (in position order).

    ``states`` [N, G] base states of all kept tokens, ``values`` [N, K]. Per query head: the base
    state (pooled per head over the unprotected tokens for ``snapkv``), negatives set to 0,
    normalised over all kept tokens to ``h``; ``c_j = h_j / (1 − h_j) · ‖m − v_j‖`` with
    ``m = Σ h_i v_i`` (``caote``) or the mean of the kept values (``fastcaote``); then the group
    aggregate over the G heads."""
    states = np.asarray(states, np.float64)
    values = np.asarray(values, np.float64)
    n, G = states.shape
    unprotected = np.flatnonzero(~np.asarray(protected, bool))
    c = np.zeros((len(unprotected), G))
    for g in range(G):
        s = states[:, g].copy()
        if ORACLE_BASES[base].pools:
            s[unprotected] = pool_priorities(s[unprotected], pool, kernel)
        s = np.maximum(s, 0.0)
        total = s.sum()
        h = s / total if total > 0 else np.zeros(n)
        m = values.mean(axis=0) if fast else h @ values
        dist = np.linalg.norm(m[None, :] - values, axis=1)
        c_g = np.empty(n)
        for j in range(n):
            c_g[j] = np.inf if h[j] >= 1.0 else h[j] / (1.0 - h[j]) * dist[j]
        c[:, g] = c_g[unprotected]
    return aggregate_states(c, aggregate)


@dataclasses.dataclass
class Decision:
    keep: np.ndarray  # [N] bool, over the input tokens
    priorities: np.ndarray  # [number of unprotected] in position order (after pooling)
    near_tie: bool
    exact_tie: bool


def is_near_tie(a: float, b: float) -> bool:
    return bool(abs(a - b) <= NEAR_TIE_RTOL * max(abs(a), abs(b)))


def keep_highest(positions, protected, prio, budget: int) -> Decision:
    """Keep the protected tokens plus the unprotected ones (``prio`` in position order) of highest
    priority until ``budget`` are kept; ties in favour of the later position."""
    positions = np.asarray(positions, np.int64)
    protected = np.asarray(protected, bool)
    n = len(positions)
    if n <= budget:
        return Decision(np.ones(n, bool), prio, False, False)
    unprotected = np.flatnonzero(~protected)
    n_free = budget - int(protected.sum())
    assert 0 <= n_free < len(unprotected), (
        "budget > n_sink + window (or an allocation's count) guarantees this"
    )
    # Highest priority first; among equal priorities the later position first.
    order = sorted(
        range(len(unprotected)), key=lambda i: (prio[i], positions[unprotected[i]]), reverse=True
    )
    keep = protected.copy()
    keep[unprotected[order[:n_free]]] = True
    if n_free == 0:
        return Decision(keep, prio, False, False)
    last_kept, first_evicted = prio[order[n_free - 1]], prio[order[n_free]]
    return Decision(
        keep, prio, is_near_tie(last_kept, first_evicted), bool(last_kept == first_evicted)
    )


def chunk_means(positions, prio, chunk: int) -> np.ndarray:
    """Each priority (of the unprotected tokens at ``positions``, in position order) replaced by the
    mean over the unprotected tokens of its chunk (positions c·chunk … (c+1)·chunk − 1)."""
    positions, prio = np.asarray(positions), np.asarray(prio, np.float64)
    chunks = positions // chunk
    return np.array([prio[chunks == c].mean() for c in chunks])


def pyramid_budgets(budget: int, window: int, n_layers: int) -> list[int]:
    """PyramidKV's layer budgets: window + m/20 for the last layer, window + 2m − m/20 for the first
    (m = budget − window), linear between, in whole tokens summing to n_layers · budget: each layer
    gets the floor of its exact share, and the tokens left over go one each to the layers with the
    largest fractions (the lower layer first among equal fractions)."""
    m = budget - window
    last, first = m / 20, 2 * m - m / 20
    shares = (
        [first + (last - first) * layer / (n_layers - 1) for layer in range(n_layers)]
        if n_layers > 1
        else [float(m)]
    )
    budgets = [int(np.floor(s)) for s in shares]
    left = n_layers * m - sum(budgets)
    for layer in sorted(range(n_layers), key=lambda i: (-(shares[i] - budgets[i]), i))[:left]:
        budgets[layer] += 1
    return [b + window for b in budgets]


def shared_counts(
    heads: list[dict], total: int, floor: int, cap: int
) -> tuple[list[int], bool, bool]:
    """Kept counts of heads sharing ``total`` slots (AdaKV over a layer's heads; one threshold over
    all).

    ``heads``: one dict per head (in head order) with ``positions`` (position order), ``protected``
    and ``prio`` (the unprotected tokens' priorities in position order). Every head keeps its
    protected tokens and at least ``floor`` tokens (its best unprotected ones after the protected);
    the remaining slots go one by one to the best token still unkept over all heads (priority, then
    later position, then lower head index) that does not take its head past ``cap``. Returns the
    counts and whether the last pick and the first refused one were a near / exact tie."""
    counts = [len(h["positions"]) for h in heads]
    if sum(counts) <= total:
        return counts, False, False
    kept, candidates = [], []
    for index, h in enumerate(heads):
        n_protected = int(np.sum(h["protected"]))
        unprotected_positions = np.asarray(h["positions"])[~np.asarray(h["protected"], bool)]
        best = sorted(
            range(len(h["prio"])),
            key=lambda i: (h["prio"][i], unprotected_positions[i]),
            reverse=True,
        )
        floored = min(max(floor, n_protected), counts[index])
        kept.append(floored)
        for rank, i in enumerate(best):
            if n_protected + rank >= floored and n_protected + rank < cap:
                candidates.append((h["prio"][i], int(unprotected_positions[i]), -index, index))
    candidates.sort(reverse=True)  # priority, later position, lower head first
    rest = max(total - sum(kept), 0)
    for _, _, _, index in candidates[:rest]:
        kept[index] += 1
    if 0 < rest < len(candidates):
        a, b = candidates[rest - 1][0], candidates[rest][0]
        return kept, is_near_tie(a, b), bool(a == b)
    return kept, False, False


def select_kept(
    positions,
    states,
    *,
    scorer: str,
    budget: int,
    seen: int,
    n_sink: int,
    window: int,
    pool: str = "max",
    kernel: int = 7,
    aggregate: str = "mean",
) -> Decision:
    """Which of the kept tokens (``positions`` [N] ascending, ``states`` [N, G]) survive an eviction
    point under a base scorer (``streamingllm``, ``h2o``, ``tova``, ``snapkv``)."""
    positions = np.asarray(positions, np.int64)
    assert np.all(np.diff(positions) > 0), "kept tokens must be in position order"
    protected = protected_mask(positions, seen=seen, n_sink=n_sink, window=window)
    prio = base_priorities(
        positions, states, protected, base=scorer, pool=pool, kernel=kernel, aggregate=aggregate
    )
    return keep_highest(positions, protected, prio, budget)


@dataclasses.dataclass
class MIDecision:
    keep: np.ndarray  # [N] bool, over the input tokens
    evicted: list[int]  # indices into the input tokens, in eviction order
    scores: list[
        np.ndarray
    ]  # per single eviction: P_j ‖r_j‖ over all N tokens (nan: protected or gone)
    near_ties: int
    exact_ties: int


def select_moment_informed(
    positions, keys, values, protected, priorities, budget: int, moments: Moments, *, zeroth: bool
) -> MIDecision:
    """MomentKV moment-informed eviction (Algorithm 1 with the base priority in place of α).

    ``priorities`` [number of unprotected] in position order, computed once. Repeats
    ``E = N − budget`` times: score every unprotected kept token by ``P_j ‖r_j‖`` with
    ``r_j = v_j − v̄ − S̃ k_j / (n √d)`` (zeroth order: ``v_j − v̄``; ``v_j`` while ``n = 0``) from
    the current statistics (S̃ not clamped), evict the smallest (ties: the earlier position) and add
    it to the statistics. ``moments`` is not modified."""
    positions = np.asarray(positions, np.int64)
    keys, values = np.asarray(keys, np.float64), np.asarray(values, np.float64)
    protected = np.asarray(protected, bool)
    N, K = keys.shape
    sqrt_d = np.sqrt(K)
    P = np.full(N, np.nan)
    P[~protected] = priorities
    count, k_sum, v_sum, vk_sum = (
        moments.count,
        moments.k_sum.copy(),
        moments.v_sum.copy(),
        moments.vk_sum.copy(),
    )
    keep = np.ones(N, bool)
    evicted, all_scores, near, exact = [], [], 0, 0
    for _ in range(max(0, N - budget)):
        if count > 0:
            v_bar = v_sum / count
            s_tilde = vk_sum - np.outer(v_sum, k_sum) / count
        scores = np.full(N, np.nan)
        candidates = [j for j in range(N) if keep[j] and not protected[j]]
        for j in candidates:
            if count == 0:
                r = values[j]
            elif zeroth:
                r = values[j] - v_bar
            else:
                r = values[j] - v_bar - s_tilde @ keys[j] / (count * sqrt_d)
            scores[j] = P[j] * np.linalg.norm(r)
        ranked = sorted(
            candidates, key=lambda j: (scores[j], positions[j])
        )  # smallest first, then earlier
        chosen, runner_up = ranked[0], ranked[1]
        near += is_near_tie(scores[chosen], scores[runner_up])
        exact += bool(scores[chosen] == scores[runner_up])
        keep[chosen] = False
        evicted.append(chosen)
        all_scores.append(scores)
        count += 1
        k_sum = k_sum + keys[chosen]
        v_sum = v_sum + values[chosen]
        vk_sum = vk_sum + np.outer(values[chosen], keys[chosen])
    return MIDecision(keep, evicted, all_scores, near, exact)


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Slot:
    """One kept token of one (layer, KV head)."""

    position: int
    key: np.ndarray  # [K], after RoPE
    value: np.ndarray  # [K]
    state: np.ndarray  # [G]


class Reference:
    """One sequence through the model with the eviction engine of docs/eviction.md.

    ``budget=None`` means no eviction at all (every eviction point is a no-op). ``aggregate=None``
    means the scorer's default (``sum`` for the OBCache modifiers, ``mean`` otherwise).
    """

    def __init__(
        self,
        params,
        *,
        scorer: str,
        budget: int | None,
        protocol: str = "blockwise",
        block_size: int = 16,
        n_sink: int = 0,
        window: int = 0,
        obs_window: int = 32,
        pool: str = "max",
        kernel: int = 7,
        aggregate: str | None = None,
        evict_every: int = 1,
        decode_evict: bool = True,
        allocation: str = "uniform",
        floor: float | None = None,
        chunk: int = 1,
        floor_mode: str = "adakv",
        decode_order: str = "attend-first",
        kv_dtype: str | None = None,
    ):
        base, modifier = parse_scorer(scorer)
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation={allocation!r}; expected one of {ALLOCATIONS}")
        if aggregate is None:
            aggregate = default_aggregate(scorer)
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r}; expected one of {PROTOCOLS}")
        if pool not in POOLS:
            raise ValueError(f"pool={pool!r}; expected one of {POOLS}")
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate={aggregate!r}; expected one of {AGGREGATES}")
        for name, val in (
            ("block_size", block_size),
            ("obs_window", obs_window),
            ("kernel", kernel),
            ("evict_every", evict_every),
        ):
            if val < 1:
                raise ValueError(f"{name}={val} must be >= 1")
        if n_sink < 0 or window < 0:
            raise ValueError("n_sink and window must be >= 0")
        if budget is not None and not budget > n_sink + window:
            raise ValueError(f"budget={budget} must exceed n_sink + window = {n_sink + window}")
        self.cfg = cfg = params.config
        self.w = numpy_params(params)
        self.inv_freq = np.asarray(inverse_frequencies(cfg), np.float64)
        self.scorer, self.base, self.modifier = scorer, base, modifier
        # its oracle entries: what the base and the modifier do (ORACLE_BASES, ORACLE_MODIFIERS)
        self.b, self.m = ORACLE_BASES[base], ORACLE_MODIFIERS.get(modifier, OracleModifier())
        self.budget, self.protocol, self.block_size = budget, protocol, block_size
        self.n_sink, self.window, self.obs_window = n_sink, window, obs_window
        self.pool, self.kernel, self.aggregate = pool, kernel, aggregate
        self.evict_every, self.decode_evict = evict_every, decode_evict
        self.allocation, self.chunk = allocation, chunk
        self.floor = {"adakv": 0.2}.get(allocation, 0.0) if floor is None else floor
        self.floor_mode = floor_mode
        self.decode_order = decode_order
        # how the cache stores keys and values: every slot holds their round trip
        # (tests/reference_quantized.py), which attention and every scorer read
        self.kv_dtype = kv_dtype

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
        # Diagnostics for the tests: every query/key/value ever computed and every attention output
        # the layer used (after any NC correction), by layer and position, and a log of every
        # eviction decision.
        self.history = [{"q": {}, "k": {}, "v": {}, "o": {}} for _ in range(L)]
        self.raw_queries: list[list[np.ndarray]] = [
            [] for _ in range(L)
        ]  # Expected Attention's, [H, K] each
        self.evictions: list[dict] = []

    def moments(self, layer: int, kh: int) -> Moments:
        return Moments(
            int(self.count[layer, kh]),
            self.k_sum[layer, kh].copy(),
            self.v_sum[layer, kh].copy(),
            self.vk_sum[layer, kh].copy(),
        )

    # -- one step
    # ---------------------------------------------------------------------------------------
    def step(
        self, tokens, positions, scoring, evict_point: bool, evict_first: bool = False
    ) -> np.ndarray:
        """Feed ``tokens`` [T] at consecutive ``positions`` [T]; ``scoring`` [T] bool marks the
        step's scoring queries; ``evict_first``: at an eviction point each layer evicts right after
        its attention and uses the attention over its kept tokens (CAOTE Eq. 5-7, MomentKV Algorithm
        1). Returns the logits [T, V]."""
        cfg, w, G = self.cfg, self.w, self.G
        tokens, positions = np.asarray(tokens), np.asarray(positions, np.int64)
        scoring = np.asarray(scoring, bool)
        assert positions[0] == self.seen and np.all(np.diff(positions) == 1)
        self.seen = int(positions[-1]) + 1
        x = w["embed"][tokens]
        for layer in range(cfg.n_layers):
            q, k, v = qkv(cfg, w, layer, x, positions, self.inv_freq)
            self.b.observe(self, layer, x, positions)
            for t, p in enumerate(positions):
                self.history[layer]["q"][int(p)] = q[t].copy()
                self.history[layer]["k"][int(p)] = k[t].copy()
                self.history[layer]["v"][int(p)] = v[t].copy()
            attn = np.zeros_like(q)
            for kh in range(cfg.n_kv_heads):
                slots = self.cache[layer][kh]
                # 1. append
                for t, p in enumerate(positions):
                    key, value = (round_trip(x[t, kh], self.kv_dtype) for x in (k, v))
                    slots.append(Slot(int(p), key, value, np.zeros(G)))
                keys = np.stack([s.key for s in slots])
                vals = np.stack([s.value for s in slots])
                kept_pos = np.array([s.position for s in slots])
                visible = kept_pos[None, :] <= positions[:, None]  # [T, N]
                moments = self.moments(
                    layer, kh
                )  # as they were before this step (eviction comes after)
                for g in range(G):
                    h = kh * G + g
                    # 2. attend (MomentKV NC corrects the output the layer uses, not the scores
                    #    below)
                    z, A, o, log_z = attention(q[:, h], keys, vals, visible)
                    attn[:, h] = self.m.correct(q[:, h], o, log_z, moments)
                    # 3. score update
                    if scoring.any() and self.b.queries != "none":
                        col = self.m.column(A[scoring], z[scoring], vals, o[scoring])  # [N]
                        for j, s in enumerate(slots):
                            s.state[g] = col[j] if self.b.replace else s.state[g] + col[j]
            # 4. evict this layer now, then attend again over what it keeps
            if evict_point and evict_first:
                self._evict_all([layer])
                attn = self._attend_kept(layer, q, positions)
            for t, p in enumerate(positions):
                self.history[layer]["o"][int(p)] = attn[t].copy()
            # 5. the rest of the layer
            x = finish_layer(cfg, w, layer, x, attn)
        # 4. evict, once every layer has attended (an eviction never changes the outputs of its own
        #    step)
        if evict_point and not evict_first:
            self._evict_all()
        return logits_of(cfg, w, x)

    def _attend_kept(self, layer: int, q: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The attention output of queries q [T, H, K] over the layer's kept tokens (NC-corrected
        with the moments as they are now, the tokens just evicted included), recomputed from
        scratch."""
        attn = np.zeros_like(q)
        for kh, slots in enumerate(self.cache[layer]):
            keys, vals = np.stack([s.key for s in slots]), np.stack([s.value for s in slots])
            visible = np.array([s.position for s in slots])[None, :] <= positions[:, None]
            moments = self.moments(layer, kh)
            for g in range(self.G):
                h = kh * self.G + g
                _, _, o, log_z = attention(q[:, h], keys, vals, visible)
                attn[:, h] = self.m.correct(q[:, h], o, log_z, moments)
        return attn

    def _priorities(self, layer: int, kh: int, aggregate: str) -> np.ndarray:
        slots = self.cache[layer][kh]
        positions = [s.position for s in slots]
        states = np.stack([s.state for s in slots])
        protected = protected_mask(
            positions, seen=self.seen, n_sink=self.n_sink, window=self.window
        )
        return self.m.priorities(
            self.b,
            positions,
            states,
            np.stack([s.value for s in slots]),
            protected,
            pool=self.pool,
            kernel=self.kernel,
            aggregate=aggregate,
            ref=self,
            layer=layer,
            kh=kh,
        )

    def _layer_priorities(self, layer: int) -> np.ndarray:
        """aggregate="layer": the mean over the KV heads of each head's group-mean priorities (the
        mean over every query head of the layer), given to every head; their kept positions must
        coincide."""
        heads = [[s.position for s in slots] for slots in self.cache[layer]]
        assert all(h == heads[0] for h in heads), (
            "aggregate='layer' keeps the same tokens in every KV head"
        )
        # pooling is applied to the layer mean, not per head
        if self.b.pools and not self.m.wraps_priority:
            mean = np.mean(
                [np.stack([s.state for s in slots]) for slots in self.cache[layer]], axis=0
            )
            protected = protected_mask(
                heads[0], seen=self.seen, n_sink=self.n_sink, window=self.window
            )
            return base_priorities(
                heads[0],
                mean,
                protected,
                base=self.base,
                pool=self.pool,
                kernel=self.kernel,
                aggregate="mean",
            )
        return np.mean([self._priorities(layer, kh, "mean") for kh in range(len(heads))], axis=0)

    def _evict_all(self, layers: list[int] | None = None):
        """Step 4 for every (layer, KV head) of ``layers`` (default: all): priorities, the
        allocation's kept counts, then each head's choice."""
        if self.budget is None:  # no eviction at all
            return
        cfg = self.cfg
        L, Hk = cfg.n_layers, cfg.n_kv_heads
        heads = {}
        for layer in range(L) if layers is None else layers:
            unprotected = [
                not protected_mask(
                    [s.position for s in slots],
                    seen=self.seen,
                    n_sink=self.n_sink,
                    window=self.window,
                ).all()
                for slots in self.cache[layer]
            ]
            shared = (
                self._layer_priorities(layer)
                if self.aggregate == "layer" and all(unprotected)
                else None
            )
            for kh in range(Hk):
                positions = [s.position for s in self.cache[layer][kh]]
                protected = protected_mask(
                    positions, seen=self.seen, n_sink=self.n_sink, window=self.window
                )
                if not unprotected[kh]:  # nothing to choose from
                    prio = np.zeros(0)
                else:
                    prio = self._priorities(layer, kh, self.aggregate) if shared is None else shared
                if self.chunk > 1:
                    prio = chunk_means(np.asarray(positions)[~protected], prio, self.chunk)
                heads[layer, kh] = dict(positions=positions, protected=protected, prio=prio)
        for (layer, kh), count in self._counts(heads).items():
            self._evict(layer, kh, heads[layer, kh]["prio"], count)

    def _counts(self, heads: dict) -> dict:
        """The allocation's kept count of every (layer, KV head)."""
        L, Hk, b = self.cfg.n_layers, self.cfg.n_kv_heads, self.budget
        if self.allocation in ("uniform", "pyramidkv"):
            budgets = (
                pyramid_budgets(b, self.window, L) if self.allocation == "pyramidkv" else [b] * L
            )
            return {
                (layer, kh): min(len(h["positions"]), budgets[layer])
                for (layer, kh), h in heads.items()
            }
        # AdaKV's code: ⌊α (b − protected)⌋ on top of the protected tokens
        if self.floor_mode == "adakv":
            floor = (
                self.n_sink
                + self.window
                + int(np.floor(self.floor * (b - self.n_sink - self.window)))
            )
        else:
            # kvpress's AdaKVPress: ⌊α b⌋ of the head's best tokens (at least 1), the protected
            # among them
            floor = max(1, int(np.floor(self.floor * b))) if self.floor > 0 else 0
        layers = sorted({layer for layer, _ in heads})
        groups = (
            [[(layer, kh) for kh in range(Hk)] for layer in layers]
            if self.allocation == "adakv"
            else [[(layer, kh) for layer in layers for kh in range(Hk)]]
        )
        counts = {}
        for group in groups:
            kept, near, exact = shared_counts(
                [heads[key] for key in group], self.group_total(len(group)), floor, self.head_cap()
            )
            self.near_ties += near
            self.exact_ties += exact
            counts |= dict(zip(group, kept))
        return counts

    def head_cap(self) -> int:
        """The most tokens one head keeps under a shared allocation: n_kv_heads × budget."""
        return self.cfg.n_kv_heads * self.budget

    def group_total(self, heads: int) -> int:
        """Tokens kept by ``heads`` heads sharing one budget: heads × budget."""
        return heads * self.budget

    def _evict(self, layer: int, kh: int, prio: np.ndarray | None = None, count: int | None = None):
        """Keep ``count`` (default: the budget) of one head's tokens, chosen by ``prio`` (default:
        the head's own priorities)."""
        slots = self.cache[layer][kh]
        count = self.budget if count is None else count
        if len(slots) > count:
            positions = [s.position for s in slots]
            states = np.stack([s.state for s in slots])
            protected = protected_mask(
                positions, seen=self.seen, n_sink=self.n_sink, window=self.window
            )
            if prio is None:
                prio = self._priorities(layer, kh, self.aggregate)
            if self.m.moment_informed:
                d = select_moment_informed(
                    positions,
                    np.stack([s.key for s in slots]),
                    np.stack([s.value for s in slots]),
                    protected,
                    prio,
                    count,
                    self.moments(layer, kh),
                    zeroth=self.m.zeroth,
                )
                keep, order, near, exact = d.keep, d.evicted, d.near_ties, d.exact_ties
            else:
                d = keep_highest(positions, protected, prio, count)
                keep, near, exact = d.keep, int(d.near_tie), int(d.exact_tie)
                order = [j for j in range(len(slots)) if not keep[j]]
            self.near_ties += near
            self.exact_ties += exact
            for j in order:  # the statistics receive the evicted tokens in eviction order
                s = slots[j]
                self.count[layer, kh] += 1
                self.k_sum[layer, kh] += s.key
                self.v_sum[layer, kh] += s.value
                self.vk_sum[layer, kh] += np.outer(s.value, s.key)
            kept = [s for s, k in zip(slots, keep) if k]
            self.evictions.append(
                {
                    "layer": layer,
                    "kv_head": kh,
                    "seen": self.seen,
                    "before": positions,
                    "states": states,
                    "priorities": prio,
                    "kept": [s.position for s in kept],
                    "evicted": [positions[j] for j in order],
                    "near_tie": near > 0,
                    "near_ties": near,
                }
            )
            self.cache[layer][kh] = slots = kept
        if self.b.resets:  # the reset happens at every eviction point, also one removing nothing
            for s in slots:
                s.state[:] = 0.0

    # -- protocols
    # --------------------------------------------------------------------------------------
    def kept_positions(self) -> list[list[list[int]]]:
        return [[sorted(s.position for s in slots) for slots in layer] for layer in self.cache]

    def _prompt_scoring(self, positions: np.ndarray, block_end: int, prompt_len: int) -> np.ndarray:
        """Which of a prompt block's queries score (the base's ``queries``), the span ending at the
        block's end (blockwise) or the prompt's (prefill); a window capped by the block / prompt."""
        end = block_end if self.protocol == "blockwise" else prompt_len
        return {
            "none": np.zeros(len(positions), bool),
            "all": np.ones(len(positions), bool),
            "last": positions == end - 1,
            "window": positions >= end - self.obs_window,
        }[self.b.queries]

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
            out = self.step(
                [tok], [P + s - 1], [True], evict_point, self.decode_order == "evict-first"
            )[-1]
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
            "moments": {
                "count": self.count.copy(),
                "k_sum": self.k_sum.copy(),
                "v_sum": self.v_sum.copy(),
                "vk_sum": self.vk_sum.copy(),
            },
            "near_ties": self.near_ties,
            "exact_ties": self.exact_ties,
        }


def run_reference(
    params,
    prompt,
    max_new_tokens,
    *,
    scorer,
    budget,
    protocol,
    block_size,
    n_sink,
    window,
    obs_window=32,
    pool="max",
    kernel=7,
    aggregate=None,
    evict_every=1,
    decode_evict=True,
    allocation="uniform",
    floor=None,
    chunk=1,
    floor_mode="adakv",
    decode_order="attend-first",
    kv_dtype=None,
) -> dict:
    """Prefill ``prompt`` under ``protocol`` then greedily decode ``max_new_tokens`` tokens; see
    module doc.

    ``scorer``: any name of :data:`SCORERS`; ``aggregate=None``: ``sum`` for OBCache modifiers, else
    ``mean``."""
    ref = Reference(
        params,
        scorer=scorer,
        budget=budget,
        protocol=protocol,
        block_size=block_size,
        n_sink=n_sink,
        window=window,
        obs_window=obs_window,
        pool=pool,
        kernel=kernel,
        aggregate=aggregate,
        evict_every=evict_every,
        decode_evict=decode_evict,
        allocation=allocation,
        floor=floor,
        chunk=chunk,
        floor_mode=floor_mode,
        decode_order=decode_order,
        kv_dtype=kv_dtype,
    )
    return ref.run(prompt, max_new_tokens)


# --------------------------------------------------------------------------------------------------
# KVzip (docs/eviction.md, "KVzip"): a repeat pass sets the state; one eviction point; then nothing
# --------------------------------------------------------------------------------------------------

KVZIP_TRAIL = 8  # tokens of the previous chunk quoted before a later chunk
KVZIP_MODIFIERS = CAOTE + MOMENTKV
# Every KVzip name: [allocation+]kvzip[+modifier] (global when no allocation is named); kvzip-head.
KVZIP_SCORERS = (
    ("kvzip", "kvzip-head")
    + tuple(f"kvzip+{m}" for m in KVZIP_MODIFIERS)
    + tuple(
        f"{a}+kvzip" + (f"+{m}" if m else "") for a in ALLOCATIONS for m in ("",) + KVZIP_MODIFIERS
    )
)
# Near ties of KVzip's decisions: the engine's float32 repeat pass differs from this float64 one
# by up to ~5e-6 relative on the tiny test models; decisions are well posed with a wider margin.
KVZIP_TIE_RTOL = 1e-4


def parse_kvzip_scorer(name: str) -> tuple[str, str, str | None]:
    """``(allocation, base, modifier)`` of a KVzip name: ``("heads", "kvzip-head", None)`` or, for
    ``[allocation+]kvzip[+modifier]``, allocation ``global`` when none is named."""
    if name not in KVZIP_SCORERS:
        raise ValueError(f"scorer={name!r}; expected one of {KVZIP_SCORERS}")
    if name == "kvzip-head":
        return "heads", "kvzip-head", None
    allocation, rest = ("global", name) if name.startswith("kvzip") else name.split("+", 1)
    return allocation, "kvzip", rest.partition("+")[2] or None


def repeat_scores(params, context, prompt, chunk: int = 2048, kv_dtype=None) -> np.ndarray:
    """KVzip's scores S [L, Hk, n] of a context of n tokens (Algorithm 1, kvzip-appendix.tex).

    ``prompt`` (read only, as ``kvjax.eviction.RepeatPrompt``): ids ``first``, ``later``, ``colon``;
    ``skip``, ``sinks``. The context is prefilled; its tokens after the first ``skip`` are cut into
    chunks of ``chunk``; chunk c_t is fed after the context (positions n, n + 1, …; ordinary causal
    attention over the context and the input) as ``first + c_1`` or ``later + the 8 tokens before
    c_t + colon + c_t``. In every layer, the softmax of each input query over [the keys of the
    first min(sinks, start of c_t) tokens, c_t's keys, the input's keys (causal)] gives each key of
    c_t the maximum over the input's queries and the query heads of its KV head (the sinks as
    kvpress's ``KVzipPress._compute_cross_attention`` takes them). The first ``skip`` score 0."""
    cfg, w = params.config, numpy_params(params)
    inv_freq = np.asarray(inverse_frequencies(cfg), np.float64)
    L, Hk, G = cfg.n_layers, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    context = np.asarray(context)

    def forward(tokens, past):
        """Every layer's (q, k, v) of ``tokens`` fed after ``past`` ([layer] -> (k, v) of the
        positions before them; None: from position 0)."""
        n_past = 0 if past is None else len(past[0][0])
        positions = n_past + np.arange(len(tokens))
        x, out = w["embed"][np.asarray(tokens)], []
        for layer in range(L):
            q, k, v = qkv(cfg, w, layer, x, positions, inv_freq)
            k, v = round_trip(k, kv_dtype), round_trip(v, kv_dtype)  # as the cache holds them
            keys = k if past is None else np.concatenate([past[layer][0], k])
            values = v if past is None else np.concatenate([past[layer][1], v])
            visible = np.arange(len(keys))[None, :] <= positions[:, None]
            attn = np.stack(
                [
                    attention(q[:, h], keys[:, h // G], values[:, h // G], visible)[2]
                    for h in range(cfg.n_heads)
                ],
                axis=1,
            )
            out.append((q, k, v))
            x = finish_layer(cfg, w, layer, x, attn)
        return out

    n = len(context)
    cache = [(k, v) for _, k, v in forward(context, None)]
    scores = np.zeros((L, Hk, n))
    for start in range(prompt.skip, n, chunk):
        stop = min(start + chunk, n)
        if start == prompt.skip:
            head = tuple(prompt.first)
        else:
            trail = tuple(int(t) for t in context[max(0, start - KVZIP_TRAIL) : start])
            head = tuple(prompt.later) + trail + tuple(prompt.colon)
        tokens = np.concatenate([np.asarray(head, np.int64), context[start:stop]])
        T, sink, m = len(tokens), min(prompt.sinks, start), stop - start
        causal = np.tril(np.ones((T, T), bool))
        visible = np.concatenate([np.ones((T, sink + m), bool), causal], axis=1)
        for layer, (q, k, _) in enumerate(forward(tokens, cache)):
            keys = np.concatenate([cache[layer][0][:sink], cache[layer][0][start:stop], k])
            for h in range(cfg.n_heads):
                _, A, _, _ = attention(q[:, h], keys[:, h // G], keys[:, h // G], visible)
                best = np.maximum(scores[layer, h // G, start:stop], A[:, sink : sink + m].max(0))
                scores[layer, h // G, start:stop] = best
    return scores


def whole_head_budgets(
    head_scores, budget: int, n_sink: int, window: int, context: int
) -> np.ndarray:
    """kvzip-head's kept count [L, Hk] of every head for a context of ``context`` tokens: with s =
    n_sink + window, the round(L·Hk·(budget − s)/(context − s)) heads of largest ``head_scores``
    [L, Hk] (the lower flat index first among equal scores; Python's round) keep ``context``
    tokens, the others s."""
    scores = np.asarray(head_scores, np.float64)
    s = n_sink + window
    share = min(max((budget - s) / max(context - s, 1), 0.0), 1.0)
    order = sorted(range(scores.size), key=lambda i: (-scores.flat[i], i))
    budgets = np.full(scores.size, s)
    budgets[order[: round(share * scores.size)]] = context
    return budgets.reshape(scores.shape)


class KVzipReference(Reference):
    """KVzip's compression of one prompt, then its continuation with nothing evicted.

    The prompt is prefilled with the full cache (no scoring queries); every token's state, in each
    query head of its group, is its repeat-pass score (``kvzip``: :func:`repeat_scores`) or its
    head's saved score (``kvzip-head``); one eviction point follows under the allocation
    (``kvzip-head``: the counts of :func:`whole_head_budgets`); later tokens are appended. The
    decoder, the priorities (CAOTE), MomentKV's MI and NC and the allocations are
    :class:`Reference`'s: it runs as ``h2o`` + the modifier (no pooling, no reset) with base
    ``kvzip``. Near ties are counted at ``tie_rtol`` (default :data:`KVZIP_TIE_RTOL`)."""

    def __init__(
        self,
        params,
        *,
        scorer: str,
        budget: int | float,
        repeat_prompt=None,
        head_scores=None,
        n_sink: int = 4,
        window: int = 0,
        floor: float = 0.0,
        floor_mode: str = "adakv",
        aggregate: str | None = None,
        chunk: int = 2048,
        context: int | None = None,
        tie_rtol: float = KVZIP_TIE_RTOL,
        kv_dtype: str | None = None,
    ):
        allocation, base, modifier = parse_kvzip_scorer(scorer)
        if (repeat_prompt is None, head_scores is None) != (base != "kvzip", base == "kvzip"):
            raise ValueError("kvzip takes repeat_prompt, kvzip-head head_scores (not the other)")
        self.ratio = None
        if isinstance(budget, float):  # a fraction of the longest prompt, ``context``
            self.ratio = float(1 - decimal.Decimal(repr(budget)))
            budget = context - int(context * self.ratio)
        super().__init__(
            params,
            scorer="h2o" + (f"+{modifier}" if modifier else ""),
            budget=budget,
            protocol="prefill",
            n_sink=n_sink,
            window=window,
            aggregate=aggregate,
            decode_evict=False,
            floor=floor,
            floor_mode=floor_mode,
            allocation="uniform" if allocation == "heads" else allocation,
            kv_dtype=kv_dtype,
        )
        self.params, self.scorer, self.base, self.allocation = params, scorer, base, allocation
        self.repeat_prompt, self.head_scores, self.repeat_chunk = repeat_prompt, head_scores, chunk
        self.context, self.tie_rtol = context, tie_rtol

    def scores_of(self, prompt: list[int]) -> np.ndarray:
        """The state [L, Hk, P] of every prompt token."""
        if self.base == "kvzip":
            return repeat_scores(
                self.params, prompt, self.repeat_prompt, self.repeat_chunk, self.kv_dtype
            )
        heads = np.asarray(self.head_scores, np.float64)
        return np.broadcast_to(heads[:, :, None], heads.shape + (len(prompt),))

    def head_cap(self) -> int:
        """Under one threshold over all heads no limit on one head (kvpress's ``KVzipPress()``): the
        compression happens once."""
        return sys.maxsize if self.allocation == "global" else super().head_cap()

    def group_total(self, heads: int) -> int:
        """A fractional budget f over n = ``context`` tokens keeps kvpress's count at compression
        ratio r = 1 − f (in decimal): heads·n − ⌊heads·n·r⌋."""
        if self.ratio is None:
            return super().group_total(heads)
        return heads * self.context - int(heads * self.context * self.ratio)

    def _counts(self, heads: dict) -> dict:
        if self.allocation != "heads":
            return super()._counts(heads)
        context = len(heads[0, 0]["positions"]) if self.context is None else self.context
        budgets = whole_head_budgets(
            self.head_scores, self.budget, self.n_sink, self.window, context
        )
        return {key: min(len(h["positions"]), int(budgets[key])) for key, h in heads.items()}

    def _evict_all(self, layers: list[int] | None = None):
        global NEAR_TIE_RTOL
        saved, NEAR_TIE_RTOL = NEAR_TIE_RTOL, self.tie_rtol
        try:
            super()._evict_all(layers)
        finally:
            NEAR_TIE_RTOL = saved

    def run(self, prompt, max_new_tokens: int, question=()) -> dict:
        prompt, question = [int(t) for t in prompt], [int(t) for t in question]
        P, Q = len(prompt), len(question)
        logits = self.step(prompt, np.arange(P), np.zeros(P, bool), False)
        prefill_logits = logits[-1]
        scores = self.scores_of(prompt)
        for layer, heads in enumerate(self.cache):
            for kh, slots in enumerate(heads):
                for s in slots:
                    s.state[:] = scores[layer, kh, s.position]
        self._evict_all()
        kept_after_prefill = self.kept_positions()
        if question:
            logits = self.step(question, P + np.arange(Q), np.zeros(Q, bool), False)
        tokens, step_logits = [], []
        tok = int(np.argmax(logits[-1]))
        for _ in range(max_new_tokens):
            tokens.append(tok)
            step_logits.append(self.step([tok], [self.seen], [False], False)[-1])
            tok = int(np.argmax(step_logits[-1]))
        moments = {
            "count": self.count.copy(),
            "k_sum": self.k_sum.copy(),
            "v_sum": self.v_sum.copy(),
            "vk_sum": self.vk_sum.copy(),
        }
        return {
            "prefill_logits": prefill_logits,
            "scores": scores,
            "kept_after_prefill": kept_after_prefill,
            "tokens": tokens,
            "step_logits": step_logits,
            "moments": moments,
            "near_ties": self.near_ties,
            "exact_ties": self.exact_ties,
        }


def run_kvzip_reference(
    params, prompt, max_new_tokens: int, *, scorer: str, budget: int, question=(), **options
) -> dict:
    """Compress ``prompt`` under a KVzip name (:data:`KVZIP_SCORERS`), append ``question`` and
    greedily decode ``max_new_tokens`` tokens, nothing evicted after the compression. ``options``:
    :class:`KVzipReference`'s (``repeat_prompt`` for kvzip, ``head_scores`` [L, Hk] for kvzip-head;
    ``chunk``: the repeat pass's; ``context``: kvzip-head's n and a fractional budget's, in kvjax
    the batch's longest prompt). Returns ``prefill_logits``, ``scores`` [L, Hk, P],
    ``kept_after_prefill``, ``tokens``, ``step_logits``, ``moments``, ``near_ties``, ``exact_ties``.
    """
    ref = KVzipReference(params, scorer=scorer, budget=budget, **options)
    return ref.run(prompt, max_new_tokens, question)
