"""``Policy``: everything static about which tokens a cache keeps, and ``make_policy``, the one
place where eviction settings are validated and the scorers' defaults filled in."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.eviction.allocations import (
    ALLOCATIONS,
    FLOOR_MODES,
    Allocation,
    floor_count,
)
from kvjax.eviction.base import Base
from kvjax.eviction.keywords import POLICY_KEYWORDS, EvictionKeywords
from kvjax.eviction.modifiers import MODIFIERS, NO_MODIFIER, Modifier
from kvjax.eviction.names import BASES, split_name
from kvjax.eviction.priority import AGGREGATES, POOLS
from kvjax.kernels import IMPLS


def _with_keywords(cls):
    """``cls`` with a field for each of ``POLICY_KEYWORDS``, typed and defaulted as
    ``EvictionKeywords`` declares it, after its own fields; then a frozen dataclass."""
    declared = {f.name: f for f in dataclasses.fields(EvictionKeywords)}
    own = dict(cls.__annotations__)
    cls.__annotations__ = {}
    for name in ("base", "budget"):  # the fields without a default first
        cls.__annotations__[name] = own.pop(name)
    for name in POLICY_KEYWORDS:
        cls.__annotations__[name] = declared[name].type
        setattr(cls, name, declared[name].default)
    cls.__annotations__ |= own
    return dataclasses.dataclass(frozen=True)(cls)


@_with_keywords
class Policy:
    """Everything static about which tokens a cache keeps: the scorer, the budget, the protected
    slots, and the eviction keywords of ``POLICY_KEYWORDS`` resolved (the scorer's defaults in place
    of None; their meanings: ``kvjax.eviction.keywords.EvictionKeywords``).

    Fields of its own:
        base: the base scorer's name (``BASES``).
        budget: slots kept per (layer, row, KV head).
        modifier: the modifier's name (``MODIFIERS``; "" = none).
        cap: the most tokens one head keeps where the allocation's own rule does not apply: the
            context length, set when a prompt is compressed (``for_context``), for ``kvzip-head``
            and for a global allocation under a scoring pass of the scorer's own.
        ratio, ratio_of: a fractional budget as kvpress's compression ratio r = 1 − budget over
            a prompt of ``ratio_of`` tokens n (``group_budget``); ``budget`` is then n − ⌊n·r⌋.

    Data a scoring pass reads (repeat prompt, head scores) is not here: see ``ScoringData``.
    """

    base: str
    budget: int
    modifier: str = ""
    cap: int | None = None
    ratio: float | None = None
    ratio_of: int | None = None

    @property
    def scorer(self) -> Base:
        """The base scorer (``kvjax.eviction.names.BASES``)."""
        return BASES[self.base]

    def query_weights(self, positions, valid, end):
        """[B, T] float32 weights of a step's scoring queries, or None
        (``Base.scoring_weights``)."""
        return self.scorer.scoring_weights(positions, valid, end, self.obs_window)

    @property
    def modifier_spec(self) -> Modifier:
        """The modifier (``kvjax.eviction.modifiers``), whose hooks the caches call."""
        return MODIFIERS[self.modifier] if self.modifier else NO_MODIFIER

    @property
    def pooled_aggregate(self) -> bool:
        """The priority is the base's aggregate of its state over the query heads, pooled along
        positions (``Base.priority`` with a pool): no modifier, no chunk means."""
        return (
            self.pool != "none"
            and not self.modifier
            and self.chunk == 1
            and type(self.scorer).priority is Base.priority
        )

    @property
    def key_options(self) -> dict:
        """The keywords of ``kvjax.kernels.lowest_place`` and ``lowest_places`` that say how a
        pooled aggregate's keys are made (``pooled_aggregate``), and its ``impl``."""
        return dict(
            n_sink=self.n_sink,
            window=self.window,
            aggregate=self.aggregate,
            pool=self.pool,
            kernel=self.kernel,
            impl=self.impl,
        )

    @property
    def state_form(self) -> str:
        """How the per-slot state keeps the query heads: "heads", one value each; or "sum" or
        "mean", one value per KV head, each column aggregated as it is added (``fold``). A sum or
        a mean allows it (the same sums, added in another order; "layer" means the heads too);
        "max" does not, nor a priority that reads each query head's state (CAOTE)."""
        if self.aggregate == "max" or self.modifier_spec.reads_head_states:
            return "heads"
        return "sum" if self.aggregate == "sum" else "mean"

    def state_groups(self, group_size: int) -> int:
        """The per-slot state's query-head axis: G where ``state_form`` is "heads", else 1."""
        return group_size if self.state_form == "heads" else 1

    def fold(self, col: jax.Array) -> jax.Array:
        """A column (or state) [..., G, S] as the state keeps it (``state_form``): [..., 1, S],
        the sum or mean over its G query heads; unchanged for "heads" (or G = 1)."""
        if self.state_form == "heads" or col.shape[-2] == 1:
            return col
        return (jnp.sum if self.state_form == "sum" else jnp.mean)(col, axis=-2, keepdims=True)

    @property
    def name(self) -> str:
        return f"{self.base}+{self.modifier}" if self.modifier else self.base

    @property
    def score_kind(self) -> str:
        return self.modifier_spec.score_kind

    @property
    def reads_kv(self) -> bool:
        """An eviction point reads every slot's keys and values (not only its scores)."""
        return self.modifier_spec.reads_kv or self.scorer.reads_kv

    def moment_dims(self, head_dim: int) -> tuple[int, int]:
        """The K of the cache's ``Moments``' sums and of their Σ v kᵀ
        (``Modifier.moments_dims``)."""
        return self.modifier_spec.moments_dims(head_dim)

    @property
    def allocation_spec(self) -> Allocation:
        """The allocation (``kvjax.eviction.allocations.ALLOCATIONS``)."""
        return ALLOCATIONS[self.allocation]

    @property
    def paged(self) -> bool:
        """Per-head budgets differ: the cache is paged so that memory follows the total budget."""
        return self.allocation_spec.paged

    def layer_budgets(self, n_layers: int) -> tuple[int, ...]:
        """Each layer's budget per KV head (the average under a shared allocation)."""
        return self.allocation_spec.layer_budgets(self.budget, self.window, n_layers)

    def head_capacity(self, n_layers: int, n_kv_heads: int) -> int:
        """The most tokens one (layer, row, KV head) keeps after an eviction point."""
        if self.cap is not None:
            return self.cap
        return self.allocation_spec.head_capacity(
            self.budget, self.window, n_layers, n_kv_heads, self.floor_count()
        )

    @property
    def capped_by_context(self) -> bool:
        """A head may keep a whole context: kvzip-head's whole heads, and a global allocation
        scored once by a pass of the scorer's own (KVzip), which nothing evicts after (kvpress's
        ``KVzipPress()`` puts no limit on a head). ``for_context`` sets the cap."""
        shared_once = self.allocation_spec.shared == "all" and self.scorer.scoring_pass is not None
        return self.allocation == "heads" or shared_once

    def for_context(self, context: int) -> Policy:
        """The policy that compresses a prompt of ``context`` tokens: its cap the context where
        ``capped_by_context``."""
        return dataclasses.replace(self, cap=context) if self.capped_by_context else self

    def group_budget(self, heads: int) -> int:
        """Slots kept by ``heads`` heads sharing one budget (``Allocation.sharing``): heads ×
        budget, or for a fractional budget kvpress's count over n = ``ratio_of`` tokens,
        heads·n − ⌊heads·n·r⌋ (``KVzipPress``'s rounding; at most heads × budget)."""
        if self.ratio is None:
            return heads * self.budget
        return heads * self.ratio_of - int(heads * self.ratio_of * self.ratio)

    def floor_count(self) -> int:
        return floor_count(self.floor, self.budget, self.n_sink + self.window, self.floor_mode)

    def total_budget(self, n_layers: int, n_kv_heads: int) -> int:
        """Tokens kept over every layer and KV head of a row after an eviction point."""
        # compressed: whole heads and reduced ones
        if self.allocation == "heads" and self.cap is not None:
            # whole_head_count rounds to the nearest head: at most half a head over the budget
            return n_layers * n_kv_heads * self.budget + self.cap
        return n_kv_heads * sum(self.layer_budgets(n_layers))

    def check_model(self, n_layers: int) -> None:
        """Errors that depend on the model: every layer's budget must exceed the protected slots."""
        low = min(self.layer_budgets(n_layers))
        if low <= self.n_sink + self.window:
            raise ValueError(
                f"budget={self.budget} with allocation={self.allocation!r} gives layer "
                f"{self.layer_budgets(n_layers).index(low)} a budget of {low}, which must be "
                f"larger than n_sink + window = {self.n_sink} + {self.window}"
            )


