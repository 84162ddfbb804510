"""kvjax's ``kvzip`` (defaults: ``repeat="kvpress"``) against NVIDIA kvpress's ``KVzipPress``: the context positions
each (layer, KV head) of SmolLM2 keeps, as kvpress 0.5.5 recorded them on the same token ids
(``benchmarks/kvpress_baseline/record_kvzip_kept.py``, in its own environment, float32 on CPU) for two prose
samples of ``sentence-number``: 980 tokens (one chunk) and 2,355 tokens (two chunks, the second prompted with
"...starting with" + 8 tokens), budgets 128 and 256. Positions in ``tests/data/kvpress_kvzip_kept.json.gz``:
one hexadecimal bit mask per (layer, KV head)."""

import gzip
import json
import os

import numpy as np
import pytest

import kvjax
from kvjax.runtime.options import with_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data", "kvpress_kvzip_kept.json.gz")
with gzip.open(DATA, "rt") as _f:
    RECORDS = json.load(_f)["records"]
NEAR_TIES = 2  # positions of 11,520 that float32 rounding moves from one head to another (layers 4 and 22, 980/128)


def kept_sets(record) -> list[list[set[int]]]:
    return [[{p for p in range(len(record["context"])) if int(mask, 16) >> p & 1} for mask in layer]
            for layer in record["kept"]]


@pytest.mark.parametrize("record", [pytest.param(r, id=f"{len(r['context'])}-{r['budget']}",
                                                 marks=[] if (len(r["context"]), r["budget"]) == (980, 128) else [pytest.mark.slow])
                                    for r in RECORDS])
def test_kept_positions_equal_kvpress(smollm2, smollm2_tokenizer, record):
    """With kvzip's defaults, every layer keeps n_kv_heads × budget positions, and they are kvpress's but for at
    most NEAR_TIES."""
    context = kvjax.prefill(smollm2, record["context"], **with_tokenizer(
        smollm2_tokenizer, budget=record["budget"], scorer="kvzip"))
    positions = np.asarray(context.cache.sorted_pos)[:, 0]  # [L, Hk, C]
    theirs, differ = kept_sets(record), 0
    for layer, heads in enumerate(theirs):
        mine = [{int(p) for p in positions[layer, h] if p >= 0} for h in range(len(heads))]
        assert sum(map(len, mine)) == sum(map(len, heads)) == len(heads) * record["budget"]
        differ += sum(len(m - t) for m, t in zip(mine, heads, strict=True))
    assert differ <= NEAR_TIES, differ


def test_kvpress_prompt_is_kvpress_wording_inside_the_assistant_turn(smollm2_tokenizer):
    """kvpress's repeat prompt: its wording, then the end of the user turn and the assistant header; the chat
    template's head (what precedes the user's text) is skipped; 4 sinks."""
    from kvjax.eviction import kvzip_prompt
    from kvjax.loading import chat_parts

    tok, p = smollm2_tokenizer, kvzip_prompt(smollm2_tokenizer, "kvpress")
    turn = "<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(list(p.first)) == "\n\nRepeat the previous context exactly." + turn
    assert tok.decode(list(p.later)) == "\n\nRepeat the part of the previous context exactly, starting with"
    assert tok.decode(list(p.colon)) == turn and (p.sinks, p.form) == (4, "kvpress")
    head = chat_parts(tok, "", "Hello")[0]
    assert p.skip == len(head) == 24 and tok.decode(head).endswith("<|im_start|>user\n")
    paper = kvzip_prompt(tok, "paper")
    assert tok.decode(list(paper.first)) == "\n\nRepeat the previous context:" and (paper.skip, paper.sinks) == (0, 0)
