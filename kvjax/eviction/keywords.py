"""The eviction keywords, declared once: ``EvictionKeywords`` holds each one's name, default,
allowed values and help. ``kvjax.runtime.options.EvictionOptions`` (what the entry points take,
and the CLI's flags) adds their resolution to it; ``Policy`` takes its fields for the keywords it
holds (``POLICY_KEYWORDS``) from it.
"""

from __future__ import annotations

import dataclasses

from kvjax.eviction.allocations import ALLOCATIONS, FLOOR_MODES
from kvjax.eviction.kvzip import DEFAULT_FORM, FORMS, RepeatPrompt
from kvjax.eviction.priority import AGGREGATES, POOLS
from kvjax.kernels import IMPLS
from kvjax.kernels.quantized import KV_DTYPES

PROTOCOLS = ("blockwise", "prefill")
# A decode step's order: "attend-first" (every layer attends over its kept tokens and the new one;
# the step then evicts in every layer) or "evict-first" (CAOTE's Eq. 5-7, MomentKV's Algorithm 1:
# each layer evicts as soon as its attention has scored the new token and outputs the attention
# over the tokens it keeps).
DECODE_ORDERS = ("attend-first", "evict-first")
# the keywords a ``Policy`` holds (resolved: the scorer's defaults in place of None)
POLICY_KEYWORDS = (
    "n_sink",
    "window",
    "obs_window",
    "pool",
    "kernel",
    "aggregate",
    "mi_batch",
    "impl",
    "allocation",
    "floor",
    "chunk",
    "floor_mode",
)


def _option(default, help: str, choices: tuple | None = None):
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class EvictionKeywords:
    """Every eviction keyword with its default. ``None`` where the default depends on the
    scorer."""

    budget: int | float | None = _option(
        None,
        "KV slots kept per layer and KV head (on average, under a "
        "non-uniform allocation); a float f in (0, 1) is a fraction of the longest "
        "prompt, kept as kvpress keeps it at compression_ratio=1-f; None keeps the full cache",
    )
    budget_bytes: int | None = _option(
        None,
        "instead of budget: the bytes of keys and values (scales included) one sequence keeps, "
        "over every layer and KV head; the budget is as many slots per head as they hold in "
        "kv_dtype (kvjax.budget_for_bytes)",
    )
    kv_dtype: str | None = _option(
        None,
        "how the cache stores keys (after RoPE) and values: None = the model's dtype; int8 and "
        "float8_e4m3fn with one bfloat16 scale per token and KV head; int4 (two a byte, one "
        "scale per token and KV head); the full cache too (docs: Using kvjax, 'Quantized keys "
        "and values')",
        KV_DTYPES,
    )
    scorer: str = _option(
        "snapkv", "a base or base+modifier (kvjax.SCORERS; docs: Using kvjax, 'Scorer names')"
    )
    protocol: str | None = _option(
        None,
        "blockwise: evict after every prompt block (CAOTE); prefill: prefill, "
        "then evict once (SnapKV). None: prefill for kvzip and kvzip-head, else "
        "blockwise",
        PROTOCOLS,
    )
    block_size: int = _option(128, "prompt tokens per block")
    n_sink: int = _option(4, "first tokens never evicted")
    window: int | None = _option(
        None,
        "most recent tokens never evicted (None: the scorer's: 0 for "
        "streamingllm and tova, budget // 4 for h2o, obs_window for snapkv)",
    )
    obs_window: int = _option(32, "observation window: the scoring queries of snapkv")
    pool: str | None = _option(
        None, "pooling of the priorities along positions (None: the scorer's)", POOLS
    )
    kernel: int = _option(7, "pooling kernel size (odd)")
    aggregate: str | None = _option(
        None,
        "how the query heads of a KV head combine (None: sum for OBCache, "
        "else mean; layer: the mean over every head of the layer)",
        AGGREGATES,
    )
    evict_every: int = _option(1, "decode steps between evictions (that many spare slots)")
    decode_evict: bool | None = _option(
        None,
        "evict while decoding (False: the cache grows by the new tokens; "
        "None: False for kvzip and kvzip-head, else True)",
    )
    decode_order: str = _option(
        "attend-first",
        "a decode step's order: attend-first = every layer attends over its "
        "kept tokens and the new one, then evicts; evict-first = each layer evicts once its "
        "attention has scored, and outputs the attention over the tokens it keeps (CAOTE Eq. "
        "5-7, MomentKV Algorithm 1)",
        DECODE_ORDERS,
    )
    impl: str | None = _option(
        None,
        "attention with scores (the full cache's: its decode steps'): None = XLA on CPU, the "
        "Pallas kernels on TPU and CUDA; pallas = the platform's kernels (interpreted on CPU)",
        IMPLS,
    )
    mi_batch: int = _option(
        1,
        "MomentKV: tokens its moment-informed eviction removes per statistics update "
        "(1 = Algorithm 1's exact rule)",
    )
    allocation: str | None = _option(
        None,
        "how many tokens each layer and KV head keeps (None: the scorer "
        "name's prefix, else uniform; docs: Using kvjax, 'Allocations')",
        tuple(ALLOCATIONS),
    )
    floor: float | None = _option(
        None,
        "under adakv / global: the fraction of the budget every KV head keeps "
        "at least, as floor_mode counts it (None: 0.2 for adakv, AdaKV's α, but 0 "
        "with KVzip, as kvpress; 0 for global)",
    )
    floor_mode: str = _option(
        "adakv",
        "how the floor counts a head's sinks and window: adakv keeps floor × "
        "(budget − n_sink − window) more tokens on top of them (AdaKV's code); kvpress "
        "keeps floor × budget, the protected among them (kvpress's AdaKVPress)",
        FLOOR_MODES,
    )
    chunk: int = _option(
        1,
        "tokens of `chunk` consecutive positions share the mean of their priorities, so "
        "spans are kept whole (1: each token by itself)",
    )
    page_size: int | None = _option(
        None,
        "tokens per page of the paged cache (None: 16 for the non-uniform allocations, which "
        "are paged, or 32 with a quantized kv_dtype; uniform keeps one dense block per head)",
    )
    repeat: str | None = _option(
        None,
        "kvzip: the repeat prompt's form (kvjax.kvzip_prompt): kvpress = NVIDIA "
        "kvpress KVzipPress's, repeated as the assistant after the chat template's head; "
        f"paper = the KVzip code's, over the whole context (None: {DEFAULT_FORM})",
        FORMS,
    )
    repeat_prompt: RepeatPrompt | None = _option(
        None,
        "kvzip: the repeat prompt's token ids, "
        "kvjax.kvzip_prompt(tokenizer, repeat) (the CLI makes it)",
    )
    head_scores: str | None = _option(
        None,
        "kvzip-head: the file of head scores saved from a calibration "
        "context (python -m kvjax kvzip-heads)",
    )
