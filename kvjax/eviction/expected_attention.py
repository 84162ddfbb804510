"""Expected Attention (Devoto et al. 2025; NVIDIA kvpress ``ExpectedAttentionPress``): the
attention future queries are expected to pay each token, from the statistics of the queries seen so
far.

The queries before RoPE of every token past the sinks are modelled as a Gaussian N(μ, Σ) per query
head, rotated by the mean RoPE rotation R̄ of the next ``n_future`` positions. A key k gets the
expected logit μ̃·k/√d + kᵀΣ̃k/(2d) (μ̃ = R̄μ, Σ̃ = R̄ΣR̄ᵀ); a softmax over the cached keys past the
sinks turns those into expected attention; the query heads of a KV head are aggregated; the result
is scaled by ‖v‖ (+ ``epsilon`` first), whose logarithm each slot's state holds from the moment its
token is written (``token_state``: an eviction reads no value). The logits come from
``kvjax.kernels.expected_logits`` (on TPU and GPU a kernel that reads the keys in place and writes
the logits alone). The priority is the logarithm of that score, computed without forming it: the
same order as kvpress's score wherever that does not underflow (in float32 or bfloat16 the
probabilities of far-off tokens round to 0 and tie); pooling and chunk means act on the logarithms.
Query-agnostic, no scoring pass: the statistics (sums of the queries and of their outer products)
grow with every query the model runs, prompt and decoding alike. A decoding that evicts keeps its
last queries aside (``QueryStats.pending``, ``QUERY_BUFFER`` of them), and the eviction adds their
share of the quadratic term from the queries themselves: the [K, K] sums are written once per
``QUERY_BUFFER`` steps, not at every step (at the 8B's batch 64 they are 4.3 GB).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.eviction.base import Base
from kvjax.eviction.priority import pool
from kvjax.kernels import expected_logits
from kvjax.model.rope import apply_rope, inverse_frequencies
from kvjax.sharding import per_shard


@struct.dataclass
class QueryStats:
    """Statistics of the queries before RoPE, per layer and query head, float32.

    Fields:
        count: [L, B] queries summed.
        q_sum: [L, B, Hk, G, K] their sum.
        qq_sum: [L, B, Hk, G, K, K] the sum of their outer products.
        inv_freq: [L, K/2] the model's RoPE frequencies (the same in every layer).
        pending: [L, B, Hk, G, E, K] a decoding's last queries (E = ``QUERY_BUFFER``; zero past
            ``filled``), counted in ``count`` and ``q_sum`` but whose outer products ``qq_sum``
            does not hold yet: an eviction reads them as they are (``expected_logits``), and a
            full buffer is added to ``qq_sum`` before the next query (``settle``). Adding a
            [K, K] product to every head's sums at every step read and wrote them all (4.3 GB each
            way at the 8B's batch 64). None outside an evicting decoding.
        filled: [L] int32 the queries ``pending`` holds (None with it).
    """

    count: jax.Array
    q_sum: jax.Array
    qq_sum: jax.Array
    inv_freq: jax.Array
    pending: jax.Array | None = None
    filled: jax.Array | None = None

    AXES = dict(
        count=("layers", "batch"),
        q_sum=("layers", "batch", "kv_heads", "group", "head_dim"),
        qq_sum=("layers", "batch", "kv_heads", "group", "head_dim", None),
        inv_freq=("layers", None),
        pending=("layers", "batch", "kv_heads", "group", None, "head_dim"),
        filled=("layers",),
    )


QUERY_BUFFER = 16  # decoding queries kept aside (the least rows of a Triton tl.dot)


def mean_rotation(inv_freq: jax.Array, start: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The mean over positions ``start … start + n − 1`` of RoPE's cos and sin, [B, K] each (the
    rotation R̄ x = cos ⊙ x + sin ⊙ rotate_half(x)).

    Args:
        inv_freq: [K/2].
        start: [B].
    """
    angles = (start[:, None, None] + jnp.arange(n)[None, :, None]).astype(jnp.float32) * inv_freq
    angles = jnp.concatenate([angles, angles], -1)  # [B, n, K]
    return jnp.cos(angles).mean(1), jnp.sin(angles).mean(1)


def rotation_matrix(cos: jax.Array, sin: jax.Array) -> jax.Array:
    """[B, K, K] matrices of cos ⊙ x + sin ⊙ rotate_half(x) (rotate_half(x) = [−x₂, x₁])."""
    K = cos.shape[-1]
    half = K // 2
    eye = jnp.eye(half, dtype=jnp.float32)
    zero = jnp.zeros((half, half), jnp.float32)
    turn = jnp.block([[zero, -eye], [eye, zero]])  # rotate_half as a matrix
    return cos[:, :, None] * jnp.eye(K, dtype=jnp.float32) + sin[:, :, None] * turn


