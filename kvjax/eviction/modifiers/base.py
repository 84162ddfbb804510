"""``Modifier``: what a ``base+modifier`` name changes in its base scorer, as hooks the caches and
the attention call. ``Modifier()`` itself changes nothing (the plain base); each modifier is a
subclass in a module of its own, whose hooks hold its behaviour, so that the caches hold storage
and name no modifier."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Modifier:
    """A modifier that changes nothing; the others subclass it.

    Fields:
        description: one line for the tables.
        score_kind: what the attention accumulates per slot (``kvjax.kernels.SCORE_KINDS``).
    """

    description: str = ""
    score_kind: str = "attn"

    @property
    def reads_kv(self) -> bool:
        """Its priority or its choice of slots reads every slot's cached keys and values."""
        return False

    @property
    def reads_head_states(self) -> bool:
        """Its priority reads the base's state of each query head, not only their aggregate: the
        state keeps one per query head (``Policy.state_form``)."""
        return False

    @property
    def corrects_attention(self) -> bool:
        """The attention's output depends on the evicted tokens (so on it even once eviction
        stops: ``Eviction.without_eviction`` keeps it)."""
        return False

    @property
    def sequential_choice(self) -> bool:
        """Its choice of slots is a loop over the tokens it evicts (``choose``): a cache evicts a
        few layers at a time, and the dense cache each layer in its own step of the layer scan."""
        return False

    def moments_dims(self, head_dim: int) -> tuple[int, int]:
        """The K of the cache's ``Moments``' sums and of their Σ v kᵀ: head_dim where it reads
        them, else 0 ((0, 0): the count alone)."""
        return 0, 0

    def check(self, name: str, keywords: dict) -> None:
        """A ValueError for the resolved eviction keywords (``Policy``'s) that it cannot take;
        ``name``: its name."""

    def priority(
        self,
        base,
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
        """[B, Hk, S] the priority of one layer's slots: the ``base`` scorer's (``Base.priority``,
        whose arguments these are)."""
        return base.priority(policy, state, pos, unprotected, k, v, order, stats, seen)

    def correction(self, moments) -> tuple:
        """The decode kernel's correction arguments from one layer's ``Moments``: (moments or None
        for none, then its static flags)."""
        return None, False

    def correct(self, out: jax.Array, lse: jax.Array, q: jax.Array, moments) -> jax.Array:
        """A block's attention output out [B, T, H, K] (lse [B, T, H], queries q) corrected."""
        return out

    def residuals(self, moments, max_drop: int, policy) -> tuple | None:
        """(moments, zeroth) when its ``choose`` of at most ``max_drop`` slots reads every slot's
        MomentKV residual norm under one layer's ``moments``: a decode kernel can give them from
        the tiles it reads (``decode_attention_with_scores(residuals=...)``). Else None."""
        return None

    def choose(
        self,
        prio,
        unprotected,
        n_evict,
        k,
        v,
        pos,
        moments,
        max_drop: int,
        policy,
        stack=None,
        norms=None,
    ):
        """The slots [..., S] it evicts itself (``n_evict`` [...] of the ``unprotected`` ones, at
        most ``max_drop``, by the priority ``prio`` and what it reads, under ``policy``), or None:
        the allocation's count of the lowest priorities. ``stack``: (stored keys, values, layer)
        of which k, v are the layer's values, for kernels that read the layer in place; ``norms``:
        the residual norms [..., S] that ``residuals`` asked the decode kernel for, or None."""
        return None
