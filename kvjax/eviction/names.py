"""The scorer grammar: every base, the names it makes with the modifiers and allocations, and
aliases.

A scorer name is a base (``BASES``), ``base+modifier`` (a modifier the base takes), or an alias,
optionally prefixed by an allocation (``"adakv+snapkv+caote"``). ``SCORERS`` maps every valid name
to what it computes; the error for an unknown name, the CLI help and the README's table come from
here.
"""

from __future__ import annotations

from kvjax.eviction.allocations import ALLOCATIONS
from kvjax.eviction.base import Base
from kvjax.eviction.expected_attention import ExpectedAttention
from kvjax.eviction.h2o import H2O
from kvjax.eviction.h2o_window import H2OWindow
from kvjax.eviction.kvzip import KVzip
from kvjax.eviction.kvzip_head import KVzipHead
from kvjax.eviction.modifiers import MODIFIERS
from kvjax.eviction.snapkv import SnapKV
from kvjax.eviction.streamingllm import StreamingLLM
from kvjax.eviction.tova import TOVA

BASES: dict[str, Base] = {
    b.name: b
    for b in (
        StreamingLLM(),
        H2O(),
        H2OWindow(),
        TOVA(),
        SnapKV(),
        KVzip(),
        KVzipHead(),
        ExpectedAttention(),
    )
}
ALIASES = {
    "momentkv": ("snapkv+momentkv", "MomentKV's own setting: SnapKV scoring, MI + NC"),
    "adakv": (
        "adakv+snapkv",
        "AdaKV: SnapKV scoring, each layer's budget shared among its KV heads",
    ),
    "pyramidkv": (
        "pyramidkv+snapkv",
        "PyramidKV: SnapKV scoring, layer budgets decreasing with depth",
    ),
}


def _describe(base: str, modifier: str) -> str:
    text = BASES[base].description
    return f"{text}; {MODIFIERS[modifier].description}" if modifier else text


SCORERS: dict[str, str] = (
    {base: _describe(base, "") for base in BASES}
    | {
        f"{base}+{m}": _describe(base, m)
        for base, b in BASES.items()
        for m in MODIFIERS
        if m in b.modifiers
    }
    | {alias: f"alias of `{full}` ({why})" for alias, (full, why) in ALIASES.items()}
)
"""Every valid scorer name and what it computes."""


def split_name(name: str) -> tuple[str | None, str, str]:
    """``"adakv+snapkv+caote"`` -> ``("adakv", "snapkv", "caote")``: an optional allocation prefix
    (``ALLOCATIONS``; None if absent), the base and the modifier ("" if none). An unknown name is a
    ValueError listing the valid ones."""
    allocation, rest = None, name
    if isinstance(name, str) and name.partition("+")[0] in ALLOCATIONS and name not in SCORERS:
        allocation, _, rest = name.partition("+")
    if not isinstance(rest, str) or rest not in SCORERS:
        names = sorted(n for n in SCORERS if n not in ALIASES)
        raise ValueError(
            f"scorer={name!r} is unknown; valid scorers: {', '.join(names)}; aliases: "
            f"{', '.join(sorted(ALIASES))}; each may be prefixed by an allocation: "
            f"{', '.join(a + '+' for a in ALLOCATIONS if a != 'heads')}"
        )
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
