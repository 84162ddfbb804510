"""The eviction keywords, declared once: names, defaults, allowed values and help.

``kvjax.generate``, ``kvjax.generate_stream``, ``kvjax.prefill``, ``Prefilled.compress``, the CLI
(its flags are made from this table) and the evaluation suite take these keywords and resolve them
here into the static ``Eviction`` the engine runs (``None``: the full cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import re
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.eviction import (
    BASES,
    DEFAULT_FORM,
    FORMS,
    RepeatPrompt,
    ScoringData,
    kvzip_prompt,
    make_policy,
    split_name,
)
from kvjax.eviction.keywords import EvictionKeywords
from kvjax.kernels.quantized import KV_DTYPES, bytes_per_token
from kvjax.runtime.inputs import plain_numbers
from kvjax.runtime.kvzip_pass import load_head_scores
from kvjax.runtime.protocol import Eviction, default_page_size


@dataclasses.dataclass(frozen=True)
class EvictionOptions(EvictionKeywords):
    """The eviction keywords (``kvjax.eviction.keywords.EvictionKeywords``, where each is declared
    with its default and help) as the entry points take them, and their resolution into the
    engine's ``Eviction``."""

    def __post_init__(self):
        plain_numbers(self)

    @classmethod
    def of(cls, **options) -> EvictionOptions:
        """The options from keyword arguments; an unknown keyword is a TypeError naming the valid
        ones."""
        if unknown := sorted(set(options) - set(NAMES)):
            raise TypeError(
                f"unknown eviction keyword(s) {', '.join(unknown)}; valid: {', '.join(NAMES)}"
            )
        return cls(**options)

    @property
    def evicts(self) -> bool:
        """A budget is given (``budget`` or ``budget_bytes``); else the full cache."""
        return self.budget is not None or self.budget_bytes is not None

    @property
    def full_cache(self) -> dict:
        """The full cache's settings (``FullCache.init``'s ``impl``, its decode attention, and
        ``kv_dtype``) without a budget, else {} (no full cache)."""
        check_kv_dtype(self.kv_dtype)
        return {} if self.evicts else {"impl": self.impl, "kv_dtype": self.kv_dtype}

    def resolve(self, context: int | None = None, model=None) -> Eviction | None:
        """The validated engine configuration (None without a budget: the full cache).
        ``context``: the longest prompt, which a fractional budget is a fraction of (without it,
        only the fraction is checked); ``model``: the ``Params`` (or their config and dtype, as
        ``(cfg, dtype)``) that ``budget_bytes`` is counted for (without them, only checked)."""
        check_kv_dtype(self.kv_dtype)
        budget = self.budget
        if self.budget_bytes is not None:
            if budget is not None:
                raise ValueError(
                    f"budget={budget!r} and budget_bytes={self.budget_bytes!r}: give one of them"
                )
            if not (isinstance(self.budget_bytes, int) and self.budget_bytes >= 1):
                raise ValueError(f"budget_bytes={self.budget_bytes!r} must be an integer >= 1")
            budget = (
                BUDGET_FOR_CHECKS
                if model is None
                else budget_for_bytes(model, self.budget_bytes, self.kv_dtype)
            )
        if self.repeat not in (None, *FORMS):
            raise ValueError(f"repeat={self.repeat!r} must be one of {FORMS}")
        made = self.repeat_prompt.form if self.repeat_prompt is not None else ""
        if self.repeat is not None and made and made != self.repeat:
            raise ValueError(
                f"repeat={self.repeat!r}, but repeat_prompt was made in the {made!r} form: "
                f"pass kvjax.kvzip_prompt(tokenizer, {self.repeat!r})"
            )
        if budget is None:  # the full cache: ``impl``, ``kv_dtype`` are its own (``full_cache``)
            return None
        scoring_pass = BASES[split_name(self.scorer)[1]].scoring_pass
        if (self.repeat_prompt is not None) != (scoring_pass == "kvzip"):
            raise ValueError(
                "scorer='kvzip' needs repeat_prompt=kvjax.kvzip_prompt(tokenizer) (the repeat "
                "prompt's token ids)"
                if self.repeat_prompt is None
                else f"repeat_prompt is KVzip's; scorer={self.scorer!r}"
            )
        if (self.head_scores is not None) != (scoring_pass == "heads"):
            raise ValueError(
                "scorer='kvzip-head' needs head_scores=<file of "
                "kvjax.runtime.kvzip_pass.save_head_scores>"
                if self.head_scores is None
                else f"head_scores is kvzip-head's; scorer={self.scorer!r}"
            )
        ratio = ratio_of = None
        if isinstance(budget, float):
            if not 0 < budget < 1:
                raise ValueError(f"budget={budget!r}: a fractional budget must lie in (0, 1)")
            if context is None:
                budget = BUDGET_FOR_CHECKS
            else:
                ratio, ratio_of = compression_ratio(budget), context
                budget = context - int(context * ratio)
        try:
            policy = make_policy(self, budget, ratio=ratio, ratio_of=ratio_of)
        except ValueError as e:
            if ratio is None or not str(e).startswith(f"budget={budget} "):
                raise
            raise ValueError(
                f"budget={self.budget!r} of a {context}-token prompt is {budget} slots: {e}"
            ) from e
        own_pass = policy.scorer.scoring_pass is not None
        protocol = self.protocol or ("prefill" if own_pass else "blockwise")
        decode_evict = (not own_pass) if self.decode_evict is None else self.decode_evict
        if own_pass and (protocol != "prefill" or decode_evict):
            raise ValueError(
                f"scorer={self.scorer!r} scores a prompt once, after the prefill: it needs "
                f"protocol='prefill' (got {protocol!r}) and decode_evict=False "
                f"(got {decode_evict!r})"
            )
        page_size = self.page_size
        if page_size is None and policy.paged:
            page_size = default_page_size(self.kv_dtype)
        return Eviction(
            policy,
            protocol=protocol,
            block_size=self.block_size,
            evict_every=self.evict_every,
            decode_evict=decode_evict,
            page_size=page_size,
            decode_order=self.decode_order,
            kv_dtype=self.kv_dtype,
        )

    def scoring_data(self, cfg) -> ScoringData:
        """The data the scorer's own scoring pass reads for the model ``cfg`` (its repeat prompt, or
        its head scores loaded and checked against the model; empty for other scorers)."""
        scores = None if self.head_scores is None else load_head_scores(self.head_scores, cfg)
        return ScoringData(repeat_prompt=self.repeat_prompt, head_scores=scores)


