"""kvjax's KVzip (defaults: ``repeat="kvpress"``) against NVIDIA kvpress's ``KVzipPress``: the
context positions each (layer, KV head) of SmolLM2 keeps, as kvpress 0.5.5 recorded them on the same
token ids (``benchmarks/kvpress_baseline/record_kvzip_kept.py``, in its own environment, float32 on
CPU) for two prose samples of ``sentence-number``: 980 tokens (one chunk) and 2,355 tokens (two
chunks, the second prompted with "...starting with" + 8 tokens).

- ``kvpress_kvzip_kept.json.gz``: ``KVzipPress(layerwise=True)`` = kvjax's ``adakv+kvzip`` (one
  layer's KV heads share its budget), at 128 and 256 per KV head and at ``compression_ratio=0.93``;
- ``kvpress_kvzip_global_kept.json.gz``: ``KVzipPress()`` (kvpress's default) = kvjax's
  ``global+kvzip`` (one threshold over every layer and KV head, no limit on one head), at 128 per KV
  head and at 0.93.

kvjax's budget for a ratio r is the fraction 1 − r as written (``budget=0.07`` for 0.93). Positions:
one hexadecimal bit mask per (layer, KV head)."""

import decimal
import gzip
import json
import os

import numpy as np
import pytest

import kvjax
from kvjax.runtime.options import with_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")
PRESSES = {"kvzip": "adakv+kvzip", "kvzip_global": "global+kvzip"}
RECORDS = []
for _name in ("kvpress_kvzip_kept.json.gz", "kvpress_kvzip_global_kept.json.gz"):
    with gzip.open(os.path.join(DATA, _name), "rt") as _f:
        _data = json.load(_f)
    RECORDS += [r | {"press": _data["press"]} for r in _data["records"]]
# positions of 11,520 that float32 rounding moves from one head to another (layers 4 and 22, 980
# tokens, 128 per head, layerwise); every other record: none
NEAR_TIES = 2


def budget_of(record) -> int | float:
    """kvjax's budget for the record: tokens per KV head, or the fraction 1 − ratio as written."""
    if record["budget"] is not None:
        return record["budget"]
    return float(1 - decimal.Decimal(repr(record["ratio"])))


def record_id(record) -> str:
    return f"{record['press']}-{len(record['context'])}-{budget_of(record)}"


def kept_sets(record) -> list[list[set[int]]]:
    return [
        [{p for p in range(len(record["context"])) if int(mask, 16) >> p & 1} for mask in layer]
        for layer in record["kept"]
    ]


@pytest.fixture(scope="module")
def prefilled(smollm2):
    """One full prefill per context (the records of a context share its KVzip pass, as kvjax.prefill
    runs it)."""
    made = {}

    def get(context):
        if len(context) not in made:
            made[len(context)] = kvjax.prefill_full(smollm2, context)
        return made[len(context)]

    return get


# The default run: the one-chunk records. Those of 2,355 tokens (two repeat chunks) run with
# --runslow: one took 175 s of a 25-minute suite (2026-11-30), its KVzip pass alone 77 s; the chunks
# are checked in the default run against the NumPy reference (test_kvzip_vs_reference.py).


@pytest.mark.parametrize(
    "record",
    [
        pytest.param(
            r,
            id=record_id(r),
            marks=[] if len(r["context"]) == 980 else [pytest.mark.slow],
        )
        for r in RECORDS
    ],
)
def test_kept_positions_equal_kvpress(prefilled, smollm2_tokenizer, record):
    """Every (layer, KV head) keeps kvpress's positions but for at most NEAR_TIES, and the counts
    are kvpress's: per layer n_kv_heads·n − ⌊n_kv_heads·n·r⌋ (layerwise), over all layers
    L·n_kv_heads·n − ⌊L·n_kv_heads·n·r⌋ (global), whatever one head keeps."""
    context = prefilled(record["context"]).compress(
        **with_tokenizer(
            smollm2_tokenizer, budget=budget_of(record), scorer=PRESSES[record["press"]]
        )
    )
    positions = np.asarray(context.cache.sorted_pos)[:, 0]  # [L, Hk, C]
    theirs = kept_sets(record)
    n, L, Hk = len(record["context"]), len(theirs), len(theirs[0])
    mine = [
        [{int(p) for p in positions[layer, h] if p >= 0} for h in range(Hk)] for layer in range(L)
    ]
    rows = Hk if record["press"] == "kvzip" else L * Hk
    expected = rows * n - int(rows * n * record["ratio"])
    if record["press"] == "kvzip":
        assert all(
            sum(map(len, heads)) == sum(map(len, t)) == expected for heads, t in zip(mine, theirs)
        )
    else:
        assert (
            sum(len(h) for heads in mine for h in heads)
            == sum(len(h) for t in theirs for h in t)
            == expected
        )
        assert max(len(h) for heads in mine for h in heads) > Hk * n * (
            1 - record["ratio"]
        )  # no cap on a head
    differ = sum(
        len(m - t) for heads, ts in zip(mine, theirs) for m, t in zip(heads, ts, strict=True)
    )
    assert differ <= (
        NEAR_TIES if (record["press"], n, record["budget"]) == ("kvzip", 980, 128) else 0
    ), differ


def test_fractional_budget_is_kvpress_compression_ratio():
    """budget=f keeps what kvpress keeps at compression_ratio=1−f as written: 0.07 is 0.93, not 1 −
    0.07 = 0.9299…, so 1,000 tokens keep 70 per head (⌈0.07 · 1000⌉ would be 71 in binary floating
    point)."""
    from kvjax.runtime.options import compression_ratio, eviction_from

    assert compression_ratio(0.07) == 0.93 and compression_ratio(0.25) == 0.75
    policy = eviction_from(1000, budget=0.07, scorer="adakv+snapkv").policy
    assert (policy.budget, policy.ratio, policy.ratio_of) == (70, 0.93, 1000)
    assert policy.group_budget(3) == 3000 - int(3000 * 0.93) == 210
    assert eviction_from(1000, budget=70, scorer="adakv+snapkv").policy.group_budget(3) == 210
    policy = eviction_from(980, budget=0.07, scorer="snapkv").policy
    assert (policy.budget, policy.group_budget(90)) == (
        980 - int(980 * 0.93),
        90 * 980 - int(90 * 980 * 0.93),
    )


def test_kvpress_prompt_is_kvpress_wording_inside_the_assistant_turn(smollm2_tokenizer):
    """kvpress's repeat prompt: its wording, then the end of the user turn and the assistant header;
    the chat template's head (what precedes the user's text) is skipped; 4 sinks."""
    from kvjax.eviction import kvzip_prompt
    from kvjax.loading import chat_parts

    tok, p = smollm2_tokenizer, kvzip_prompt(smollm2_tokenizer, "kvpress")
    turn = "<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(list(p.first)) == "\n\nRepeat the previous context exactly." + turn
    assert (
        tok.decode(list(p.later))
        == "\n\nRepeat the part of the previous context exactly, starting with"
    )
    assert tok.decode(list(p.colon)) == turn and (p.sinks, p.form) == (4, "kvpress")
    head = chat_parts(tok, "", "Hello")[0]
    assert p.skip == len(head) == 24 and tok.decode(head).endswith("<|im_start|>user\n")
    paper = kvzip_prompt(tok, "paper")
    assert tok.decode(list(paper.first)) == "\n\nRepeat the previous context:" and (
        paper.skip,
        paper.sinks,
    ) == (0, 0)
