"""Eviction scorers: two tables (bases and modifiers), the grammar of their names, and the static ``Policy``.

A scorer name is a base (``BASES``) or ``base+modifier`` (``MODIFIERS``; each modifier lists the bases it takes),
or an alias. Bases say which queries of a step score, how their per-slot column updates the state and whether
the state is reset at eviction points; modifiers change what is scored (OBCache), how the priority is formed
from it (CAOTE) or how eviction and attention use the evicted tokens (MomentKV). ``SCORERS`` maps every valid
name to its description; the error for an unknown name, the CLI help and the README's table come from here.
Semantics: ``docs/eviction.md``; the math: ``kvjax.priorities``.
"""

from __future__ import annotations

import dataclasses

from kvjax.allocation import ALLOCATIONS, FLOOR_MODES, floor_count, head_capacity, layer_budgets
from kvjax.kernels import IMPLS
from kvjax.kvzip import RepeatPrompt

AGGREGATES = ("sum", "mean", "max", "layer")  # "layer": mean over all query heads of the layer
POOLS = ("none", "max", "avg")


@dataclasses.dataclass(frozen=True)
class BaseSpec:
    """queries: which queries of a step score ("none", "all", "last" or "window": the last obs_window);
    update: "accumulate" or "replace" the state with their column; reset_after_evict: zero the state at every
    eviction point; default_window: "zero", "quarter" (budget // 4) or "obs" (obs_window); scoring_pass: the
    state comes from a pass of its own over the prefilled prompt instead ("kvzip": the repeat pass of
    ``kvjax.kvzip``; "heads": saved head scores), so the scorer runs under the prefill protocol and does not
    evict while decoding; default_allocation, default_floor: the scorer's own allocation setting."""

    description: str
    queries: str
    update: str
    reset_after_evict: bool
    default_window: str
    default_pool: str = "none"
    scoring_pass: str | None = None
    default_allocation: str = "uniform"
    default_floor: float | None = None


@dataclasses.dataclass(frozen=True)
class ModifierSpec:
    """score_kind: what the attention accumulates per slot (``kvjax.kernels.SCORE_KINDS``); meta: CAOTE's
    meta-score over the base priority ("caote" / "fastcaote"); mi: MomentKV's moment-informed eviction; nc:
    its normalization-corrected attention; zeroth: both from the value mean only; bases: the bases it takes."""

    description: str
    score_kind: str = "attn"
    meta: str | None = None
    mi: bool = False
    nc: bool = False
    zeroth: bool = False
    bases: tuple[str, ...] = ("h2o", "h2o-window", "tova", "snapkv")


BASES: dict[str, BaseSpec] = {
    "streamingllm": BaseSpec("the n_sink first and the most recent tokens", "none", "accumulate", False, "zero"),
    "h2o": BaseSpec("attention accumulated over every query seen, prompt queries included", "all", "accumulate",
                    False, "quarter"),
    "h2o-window": BaseSpec("H2O's prefill variant (OBCache App. C.2.1): attention accumulated over the last "
                           "obs_window prompt queries (kept as the window; the papers use 16), then every decoding "
                           "query", "window", "accumulate", False, "obs"),
    "tova": BaseSpec("attention of the newest query", "last", "replace", True, "zero"),
    "snapkv": BaseSpec("attention of the last obs_window queries, pooled along positions", "window", "accumulate",
                       True, "obs", default_pool="max"),
    "kvzip": BaseSpec("KVzip: the most attention a token receives while the model repeats the context (a scoring "
                      "pass after the prefill; needs `repeat_prompt`); top scores over each layer's KV heads",
                      "none", "replace", False, "zero", scoring_pass="kvzip", default_allocation="adakv",
                      default_floor=0.0),
    "kvzip-head": BaseSpec("KVzip's context-independent mode: whole KV heads kept, the best by saved head scores "
                           "(`head_scores`), the rest cut to the sinks and window; no scoring pass",
                           "none", "replace", False, "obs", scoring_pass="heads", default_allocation="heads"),
}