def check_kv_dtype(kv_dtype) -> None:
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(
            f"kv_dtype={kv_dtype!r} must be None (the model's dtype) or one of {KV_DTYPES}"
        )


def budget_for_bytes(model, nbytes: int, kv_dtype: str | None = None) -> int:
    """Slots per layer and KV head that ``nbytes`` of keys and values hold for one sequence of
    ``model`` (``Params``, or ``(config, dtype)``), stored as ``kv_dtype`` says (scales included):
    ``nbytes // (n_layers · n_kv_heads · bytes per token and head)``, so that methods and dtypes
    compare at equal memory. Under a non-uniform allocation it is the mean budget (the total is the
    same); positions, scorer state and a paged cache's spare pages are not counted."""
    cfg, dtype = (model.config, model.dtype) if hasattr(model, "config") else model
    per_token = bytes_per_token(cfg.head_dim, jnp.dtype(dtype).itemsize, kv_dtype)
    budget = nbytes // (cfg.n_layers * cfg.n_kv_heads * per_token)
    if budget < 1:
        one = cfg.n_layers * cfg.n_kv_heads * per_token
        raise ValueError(
            f"budget_bytes={nbytes} holds no token: one costs {one} bytes over every layer and "
            f"KV head in kv_dtype={kv_dtype!r}"
        )
    return int(budget)


def compression_ratio(fraction: float) -> float:
    """kvpress's ``compression_ratio`` (the fraction removed) of a fractional budget, as a user
    writes it: 1 − fraction in decimal (0.07 -> 0.93, where binary 1 − 0.07 is 0.9299…)."""
    return float(1 - decimal.Decimal(repr(fraction)))


NAMES = tuple(f.name for f in dataclasses.fields(EvictionOptions))
# made by the program from its tokenizer, not given on a command line
NOT_FLAGS = ("repeat_prompt",)
# what a fractional budget stands for when checking options without a prompt
BUDGET_FOR_CHECKS = 1 << 20
DEFAULTS = {f.name: f.default for f in dataclasses.fields(EvictionOptions)}


