"""The eviction engine: block-wise and prefill-then-evict protocols under ``lax.scan``, and decode steps.

``Eviction`` is the static description of one engine configuration (a jit static argument) and the one owner
of its ``Policy``: the ``Segment`` of every forward call carries the policy to the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.budget_cache import BudgetCache
from kvjax.cache import Segment
from kvjax.inputs import round_capacity
from kvjax.model import decode_hidden
from kvjax.params import Params
from kvjax.priorities import query_weights
from kvjax.scorers import Policy

PROTOCOLS = ("blockwise", "prefill")
APPEND = "append"  # internal protocol: feed tokens without any eviction point (``Eviction.without_eviction``)


@dataclasses.dataclass(frozen=True)
class Eviction:
    """policy: scorer and budget; protocol: "blockwise" (evict after every block of ``block_size``) or
    "prefill" (prefill in blocks, evict once at the end), or "append" (no eviction: see
    ``without_eviction``); decoding evicts every ``evict_every`` tokens (``evict_every`` spare slots) unless
    ``decode_evict`` is False."""

    policy: Policy
    protocol: str = "blockwise"
    block_size: int = 128
    evict_every: int = 1
    decode_evict: bool = True

    def __post_init__(self):
        if self.protocol not in PROTOCOLS + (APPEND,):
            raise ValueError(f"protocol={self.protocol!r} must be one of {PROTOCOLS}")
        for name in ("block_size", "evict_every"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")

    def extend_slots(self, new_tokens: int) -> int:
        """Slots needed to take ``new_tokens`` (a multiple of the block) into a cache holding <= budget."""
        return self.policy.budget + (self.block_size if self.protocol == "blockwise" else new_tokens)

    def decoding(self) -> Eviction:
        """What decoding depends on, with protocol and block size normalised: one decode compilation then
        serves every prefill protocol and block size (and, without eviction, every scorer and budget)."""
        if not self.decode_evict:
            return dataclasses.replace(self.without_eviction(), protocol="blockwise")
        return dataclasses.replace(self, protocol="blockwise", block_size=1)

    def without_eviction(self) -> Eviction:
        """Feeding and decoding that never evict (the cache grows): what a compressed context does with a
        question that arrives after it (KVzip's and kvpress's query-agnostic setting). Only MomentKV's
        correction of the attention still depends on the scorer, so the policy keeps just that and the budget
        rounded up to ``CAPACITY_STEP`` (which sizes the cache): every other scorer and nearby budgets then
        share one compilation."""
        nc = self.policy.modifier if self.policy.moment_correction else ""
        policy = Policy("streamingllm", budget=round_capacity(self.policy.budget), n_sink=0, window=0, obs_window=1,
                        pool="none", kernel=1, aggregate="mean", modifier=nc, impl=self.policy.impl)
        return Eviction(policy, protocol=APPEND, block_size=self.block_size, decode_evict=False)

    def decode_slots(self, max_new_tokens: int) -> int:
        return self.policy.budget + (self.evict_every if self.decode_evict else max_new_tokens)


def extend(params: Params, cache: BudgetCache, tokens: jax.Array, start: jax.Array, lengths: jax.Array,
           ev: Eviction) -> tuple[BudgetCache, jax.Array]:
    """Feed tokens [B, P] (P a multiple of the block; row b has ``lengths[b]`` valid tokens at positions
    ``start[b] + t``) block by block under ``lax.scan``, evicting as the protocol says.

    Returns the cache and the final-normed hidden state [B, D] of each row's last valid token.
    """
    B, P = tokens.shape
    m = ev.block_size
    n_blocks = P // m
    offsets = jnp.arange(m, dtype=jnp.int32)

    def block(carry, i):
        cache, last = carry
        offs = i * m + offsets
        positions = start[:, None] + offs[None]
        valid = offs[None] < lengths[:, None]
        seen = start + jnp.minimum(lengths, (i + 1) * m)
        end = seen if ev.protocol == "blockwise" else start + lengths
        evict = {"blockwise": True, "prefill": i == n_blocks - 1, APPEND: False}[ev.protocol]
        seg = Segment(positions=positions, valid=valid, query_weights=query_weights(ev.policy, positions, valid, end),
                      seen=seen, evict=evict, policy=ev.policy)
        hidden, cache = decode_hidden(params, jax.lax.dynamic_slice_in_dim(tokens, i * m, m, axis=1), cache, seg)
        here = lengths - 1 - i * m
        h = jnp.take_along_axis(hidden, jnp.clip(here, 0, m - 1)[:, None, None], axis=1)[:, 0]
        last = jnp.where(((here >= 0) & (here < m))[:, None], h, last)
        return (cache, last), None

    last = jnp.zeros((B, params.config.d_model), params.dtype)
    (cache, last), _ = jax.lax.scan(block, (cache, last), jnp.arange(n_blocks, dtype=jnp.int32))
    return cache, last


def decode_segment(ev: Eviction | None, step: jax.Array, lengths: jax.Array, active: jax.Array) -> Segment:
    """The Segment of one decode step: token at position ``lengths`` [B] for the ``active`` [B] rows."""
    positions = lengths[:, None]
    if ev is None:
        return Segment(positions=positions)
    valid = active[:, None]
    if not ev.decode_evict or ev.evict_every == 1:
        evict = ev.decode_evict  # known statically
    else:
        evict = (step + 1) % ev.evict_every == 0
    return Segment(positions=positions, valid=valid,
                   query_weights=query_weights(ev.policy, positions, valid, lengths + 1), seen=lengths + 1,
                   evict=evict, policy=ev.policy)
