"""The caches' interfaces (``Cache``: what the model's layers use of any cache, the full and the
recording ones included; ``EvictingCache``: a budget cache) and the layout that makes a budget cache
from the eviction settings: ``Dense`` (``BudgetCache``, one block of slots per head) under a uniform
allocation, ``Paged`` (``PagedCache``, pages from a pool per row) when heads keep different counts.
Callers ask the layout for an empty cache, a refit, or a compressed full cache, and never branch on
which it is."""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from kvjax.cache.dense import BudgetCache
from kvjax.cache.paged import PagedCache, pool_pages
from kvjax.cache.slots_view import filled_token_state
from kvjax.eviction.moments import Moments


@runtime_checkable
class Cache(Protocol):
    """What the model's layers use of any cache: ``attend(layer, q, k, v, seg)`` writes a layer's
    new keys and values and returns its attention output and the cache (``kvjax.model.decoder``);
    ``kv`` its keys and values."""

    @property
    def kv(self) -> tuple[jax.Array, jax.Array]: ...

    def attend(
        self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, seg
    ) -> tuple[jax.Array, Cache]: ...


@runtime_checkable
class EvictingCache(Cache, Protocol):
    """What the engine, the model's layers and the serving slots use of a budget cache. ``attend``
    gets the fields named in ``LAYER_FIELDS`` as its layer's slice (``kvjax.model.layer_fields``).

    Fields:
        pos: [L, B, Hk, S] original positions (-1 = empty).
        state: [L, B, Hk, G, S] the scorer's per-slot state (``Policy.state_groups``).
        order: [L, B, Hk, S] the slots by position.
        moments: ``Moments`` of the evicted tokens.
        stats: the base scorer's own statistics, or None.
    """

    pos: jax.Array
    state: jax.Array
    order: jax.Array
    moments: Moments
    stats: object

    @property
    def kv(self) -> tuple[jax.Array, jax.Array]: ...

    @property
    def sorted_pos(self) -> jax.Array: ...

    def attend(
        self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, seg
    ) -> tuple[jax.Array, EvictingCache]: ...

    def evict(self, policy, seen: jax.Array, reset: bool = True) -> EvictingCache: ...


@dataclasses.dataclass(frozen=True)
class Dense:
    """``BudgetCache``: budget + spare slots per (layer, row, KV head)."""

    def empty(self, cfg, policy, batch: int, spare: int, dtype, kv_dtype=None) -> BudgetCache:
        return BudgetCache.init(
            cfg,
            batch,
            policy.budget + spare,
            dtype,
            policy.moment_dims(cfg.head_dim),
            policy.state_groups(cfg.group_size),
            kv_dtype,
        )

    def fit(self, cache: BudgetCache, cfg, policy, spare: int) -> BudgetCache:
        return cache.resize(policy.budget + spare)

    def compress(self, policy, k, v, pos, state, stats, seen, head_budgets=None) -> BudgetCache:
        """The full cache after one eviction point.

        Args:
            k, v: [L, B, Hk, S, K] the full cache.
            pos: [L, B, Hk, S] original positions.
            state: [L, B, Hk, G, S] the scorer's state, as the policy keeps it
                (``Policy.state_groups``).
            stats: the base scorer's statistics.
            seen: [B] one past each row's newest position.
            head_budgets: [L, Hk] the "heads" allocation's budgets (paged only; None here).
        """
        L, B, Hk, S, K = k.shape
        order = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), pos.shape)
        full = BudgetCache(
            k=k,
            v=v,
            pos=pos,
            state=filled_token_state(policy.scorer, state, pos, v),
            order=order,
            moments=Moments.zeros((L, B, Hk), policy.moment_dims(K)),
            stats=stats,
        )
        return full.evict(policy, seen)


@dataclasses.dataclass(frozen=True)
class Paged:
    """``PagedCache`` with pages of ``page_size`` tokens."""

    page_size: int

    def geometry(self, cfg, policy, spare: int) -> tuple[int, int]:
        """Pages per head and pool pages for ``spare`` new tokens per head."""
        L, Hk, P = cfg.n_layers, cfg.n_kv_heads, self.page_size
        return (
            -(-(policy.head_capacity(L, Hk) + spare) // P),
            pool_pages(policy.total_budget(L, Hk), spare, L, Hk, P),
        )

    def empty(self, cfg, policy, batch: int, spare: int, dtype, kv_dtype=None) -> PagedCache:
        pages_per_head, n_pool = self.geometry(cfg, policy, spare)
        return PagedCache.init(
            cfg,
            batch,
            pages_per_head,
            self.page_size,
            n_pool,
            dtype,
            policy.moment_dims(cfg.head_dim),
            policy.state_groups(cfg.group_size),
            spare,
            kv_dtype,
        )

    def fit(self, cache: PagedCache, cfg, policy, spare: int) -> PagedCache:
        return cache.resize(*self.geometry(cfg, policy, spare), spare)

    def compress(self, policy, k, v, pos, state, stats, seen, head_budgets=None) -> PagedCache:
        moment_dims = policy.moment_dims(k.shape[-1])
        state = filled_token_state(policy.scorer, state, pos, v)
        full = PagedCache.from_dense(k, v, pos, state, self.page_size, moment_dims)
        full = full.replace(stats=stats)
        # a head may lose every token of the prompt
        return full.evict(policy, seen, max_evict=k.shape[3], head_budgets=head_budgets)


def cache_layout(page_size: int | None) -> Dense | Paged:
    """The layout of the eviction settings' ``page_size`` (None: dense)."""
    return Dense() if page_size is None else Paged(page_size)
