"""The eviction engine: block-wise and prefill-then-evict protocols under ``lax.scan``, and decode
steps.

``Eviction`` is the static description of one engine configuration (a jit static argument) and the
one owner of its ``Policy``: the ``Segment`` of every forward call carries the policy to the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache.layout import Dense, EvictingCache, Paged, cache_layout
from kvjax.eviction import Policy
from kvjax.eviction.keywords import DECODE_ORDERS, PROTOCOLS
from kvjax.kernels.quantized import check_kind
from kvjax.model.decoder import forward
from kvjax.model.params import Params
from kvjax.model.segment import Segment, when
from kvjax.runtime.inputs import round_capacity

# internal protocol: feed tokens without any eviction point (``Eviction.without_eviction``)
APPEND = "append"
PAGE_SIZE = 16  # tokens per page of the paged cache, unless chosen
# ... and of quantized pools (``kv_dtype``): a TPU sublane tile of 8-bit codes holds 32 rows, so the
# TPU paged kernels take them in pages of 32 (in pages of 16 the reference runs there)
CODE_PAGE_SIZE = 32


def default_page_size(kv_dtype: str | None) -> int:
    """The paged cache's pages when none is chosen: ``PAGE_SIZE``, or ``CODE_PAGE_SIZE`` for a
    quantized ``kv_dtype``."""
    return PAGE_SIZE if kv_dtype is None else CODE_PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class Eviction:
    """The static description of one engine configuration.

    Fields:
        policy: scorer, budget and allocation.
        protocol: "blockwise" (evict after every block of ``block_size``) or "prefill" (prefill in
            blocks, evict once at the end), or "append" (no eviction: see ``without_eviction``).
        evict_every, decode_evict, decode_order: decoding evicts every ``evict_every`` tokens
            (``evict_every`` spare slots) unless ``decode_evict`` is False, each step in
            ``decode_order`` (``DECODE_ORDERS``).
        page_size: tokens per page of a paged cache (``kvjax.cache.paged``), None for the dense
            ``BudgetCache`` (uniform allocation only).
        kv_dtype: how the cache stores keys and values (None: the model's dtype; else one of
            ``kvjax.kernels.quantized.KV_DTYPES``).
    """

    policy: Policy
    protocol: str = "blockwise"
    block_size: int = 128
    evict_every: int = 1
    decode_evict: bool = True
    page_size: int | None = None
    decode_order: str = "attend-first"
    kv_dtype: str | None = None

    def __post_init__(self):
        if self.protocol not in PROTOCOLS + (APPEND,):
            raise ValueError(f"protocol={self.protocol!r} must be one of {PROTOCOLS}")
        if self.kv_dtype is not None:
            check_kind(self.kv_dtype)
        if self.decode_order not in DECODE_ORDERS:
            raise ValueError(f"decode_order={self.decode_order!r} must be one of {DECODE_ORDERS}")
        if self.decode_order == "evict-first" and self.policy.allocation_spec.shared == "all":
            raise ValueError(
                f"decode_order='evict-first' evicts each layer before the next one attends, "
                f"but allocation={self.policy.allocation!r} ranks every layer's tokens together"
            )
        for name in ("block_size", "evict_every"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.page_size is None and self.policy.paged:
            raise ValueError(
                f"allocation={self.policy.allocation!r} needs the paged cache: page_size=None"
            )
        if self.page_size is not None and not (
            isinstance(self.page_size, int) and self.page_size >= 1
        ):
            raise ValueError(f"page_size={self.page_size!r} must be an integer >= 1")

    def extend_spare(self, new_tokens: int) -> int:
        """Spare slots per head for feeding ``new_tokens`` (a multiple of the block) under the
        protocol."""
        return self.block_size if self.protocol == "blockwise" else new_tokens

    def decode_spare(self, max_new_tokens: int) -> int:
        """Spare slots per head for decoding ``max_new_tokens``."""
        return self.evict_every if self.decode_evict else max_new_tokens

    @property
    def evicts_by_layer(self) -> bool:
        """A decoding step evicts each layer in its own step of the layer scan (the same outputs),
        not every layer at once after the step: MomentKV's moment-informed eviction on the dense
        cache, whose S k_j of every slot, for all layers at once, held [L, B, Hk, S, K] float32
        temporaries. Not on pages (there XLA then copied the page pool in every layer), nor for the
        cheaper reads of CAOTE's values (slower layer by layer on a CPU)."""
        return self.page_size is None and self.policy.modifier_spec.sequential_choice

    @property
    def layout(self) -> Dense | Paged:
        """The cache layout (``kvjax.cache.layout``): dense, or paged with ``page_size``."""
        return cache_layout(self.page_size)

    def empty_cache(self, cfg, batch: int, spare: int, dtype) -> EvictingCache:
        """An empty cache with room for the budget plus ``spare`` new tokens per head."""
        self.policy.check_model(cfg.n_layers)
        cache = self.layout.empty(cfg, self.policy, batch, spare, dtype, self.kv_dtype)
        return cache.replace(stats=self.policy.scorer.init_stats(cfg, batch))

    def fit(self, cache: EvictingCache, cfg, spare: int) -> EvictingCache:
        """The same cache with room for ``spare`` new tokens per head (its kept tokens must fit),
        its state in this policy's form (``Policy.fold``) and statistics fitted to this decoding's
        eviction points."""
        needs, has = self.policy.moment_dims(cfg.head_dim), cache.moments.dims
        if any(n and not h for n, h in zip(needs, has, strict=True)):
            raise ValueError(
                f"scorer={self.policy.name!r} reads the moments of the evicted tokens, and this "
                + (
                    "cache (filled under a scorer other than MomentKV) keeps only their count"
                    if not has[0]
                    else "cache (filled under MomentKV's zeroth order) keeps no Σ v kᵀ"
                )
            )
        groups = self.policy.state_groups(cfg.group_size)
        if cache.state.shape[-2] != groups:
            if groups != 1:
                raise ValueError(
                    f"scorer={self.policy.name!r} with aggregate={self.policy.aggregate!r} reads "
                    "the state of each query head, and this cache (filled under a policy that "
                    "keeps their aggregate) keeps one per KV head"
                )
            cache = cache.replace(state=self.policy.fold(cache.state))
        cache = self.layout.fit(cache, cfg, self.policy, spare)
        return cache.replace(stats=self.policy.scorer.fit_stats(cache.stats, self.decode_evict))

    @property
    def fresh_state(self) -> bool:
        """Decoding ends every step with an eviction point that zeroes the scorer's state (SnapKV
        or TOVA evicting every step), and every prompt fed under this eviction ends with one, so a
        decoding loop may compute each step's state from that step's column alone and zero it once
        at its end (``Segment.fresh_state``)."""
        return self.decode_evict and self.evict_every == 1 and self.policy.scorer.reset_after_evict

    def decoding(self) -> Eviction:
        """What decoding depends on, with protocol and block size normalised: one decode compilation
        then serves every prefill protocol and block size (and, without eviction, every scorer and
        budget)."""
        if not self.decode_evict:
            return dataclasses.replace(self.without_eviction(), protocol="blockwise")
        return dataclasses.replace(self, protocol="blockwise", block_size=1)

    def without_eviction(self) -> Eviction:
        """Feeding and decoding that never evict (the cache grows): what a compressed context does
        with a question that arrives after it (KVzip's and kvpress's query-agnostic setting). Only
        the modifier's correction of the attention (MomentKV's) still depends on the scorer, so the
        policy keeps just that, the budget and a context's cap (``Policy.cap``) rounded up to
        ``CAPACITY_STEP`` (which size the cache): every other scorer and nearby budgets then share
        one compilation."""
        p = self.policy
        corrects = p.modifier if p.modifier_spec.corrects_attention else ""
        policy = Policy(
            "streamingllm",
            budget=round_capacity(p.budget),
            n_sink=0,
            window=0,
            obs_window=1,
            pool="none",
            kernel=1,
            aggregate="mean",
            floor=0.0,
            modifier=corrects,
            impl=p.impl,
            allocation=p.allocation,
            cap=None if p.cap is None else round_capacity(p.cap),
        )
        return Eviction(
            policy,
            protocol=APPEND,
            block_size=self.block_size,
            decode_evict=False,
            page_size=self.page_size,
            kv_dtype=self.kv_dtype,
        )