@dataclasses.dataclass(frozen=True)
class ExpectedAttention(Base):
    """Expected Attention (kvpress's defaults).

    Fields:
        n_future: future positions the rotation is averaged over.
        covariance: use Σ.
        vnorm: scale by ‖v‖.
        epsilon: added to the expected attention before the scaling.
    """

    name = "expected-attention"
    description = (
        "Expected Attention: the softmax of the expected logit of future queries, a Gaussian "
        "fitted to the queries seen so far (past the sinks) and rotated to the next 512 "
        "positions, times ‖v‖; no scoring pass"
    )
    modifiers = ()
    reads_kv = True

    n_future: int = 512
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0

    def token_state(self, v: jax.Array) -> jax.Array | None:
        """log ‖v‖, which ``priority`` adds (None without ``vnorm``)."""
        return jnp.log(jnp.linalg.norm(v.astype(jnp.float32), axis=-1)) if self.vnorm else None

    def init_stats(self, cfg, batch: int) -> QueryStats:
        L, Hk, G, K = cfg.n_layers, cfg.n_kv_heads, cfg.group_size, cfg.head_dim
        f32 = jnp.float32
        inv_freq = jnp.broadcast_to(jnp.asarray(inverse_frequencies(cfg)), (L, K // 2))
        return QueryStats(
            count=jnp.zeros((L, batch), f32),
            q_sum=jnp.zeros((L, batch, Hk, G, K), f32),
            qq_sum=jnp.zeros((L, batch, Hk, G, K, K), f32),
            inv_freq=inv_freq,
        )

    def observe(self, stats: QueryStats, layer, q, positions, valid, policy) -> QueryStats:
        """Adds layer ``layer``'s queries at positions >= ``n_sink`` (kvpress drops the first hidden
        states as outliers), un-rotated by RoPE; a decoding step's query waits in ``pending``
        when there is one (the buffer settled first if it is full)."""
        B, T, H, K = q.shape
        Hk = stats.q_sum.shape[2]
        raw = apply_rope(q.astype(jnp.float32), -positions, stats.inv_freq[layer])
        take = (valid & (positions >= policy.n_sink)).astype(jnp.float32)  # [B, T]
        raw = (raw * take[:, :, None, None]).reshape(B, T, Hk, H // Hk, K)
        stats = stats.replace(
            count=stats.count.at[layer].add(take.sum(-1)),
            q_sum=stats.q_sum.at[layer].add(raw.sum(1)),
        )
        if stats.pending is None or T > 1:
            return stats.replace(
                qq_sum=stats.qq_sum.at[layer].add(jnp.einsum("bthgi,bthgj->bhgij", raw, raw))
            )
        full = stats.filled[layer] == stats.pending.shape[4]
        stats = jax.lax.cond(full, lambda s: self.settle(s, layer), lambda s: s, stats)
        # the entry is zero: an add writes it in place
        return stats.replace(
            pending=stats.pending.at[layer, :, :, :, stats.filled[layer]].add(raw[:, 0]),
            filled=stats.filled.at[layer].add(1),
        )

    def settle(self, stats: QueryStats, layer=None) -> QueryStats:
        """The statistics with the pending queries' outer products added to ``qq_sum`` (every
        layer's, or layer ``layer``'s) and the buffer emptied."""
        if stats.pending is None:
            return stats
        if layer is None:  # a layer at a time (one layer's products at once); empty ones skipped
            return jax.lax.fori_loop(
                0,
                stats.filled.shape[0],
                lambda i, s: jax.lax.cond(
                    s.filled[i] > 0, lambda s: self.settle(s, i), lambda s: s, s
                ),
                stats,
            )
        pending = stats.pending[layer]  # [B, Hk, G, E, K]; entries past ``filled`` are zero
        return stats.replace(
            qq_sum=stats.qq_sum.at[layer].add(jnp.einsum("bhgei,bhgej->bhgij", pending, pending)),
            pending=stats.pending.at[layer].multiply(0.0),
            filled=stats.filled.at[layer].set(0),
        )

    def fit_stats(self, stats: QueryStats | None, evicting: bool) -> QueryStats | None:
        if stats is None:
            return None
        stats = self.settle(stats)
        if not evicting:
            return stats.replace(pending=None, filled=None)
        L, B, Hk, G, K = stats.q_sum.shape
        return stats.replace(
            pending=jnp.zeros((L, B, Hk, G, QUERY_BUFFER, K), jnp.float32),
            filled=jnp.zeros((L,), jnp.int32),
        )

    def priority(self, policy, state, pos, unprotected, k, v, order, stats: QueryStats, seen):
        n = jnp.maximum(stats.count, 1.0)[:, None, None, None]  # [B, 1, 1, 1]
        mean = stats.q_sum / n  # [B, Hk, G, K]
        rot = rotation_matrix(*mean_rotation(stats.inv_freq, seen, self.n_future))  # [B, K, K]
        heads = ("batch", "kv_heads")
        second = (
            (stats.qq_sum, n[:, 0, 0, 0], stats.pending) if self.covariance else (None, None, None)
        )
        (logits,) = per_shard(  # [B, Hk, G, S]
            lambda k, rot, *rest: (expected_logits(k, rot, *rest, impl=policy.impl),),
            (k, rot, mean, *second),
            (heads, ("batch",), heads, heads, ("batch",), heads),
            (heads,),
            *k.shape[:2],
        )
        # the softmax runs over the keys past the sinks
        scored = (pos >= policy.n_sink)[:, :, None, :]
        log_p = jax.nn.log_softmax(jnp.where(scored, logits, -jnp.inf), axis=-1)
        prio = log_aggregate(policy.aggregate, jnp.where(scored, log_p, -jnp.inf))
        if self.vnorm:
            if self.epsilon:
                prio = jnp.logaddexp(prio, jnp.log(jnp.float32(self.epsilon)))
            prio = prio + state[:, :, 0]  # log ‖v‖, written with the token (``token_state``)
        if policy.pool != "none":
            prio = pool(prio, unprotected, policy.pool, policy.kernel, order)
        return prio


def log_aggregate(how: str, log_p: jax.Array) -> jax.Array:
    """The log of ``aggregate(how, exp(log_p))``: [B, Hk, G, S] -> [B, Hk, S], without underflow."""
    if how == "max":
        return log_p.max(2)
    B, Hk, G, S = log_p.shape
    if how == "layer":
        total = jax.nn.logsumexp(log_p, axis=(1, 2)) - jnp.log(jnp.float32(Hk * G))
        return jnp.broadcast_to(total[:, None], (B, Hk, S))
    total = jax.nn.logsumexp(log_p, axis=2)
    return total - jnp.log(jnp.float32(G)) if how == "mean" else total