MODIFIERS: dict[str, ModifierSpec] = {
    "obcache-value": ModifierSpec("OBCache value-pruning saliency Σ A² ‖v‖² replaces the attention column",
                                  score_kind="obcache-value"),
    "obcache-key": ModifierSpec("OBCache key-pruning saliency Σ (A z)² ‖v − o‖² replaces the attention column",
                                score_kind="obcache-key"),
    "obcache-joint": ModifierSpec("OBCache joint saliency (value + key + 2 Σ A² z (‖v‖² − v·o)) replaces the "
                                  "attention column", score_kind="obcache-joint"),
    "caote": ModifierSpec("CAOTE: h/(1−h) ‖Σ h_i v_i − v_j‖ over the base score h normalised to sum 1",
                          meta="caote", bases=("h2o", "h2o-window", "tova", "snapkv", "kvzip")),
    "fastcaote": ModifierSpec("FastCAOTE: h/(1−h) ‖mean(v) − v_j‖", meta="fastcaote",
                              bases=("h2o", "h2o-window", "tova", "snapkv", "kvzip")),
    "momentkv": ModifierSpec("MomentKV: moment-informed eviction (score × ‖residual‖, one token at a time) and "
                             "normalization-corrected attention", mi=True, nc=True,
                             bases=("h2o", "h2o-window", "tova", "snapkv", "kvzip")),
    "momentkv-mi": ModifierSpec("MomentKV moment-informed eviction only", mi=True,
                                bases=("h2o", "h2o-window", "tova", "snapkv", "kvzip")),
    "momentkv-nc": ModifierSpec("MomentKV normalization-corrected attention only (eviction by the base score)",
                                nc=True, bases=("h2o", "h2o-window", "tova", "snapkv", "streamingllm", "kvzip")),
    "momentkv-zeroth": ModifierSpec("MomentKV zeroth order: residual v − v̄ and correction by v̄ (no "
                                    "outer-product term)", mi=True, nc=True, zeroth=True,
                                    bases=("h2o", "h2o-window", "tova", "snapkv", "kvzip")),
}
NO_MODIFIER = ModifierSpec("")
ALIASES = {"momentkv": ("snapkv+momentkv", "MomentKV's own setting: SnapKV scoring, MI + NC"),
           "adakv": ("adakv+snapkv", "AdaKV: SnapKV scoring, each layer's budget shared among its KV heads"),
           "pyramidkv": ("pyramidkv+snapkv", "PyramidKV: SnapKV scoring, layer budgets decreasing with depth")}


def _describe(base: str, modifier: str) -> str:
    text = BASES[base].description
    return f"{text}; {MODIFIERS[modifier].description}" if modifier else text


SCORERS: dict[str, str] = (
    {base: _describe(base, "") for base in BASES}
    | {f"{base}+{m}": _describe(base, m) for base in BASES for m, spec in MODIFIERS.items() if base in spec.bases}
    | {alias: f"alias of `{full}` ({why})" for alias, (full, why) in ALIASES.items()}
)
"""Every valid scorer name and what it computes."""


def split_name(name: str) -> tuple[str | None, str, str]:
    """``"adakv+snapkv+caote"`` -> ``("adakv", "snapkv", "caote")``: an optional allocation prefix
    (``kvjax.allocation.ALLOCATIONS``; None if absent), the base and the modifier ("" if none). An unknown name
    is a ValueError listing the valid ones."""
    allocation, rest = None, name
    if isinstance(name, str) and name.partition("+")[0] in ALLOCATIONS and name not in SCORERS:
        allocation, _, rest = name.partition("+")
    if not isinstance(rest, str) or rest not in SCORERS:
        names = sorted(n for n in SCORERS if n not in ALIASES)
        raise ValueError(f"scorer={name!r} is unknown; valid scorers: {', '.join(names)}; aliases: "
                         f"{', '.join(sorted(ALIASES))}; each may be prefixed by an allocation: "
                         f"{', '.join(a + '+' for a in ALLOCATIONS if a != 'heads')}")
    full = ALIASES.get(rest, (rest,))[0]
    if full.partition("+")[0] in ALLOCATIONS:  # an alias that names its allocation
        if allocation is not None:
            raise ValueError(f"scorer={name!r} names two allocations")
        allocation, _, full = full.partition("+")
    base, _, modifier = full.partition("+")
    return allocation, base, modifier


def scorer_table() -> str:
    """The README's Markdown table of every scorer name."""
    rows = ["| scorer name | what it computes |", "| --- | --- |"]
    return "\n".join(rows + [f"| `{name}` | {text} |" for name, text in SCORERS.items()])


