"""``Base``: what every base scorer tells the engine, with the defaults most bases share.

A base scorer is one frozen dataclass in one module of this package. The engine asks it:

- ``scoring_weights``: which queries of a step score (their attention column joins the state);
- ``update_state``: how a step's column folds into the per-slot state, and ``reset_after_evict``;
  or ``token_state``: a state a token's slot gets with it, from its own value;
- ``init_stats`` / ``observe``: statistics of its own beyond the per-slot state (None for most),
  and ``fit_stats``, their form for a decoding (which may keep part of their update aside);
- ``priority``: the priority of every slot at an eviction point (higher = kept);
- its defaults: window, pooling, allocation, floor, the modifiers it takes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.eviction.priority import aggregate, pool

ATTENTION_MODIFIERS = (
    "obcache-value",
    "obcache-key",
    "obcache-joint",
    "caote",
    "fastcaote",
    "momentkv",
    "momentkv-mi",
    "momentkv-nc",
    "momentkv-zeroth",
)


@dataclasses.dataclass(frozen=True)
class Base:
    """A base scorer.

    Class attributes:
        name: its name in the scorer grammar.
        description: one line for the README's table and the CLI's help.
        queries: which queries score, "none", "all", "last" or "window" (the last ``obs_window``).
        replace: a scoring step's column replaces the state instead of adding to it.
        reset_after_evict: the state is zeroed at every eviction point.
        default_pool: pooling of the priorities along positions ("none", "max", "avg").
        window_rule: the default protected window, "zero", "quarter" (budget // 4) or "obs"
            (obs_window).
        scoring_pass: the state comes from a pass of its own over the prefilled prompt ("kvzip":
            the repeat pass; "heads": saved head scores): prefill protocol, no eviction while
            decoding.
        default_allocation: its allocation when the name has no allocation prefix.
        default_floor: its floor under any shared allocation (None: the allocation's).
        modifiers: the modifiers it takes (``kvjax.eviction.modifiers``).
        reads_kv: its priority reads the cached keys and values of every slot.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    queries: ClassVar[str] = "none"
    replace: ClassVar[bool] = False
    reset_after_evict: ClassVar[bool] = False
    default_pool: ClassVar[str] = "none"
    window_rule: ClassVar[str] = "zero"
    scoring_pass: ClassVar[str | None] = None
    default_allocation: ClassVar[str] = "uniform"
    default_floor: ClassVar[float | None] = None
    modifiers: ClassVar[tuple[str, ...]] = ATTENTION_MODIFIERS
    reads_kv: ClassVar[bool] = False

    def default_window(self, budget: int, obs_window: int) -> int:
        """The protected window when the caller gives none."""
        return {"zero": 0, "quarter": budget // 4, "obs": obs_window}[self.window_rule]

    def scoring_weights(
        self, positions: jax.Array, valid: jax.Array, end: jax.Array, obs_window: int
    ) -> jax.Array | None:
        """[B, T] float32 weights of a step's scoring queries, or None if none score.

        Args:
            positions, valid: [B, T].
            end: [B] one past the last position of the scoring span.
        """
        if self.queries == "none":
            return None
        if self.queries == "all":
            chosen = valid
        elif self.queries == "last":
            chosen = valid & (positions == end[:, None] - 1)
        else:
            chosen = valid & (positions >= end[:, None] - obs_window)
        return chosen.astype(jnp.float32)

    def update_state(
        self, state: jax.Array, col: jax.Array | None, has_query: jax.Array
    ) -> jax.Array:
        """The state after a step.

        Args:
            state, col: [B, Hk, G, S], or G = 1: the query heads' aggregate
                (``Policy.state_form``).
            has_query: [B] the row had a scoring query.
        """
        if col is None:
            return state
        if self.replace:
            return jnp.where(has_query[:, None, None, None], col, state)
        return state + col

    def token_state(self, v: jax.Array) -> jax.Array | None:
        """The state [..., T] a new token's slot starts with (each query head's alike), from its
        value v [..., T, K] as the attention reads it; None: zero (a state of attention
        columns)."""
        return None

    def init_stats(self, cfg, batch: int):
        """Statistics of its own, stacked over layers (a pytree with ``AXES``), or None."""
        return None

    def observe(
        self, stats, layer: jax.Array, q: jax.Array, positions: jax.Array, valid: jax.Array, policy
    ):
        """The statistics (stacked over layers) after layer ``layer``'s step: queries q [B, T, H, K]
        (after RoPE) at ``positions`` [B, T] (``valid`` [B, T]) under ``policy`` (the
        ``kvjax.eviction.Policy``). Sums are added at ``layer`` in place (``.at[layer].add``), so
        that the layer loop, which carries the stacked statistics, never copies a layer's."""
        return stats

    def fit_stats(self, stats, evicting: bool):
        """The statistics for a decoding whose steps evict (``evicting``) or not, everything that
        ``observe`` kept aside so far added in."""
        return stats

    def priority(
        self,
        policy,
        state: jax.Array,
        pos: jax.Array,
        unprotected: jax.Array,
        k: jax.Array | None,
        v: jax.Array | None,
        order: jax.Array,
        stats,
        seen: jax.Array,
    ) -> jax.Array:
        """[B, Hk, S] float32 priority (higher = kept) of the unprotected valid slots of one layer.

        Args:
            policy: the ``kvjax.eviction.Policy``.
            state: [B, Hk, G, S] the per-slot state (G = 1: ``Policy.state_form``).
            pos: [B, Hk, S] positions (-1 = empty).
            unprotected: [B, Hk, S] valid and evictable.
            k, v: [B, Hk, S, K] the cached keys and values (read by ``reads_kv`` scorers and
                CAOTE).
            order: [B, Hk, S] the slots by position (for pooling).
            stats: this layer's ``observe`` statistics.
            seen: [B] one past the newest position.

        The default: the scores aggregate the query heads, then pool. (A modifier may wrap this:
        ``kvjax.eviction.modifiers.Modifier.priority``.)
        """
        agg = aggregate(policy.aggregate, state)
        if policy.pool != "none":
            agg = pool(agg, unprotected, policy.pool, policy.kernel, order)
        return agg