def eviction_from(context: int | None = None, model=None, **options) -> Eviction | None:
    """``EvictionOptions.of(**options).resolve(context, model)``: the engine configuration of
    eviction keywords."""
    return EvictionOptions.of(**options).resolve(context, model)


def options_table() -> str:
    """The README's Markdown table of the eviction keywords."""
    rows = ["| keyword | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(EvictionOptions):
        choices = f.metadata["choices"]
        allowed = f" (one of {', '.join(map(repr, choices))})" if choices else ""
        rows.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata['help']}{allowed} |")
    return "\n".join(rows)


def with_tokenizer(tokenizer, **options) -> dict[str, Any]:
    """``options`` with what a scorer takes from the model's tokenizer filled in: kvzip's repeat
    prompt (``tokenizer=None``: an empty one, enough to check the other options before a model is
    loaded)."""
    budgeted = options.get("budget") is not None or options.get("budget_bytes") is not None
    if not budgeted or options.get("repeat_prompt") is not None:
        return options
    if BASES[split_name(options.get("scorer", DEFAULTS["scorer"]))[1]].scoring_pass != "kvzip":
        return options
    form = options.get("repeat") or DEFAULT_FORM
    return options | {
        "repeat_prompt": RepeatPrompt((), (), ())
        if tokenizer is None
        else kvzip_prompt(tokenizer, form)
    }


def add_arguments(group, defaults: bool = True, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per option to an argparse group. defaults=False leaves every flag unset
    (None) unless given, for callers that merge them over presets."""
    import argparse

    for f in dataclasses.fields(EvictionOptions):
        if f.name in skip or f.name in NOT_FLAGS:
            continue
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        default = f.default if defaults else None
        text = meta["help"] + (
            " (default: %(default)s)" if defaults and f.default is not None else ""
        )
        if f.type.startswith("bool"):
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=text
            )
        elif meta["choices"] is not None:
            group.add_argument(
                flag,
                choices=[c for c in meta["choices"] if c is not None],
                default=default,
                help=text,
            )
        else:
            kind = {
                "budget": budget_value,
                "budget_bytes": size_value,
                "scorer": str,
                "floor": float,
                "head_scores": str,
            }.get(f.name, int)
            group.add_argument(flag, type=kind, default=default, help=text)


def budget_value(text: str) -> int | float:
    """A command-line budget: a token count ("512") or a fraction of the prompt ("0.25")."""
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a token count (512) nor a fraction of the prompt (0.25)"
    )


SIZE_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size_number(text: str) -> tuple[float, str] | None:
    """(number, upper-case unit) of a size such as "60GiB", "512MiB", "2GB", "1e9"; None if it is
    not one."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in SIZE_UNITS:
        return None
    try:
        return float(match[1]), match[2].upper()
    except ValueError:
        return None


def size_value(text: str) -> int:
    """A command-line size in bytes: "123456", "64MiB", "1.5GiB", "2GB"."""
    found = size_number(text)
    if found is None or not found[0] > 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (for example 123456, 64MiB, 1.5GiB)"
        )
    return int(found[0] * SIZE_UNITS[found[1]])


def memory_bytes(text: str, name: str = "kv_memory") -> int:
    """Memory for caches, read from ``text``: bytes ("60GiB", "512MiB", "2GB", "1e9") or a
    fraction in (0, 1] of the device memory still free ("0.9"); ``name`` labels its errors."""
    value, unit = size_number(text) or (None, None)
    if value is None or not value > 0:
        raise ValueError(
            f"{name} {text!r}: give bytes with a unit (60GiB, 512MiB, 2GB) or a fraction "
            "in (0, 1] of the free device memory"
        )
    if unit or value > 1:
        return int(value * SIZE_UNITS[unit])
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"{name} {text!r}: a fraction needs a device that reports its memory "
            f"({jax.devices()[0].platform} does not); give bytes (60GiB)"
        )
    return int(value * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


def from_arguments(args, names: tuple[str, ...] = NAMES) -> dict[str, Any]:
    """The options an argparse namespace holds (those left unset, None, are omitted)."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