@dataclasses.dataclass(frozen=True)
class Policy:
    """Everything static about which tokens a cache keeps: the scorer, the budget and the protected slots.

    base, modifier: the scorer (``BASES``, ``MODIFIERS``; modifier "" = none); budget: slots kept per (layer,
    row, KV head); n_sink: first tokens never evicted; window: most recent tokens never evicted; obs_window:
    scoring queries of "window" bases; pool/kernel: 1-D pooling of the priorities along positions;
    aggregate: how the G query heads of a KV head combine ("layer": every query head of the layer, the same
    tokens kept in every KV head); mi_batch: tokens MomentKV's moment-informed eviction removes per
    statistics update (1 = Algorithm 1's exact rule); impl: how attention with scores runs
    (``kvjax.kernels``: None = per platform, XLA on CPU; "xla"; "pallas"; "pallas_tpu" / "pallas_gpu");
    allocation: how many slots each (layer, KV head) keeps (``kvjax.allocation.ALLOCATIONS``); floor: the
    fraction of the budget every head keeps at least under a shared allocation; chunk: tokens of ``chunk``
    consecutive positions share the mean of their priorities (1 = each token by itself); repeat_prompt:
    KVzip's repeat prompt (``kvjax.kvzip.RepeatPrompt``); head_scores: the file of ``kvzip-head``'s saved head
    scores; cap: the most tokens one head keeps, when the allocation's own rule does not apply (``kvzip-head``,
    whose whole heads hold the context); head_budgets: the "heads" allocation's budget of every (layer, KV
    head), flattened (set when a prompt is compressed); floor_mode: how the floor counts the protected tokens
    (``kvjax.allocation.FLOOR_MODES``).
    """

    base: str
    budget: int
    n_sink: int
    window: int
    obs_window: int
    pool: str
    kernel: int
    aggregate: str
    modifier: str = ""
    mi_batch: int = 1
    impl: str | None = None
    allocation: str = "uniform"
    floor: float = 0.0
    chunk: int = 1
    repeat_prompt: RepeatPrompt | None = None
    head_scores: str | None = None
    cap: int | None = None
    head_budgets: tuple[int, ...] | None = None
    floor_mode: str = "adakv"

    @property
    def base_spec(self) -> BaseSpec:
        return BASES[self.base]

    @property
    def modifier_spec(self) -> ModifierSpec:
        return MODIFIERS[self.modifier] if self.modifier else NO_MODIFIER

    @property
    def name(self) -> str:
        return f"{self.base}+{self.modifier}" if self.modifier else self.base

    @property
    def score_kind(self) -> str:
        return self.modifier_spec.score_kind

    @property
    def meta(self) -> str | None:
        return self.modifier_spec.meta

    @property
    def moment_eviction(self) -> bool:
        return self.modifier_spec.mi

    @property
    def moment_correction(self) -> bool:
        return self.modifier_spec.nc

    @property
    def zeroth_order(self) -> bool:
        return self.modifier_spec.zeroth

    @property
    def paged(self) -> bool:
        """Per-head budgets differ: the cache is paged so that memory follows the total budget."""
        return ALLOCATIONS[self.allocation].paged

    def layer_budgets(self, n_layers: int) -> tuple[int, ...]:
        """Each layer's budget per KV head (the average under a shared allocation)."""
        return layer_budgets(self.allocation, self.budget, self.window, n_layers)

    def head_capacity(self, n_layers: int, n_kv_heads: int) -> int:
        """The most tokens one (layer, row, KV head) keeps after an eviction point."""
        if self.cap is not None:
            return self.cap
        return head_capacity(self.allocation, self.budget, self.window, n_layers, n_kv_heads)

    def floor_count(self) -> int:
        return floor_count(self.floor, self.budget, self.n_sink + self.window, self.floor_mode)

    def total_budget(self, n_layers: int, n_kv_heads: int) -> int:
        """Tokens kept over every layer and KV head of a row after an eviction point."""
        if self.head_budgets is not None:
            return sum(self.head_budgets)
        return n_kv_heads * sum(self.layer_budgets(n_layers))

    def check_model(self, n_layers: int) -> None:
        """Errors that depend on the model: every layer's budget must exceed the protected slots."""
        low = min(self.layer_budgets(n_layers))
        if low <= self.n_sink + self.window:
            raise ValueError(f"budget={self.budget} with allocation={self.allocation!r} gives layer "
                             f"{self.layer_budgets(n_layers).index(low)} a budget of {low}, which must be larger "
                             f"than n_sink + window = {self.n_sink} + {self.window}")


