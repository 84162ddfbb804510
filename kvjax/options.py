"""The eviction keywords, declared once: names, defaults, allowed values and help.

``kvjax.generate``, ``kvjax.generate_stream``, ``kvjax.prefill``, ``Prefilled.compress``, the CLI (its flags are
made from this table) and the evaluation suite take these keywords and resolve them here into the static
``Eviction`` the engine runs (``None``: the full cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.engine import PROTOCOLS, Eviction
from kvjax.kernels import IMPLS
from kvjax.scorers import AGGREGATES, POOLS, make_policy


def _option(default, help: str, choices: tuple | None = None):
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class EvictionOptions:
    """Every eviction keyword with its default. ``None`` where the default depends on the scorer."""

    budget: int | None = _option(None, "KV slots kept per layer and KV head; None keeps the full cache")
    scorer: str = _option("snapkv", "a base or base+modifier (kvjax.SCORERS; README 'Scorer names')")
    protocol: str = _option("blockwise", "blockwise: evict after every prompt block (CAOTE); prefill: prefill "
                            "in blocks, then evict once (SnapKV)", PROTOCOLS)
    block_size: int = _option(128, "prompt tokens per block")
    n_sink: int = _option(4, "first tokens never evicted")
    window: int | None = _option(None, "most recent tokens never evicted (None: the scorer's: 0 for "
                                 "streamingllm and tova, budget // 4 for h2o, obs_window for snapkv)")
    obs_window: int = _option(32, "observation window: the scoring queries of snapkv")
    pool: str | None = _option(None, "pooling of the priorities along positions (None: the scorer's)", POOLS)
    kernel: int = _option(7, "pooling kernel size (odd)")
    aggregate: str | None = _option(None, "how the query heads of a KV head combine (None: sum for OBCache, "
                                    "else mean; layer: the mean over every head of the layer)", AGGREGATES)
    evict_every: int = _option(1, "decode steps between evictions (that many spare slots)")
    decode_evict: bool = _option(True, "evict while decoding (False: the cache grows by the new tokens)")
    impl: str | None = _option(None, "attention with scores: None = XLA on CPU, the Pallas kernels on TPU and "
                               "CUDA; pallas = the platform's kernels (interpreted on CPU)", IMPLS)
    mi_batch: int = _option(1, "MomentKV: tokens its moment-informed eviction removes per statistics update "
                            "(1 = Algorithm 1's exact rule)")

    @classmethod
    def of(cls, **options) -> EvictionOptions:
        """The options from keyword arguments; an unknown keyword is a TypeError naming the valid ones."""
        if unknown := sorted(set(options) - set(NAMES)):
            raise TypeError(f"unknown eviction keyword(s) {', '.join(unknown)}; valid: {', '.join(NAMES)}")
        return cls(**options)

    def given(self) -> dict[str, Any]:
        """The options that differ from their defaults."""
        return {name: getattr(self, name) for name in NAMES if getattr(self, name) != DEFAULTS[name]}

    def resolve(self) -> Eviction | None:
        """The validated engine configuration (None for budget=None: the full cache)."""
        if self.budget is None:
            if self.impl is not None:
                raise ValueError(f"impl={self.impl!r} chooses the attention of the budget cache; the full cache "
                                 "(budget=None) always runs XLA attention")
            return None
        policy = make_policy(self.scorer, self.budget, n_sink=self.n_sink, window=self.window,
                             obs_window=self.obs_window, pool=self.pool, kernel=self.kernel,
                             aggregate=self.aggregate, mi_batch=self.mi_batch, impl=self.impl)
        return Eviction(policy, protocol=self.protocol, block_size=self.block_size, evict_every=self.evict_every,
                        decode_evict=self.decode_evict)


NAMES = tuple(f.name for f in dataclasses.fields(EvictionOptions))
DEFAULTS = {f.name: f.default for f in dataclasses.fields(EvictionOptions)}


def eviction_from(**options) -> Eviction | None:
    """``EvictionOptions.of(**options).resolve()``: the engine configuration of eviction keywords."""
    return EvictionOptions.of(**options).resolve()


def options_table() -> str:
    """The README's Markdown table of the eviction keywords."""
    rows = ["| keyword | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(EvictionOptions):
        choices = f.metadata["choices"]
        allowed = f" (one of {', '.join(map(repr, choices))})" if choices else ""
        rows.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata['help']}{allowed} |")
    return "\n".join(rows)


def add_arguments(group, defaults: bool = True, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per option to an argparse group. defaults=False leaves every flag unset (None) unless
    given, for callers that merge them over presets."""
    import argparse

    for f in dataclasses.fields(EvictionOptions):
        if f.name in skip:
            continue
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        default = f.default if defaults else None
        text = meta["help"] + (" (default: %(default)s)" if defaults and f.default is not None else "")
        if isinstance(f.default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif meta["choices"] is not None:
            group.add_argument(flag, choices=[c for c in meta["choices"] if c is not None], default=default,
                               help=text)
        else:
            kind = str if f.name == "scorer" else int
            group.add_argument(flag, type=kind, default=default, help=text)


def from_arguments(args, names: tuple[str, ...] = NAMES) -> dict[str, Any]:
    """The options an argparse namespace holds (those left unset, None, are omitted)."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