def make_policy(
    options: EvictionKeywords,
    budget: int,
    ratio: float | None = None,
    ratio_of: int | None = None,
) -> Policy:
    """The validated ``Policy`` of eviction keywords (``options``, whose ``budget`` a caller has
    resolved to ``budget`` slots per head, and ``ratio``, ``ratio_of`` for a fractional one), with
    the scorer's own settings for what is left as None: window and pool the base's; aggregate
    ``sum`` for OBCache as in its App. B.5, else ``mean`` as kvpress (the two rank identically);
    allocation the name's prefix, else the base's (uniform but for KVzip); floor the base's, else
    the allocation's."""
    scorer = options.scorer
    k = {name: getattr(options, name) for name in POLICY_KEYWORDS}  # resolved in place
    named, base, modifier = split_name(scorer)
    spec = BASES[base]
    if k["allocation"] is not None and named is not None and k["allocation"] != named:
        raise ValueError(f"allocation={k['allocation']!r} contradicts scorer={scorer!r}")
    k["allocation"] = allocation = k["allocation"] or named or spec.default_allocation
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation={allocation!r} must be one of {tuple(ALLOCATIONS)}")
    if (allocation == "heads") != (base == "kvzip-head"):
        raise ValueError(
            f"allocation='heads' belongs to scorer 'kvzip-head' (got allocation={allocation!r} "
            f"with scorer={scorer!r})"
        )
    if k["floor"] is None:
        own = spec.default_floor
        k["floor"] = own if own is not None else ALLOCATIONS[allocation].default_floor
    if not (isinstance(k["floor"], (int, float)) and 0 <= k["floor"] <= 1):
        raise ValueError(f"floor={k['floor']!r} must be a fraction of the budget in [0, 1]")
    k["floor"] = float(k["floor"])
    if k["floor_mode"] not in FLOOR_MODES:
        raise ValueError(f"floor_mode={k['floor_mode']!r} must be one of {FLOOR_MODES}")
    if not (isinstance(k["chunk"], int) and k["chunk"] >= 1):
        raise ValueError(f"chunk={k['chunk']!r} must be an integer >= 1")
    mod = MODIFIERS[modifier] if modifier else NO_MODIFIER
    for name, value in [("budget", budget)] + [
        (n, k[n]) for n in ("obs_window", "kernel", "mi_batch")
    ]:
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if not (isinstance(k["n_sink"], int) and k["n_sink"] >= 0):
        raise ValueError(f"n_sink={k['n_sink']!r} must be an integer >= 0")
    if k["window"] is None:
        k["window"] = spec.default_window(budget, k["obs_window"])
    if not (isinstance(k["window"], int) and k["window"] >= 0):
        raise ValueError(f"window={k['window']!r} must be an integer >= 0")
    if budget <= k["n_sink"] + k["window"]:
        raise ValueError(
            f"budget={budget} must be larger than n_sink + window = {k['n_sink']} + {k['window']}"
        )
    k["pool"] = spec.default_pool if k["pool"] is None else k["pool"]
    if k["pool"] not in POOLS:
        raise ValueError(f"pool={k['pool']!r} must be one of {POOLS}")
    if k["pool"] != "none" and k["kernel"] % 2 == 0:
        raise ValueError(f"kernel={k['kernel']} must be odd (pooling is centred on each token)")
    k["aggregate"] = aggregate = k["aggregate"] or ("mean" if mod.score_kind == "attn" else "sum")
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate={aggregate!r} must be one of {AGGREGATES}")
    mod.check(modifier, k)
    if k["mi_batch"] > 1 and not mod.sequential_choice:
        sequential = ", ".join("+" + m for m, s in MODIFIERS.items() if s.sequential_choice)
        raise ValueError(
            f"mi_batch={k['mi_batch']} only applies to MomentKV's moment-informed eviction "
            f"(scorers ending in {sequential})"
        )
    if k["impl"] not in IMPLS:
        raise ValueError(f"impl={k['impl']!r} must be one of {IMPLS}")
    if aggregate == "layer" and ALLOCATIONS[allocation].shared is not None:
        raise ValueError(
            f"aggregate='layer' keeps the same tokens in every KV head, which allocation="
            f"{allocation!r} shares unevenly among them"
        )
    return Policy(base=base, budget=budget, modifier=modifier, ratio=ratio, ratio_of=ratio_of, **k)