def make_policy(scorer: str, budget: int, *, n_sink: int = 4, window: int | None = None, obs_window: int = 32,
                pool: str | None = None, kernel: int = 7, aggregate: str | None = None, mi_batch: int = 1,
                impl: str | None = None, allocation: str | None = None, floor: float | None = None,
                chunk: int = 1, repeat_prompt: RepeatPrompt | None = None, head_scores: str | None = None,
                floor_mode: str = "adakv") -> Policy:
    """Validated ``Policy`` with the papers' defaults for what is left as None (aggregate: ``sum`` for
    OBCache as in its App. B.5, else ``mean`` as kvpress, the two rank identically; allocation: the name's
    prefix, else the scorer's (uniform but for KVzip); floor: the scorer's, else the allocation's)."""
    named, base, modifier = split_name(scorer)
    spec = BASES[base]
    if allocation is not None and named is not None and allocation != named:
        raise ValueError(f"allocation={allocation!r} contradicts scorer={scorer!r}")
    allocation = allocation or named or spec.default_allocation
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation={allocation!r} must be one of {tuple(ALLOCATIONS)}")
    if (allocation == "heads") != (base == "kvzip-head"):
        raise ValueError(f"allocation='heads' belongs to scorer 'kvzip-head' (got allocation={allocation!r} with "
                         f"scorer={scorer!r})")
    if floor is None:
        own = spec.default_floor is not None and allocation == spec.default_allocation
        floor = spec.default_floor if own else ALLOCATIONS[allocation].default_floor
    if not (isinstance(floor, (int, float)) and 0 <= floor <= 1):
        raise ValueError(f"floor={floor!r} must be a fraction of the budget in [0, 1]")
    if floor_mode not in FLOOR_MODES:
        raise ValueError(f"floor_mode={floor_mode!r} must be one of {FLOOR_MODES}")
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk={chunk!r} must be an integer >= 1")
    if (repeat_prompt is not None) != (spec.scoring_pass == "kvzip"):
        raise ValueError("scorer='kvzip' needs repeat_prompt=kvjax.kvzip_prompt(tokenizer) (the repeat prompt's "
                         "token ids)" if repeat_prompt is None else f"repeat_prompt is KVzip's; scorer={scorer!r}")
    if (head_scores is not None) != (spec.scoring_pass == "heads"):
        raise ValueError("scorer='kvzip-head' needs head_scores=<file of kvjax.kvzip.save_head_scores>"
                         if head_scores is None else f"head_scores is kvzip-head's; scorer={scorer!r}")
    mod = MODIFIERS[modifier] if modifier else NO_MODIFIER
    for name, value in (("budget", budget), ("obs_window", obs_window), ("kernel", kernel), ("mi_batch", mi_batch)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if not (isinstance(n_sink, int) and n_sink >= 0):
        raise ValueError(f"n_sink={n_sink!r} must be an integer >= 0")
    if window is None:
        window = {"zero": 0, "quarter": budget // 4, "obs": obs_window}[spec.default_window]
    if not (isinstance(window, int) and window >= 0):
        raise ValueError(f"window={window!r} must be an integer >= 0")
    if budget <= n_sink + window:
        raise ValueError(f"budget={budget} must be larger than n_sink + window = {n_sink} + {window}")
    pool = spec.default_pool if pool is None else pool
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r} must be one of {POOLS}")
    if pool != "none" and kernel % 2 == 0:
        raise ValueError(f"kernel={kernel} must be odd (pooling is centred on each token)")
    aggregate = aggregate or ("mean" if mod.score_kind == "attn" else "sum")
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate={aggregate!r} must be one of {AGGREGATES}")
    if aggregate == "layer" and mod.mi:
        raise ValueError(f"aggregate='layer' cannot be combined with {modifier!r}: its moment-informed eviction "
                         "scores every KV head by its own statistics, so the heads' kept tokens diverge")
    if mi_batch > 1 and not mod.mi:
        raise ValueError(f"mi_batch={mi_batch} only applies to MomentKV's moment-informed eviction (scorers "
                         f"ending in {', '.join('+' + m for m, s in MODIFIERS.items() if s.mi)})")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    if aggregate == "layer" and ALLOCATIONS[allocation].shared is not None:
        raise ValueError(f"aggregate='layer' keeps the same tokens in every KV head, which allocation="
                         f"{allocation!r} shares unevenly among them")
    return Policy(base, budget, n_sink, window, obs_window, pool, kernel, aggregate, modifier, mi_batch, impl,
                  allocation, float(floor), chunk, repeat_prompt, head_scores, floor_mode=floor_mode)