def extend(
    params: Params,
    cache: EvictingCache,
    tokens: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
    ev: Eviction,
) -> tuple[EvictingCache, jax.Array]:
    """Feed tokens [B, P] (P a multiple of the block; row b has ``lengths[b]`` valid tokens at
    positions ``start[b] + t``) block by block under ``lax.scan``, evicting as the protocol says.

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
        seg = Segment(
            positions=positions,
            valid=valid,
            query_weights=ev.policy.query_weights(positions, valid, end),
            seen=seen,
            evict=evict,
            policy=ev.policy,
        )
        hidden, cache = step(
            params, jax.lax.dynamic_slice_in_dim(tokens, i * m, m, axis=1), cache, seg
        )
        here = lengths - 1 - i * m
        h = jnp.take_along_axis(hidden, jnp.clip(here, 0, m - 1)[:, None, None], axis=1)[:, 0]
        last = jnp.where(((here >= 0) & (here < m))[:, None], h, last)
        return (cache, last), None

    last = jnp.zeros((B, params.config.d_model), params.dtype)
    (cache, last), _ = jax.lax.scan(block, (cache, last), jnp.arange(n_blocks, dtype=jnp.int32))
    return cache, last


def chunk_segment(
    ev: Eviction | None, start: jax.Array, n: jax.Array, end: jax.Array, m: int
) -> Segment:
    """The Segment of one prompt chunk per row, as ``extend`` feeds a block: ``n`` [B] tokens of
    ``m`` at positions ``start`` [B] + t, of prompts that end at ``end`` [B] (the prefill
    protocol's scoring queries). Under "blockwise" every chunk ends with an eviction point; under
    "prefill" the caller evicts each row after its own last chunk; ev=None: the full cache."""
    offs = jnp.arange(m, dtype=jnp.int32)
    positions = start[:, None] + offs[None]
    if ev is None:
        return Segment(positions=positions)
    valid = offs[None] < n[:, None]
    seen = start + n
    return Segment(
        positions=positions,
        valid=valid,
        query_weights=ev.policy.query_weights(
            positions, valid, seen if ev.protocol == "blockwise" else end
        ),
        seen=seen,
        evict=ev.protocol == "blockwise",
        policy=ev.policy,
    )


def step(params: Params, tokens: jax.Array, cache, seg: Segment) -> tuple[jax.Array, object]:
    """One forward call of tokens [B, T] through every layer of any cache, then the eviction point
    (``step_groups`` of one group). Returns the final-normed hidden states [B, T, D] and the
    cache."""
    (hidden,), (cache,) = step_groups(params, ((tokens, cache, seg),))
    return hidden, cache


def step_groups(params: Params, groups: tuple) -> tuple[tuple, tuple]:
    """One forward call of groups of rows, each (tokens [B, T], cache, seg), sharing the weights
    (``kvjax.model.decoder.forward``); then each group's eviction point if its ``seg.evict`` says
    so (for every layer at once: an eviction never changes the outputs of the step it ends), unless
    each layer evicted in its own attention (``seg.evict_in_layer``). Returns each group's
    final-normed hidden states and cache."""
    hidden, caches = forward(params, groups)
    caches = tuple(
        cache
        if seg.evict_in_layer
        else when(
            seg.evict,
            lambda c, seg=seg: c.evict(seg.policy, seg.seen, reset=not seg.fresh_state),
            cache,
        )
        for cache, (_, _, seg) in zip(caches, groups, strict=True)
    )
    return hidden, caches


def decode_segment(
    ev: Eviction | None,
    step: jax.Array,
    lengths: jax.Array,
    active: jax.Array,
    fresh_state: bool = False,
) -> Segment:
    """The Segment of one decode step: token at position ``lengths`` [B] for the ``active`` [B]
    rows; ``fresh_state``: ``Segment.fresh_state``, only where ``ev.fresh_state`` holds."""
    positions = lengths[:, None]
    if ev is None:
        return Segment(positions=positions)
    valid = active[:, None]
    if not ev.decode_evict or ev.evict_every == 1:
        evict = ev.decode_evict  # known statically
    else:
        evict = (step + 1) % ev.evict_every == 0
    return Segment(
        positions=positions,
        valid=valid,
        query_weights=ev.policy.query_weights(positions, valid, lengths + 1),
        seen=lengths + 1,
        evict=evict,
        policy=ev.policy,
        evict_in_layer=ev.decode_evict and (ev.decode_order == "evict-first" or ev.evicts_by_layer),
        attend_kept=ev.decode_order == "evict-first",
        fresh_state=fresh_state,
    )
