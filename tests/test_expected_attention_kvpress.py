"""kvjax's ``expected-attention`` against NVIDIA kvpress's ``ExpectedAttentionPress``: the context
positions each (layer, KV head) of SmolLM2 keeps under the prefill protocol, as kvpress 0.5.5
recorded them on the same token ids
(``benchmarks/kvpress_baseline/record_expected_attention_kept.py``, in its own environment, float32
on CPU). Samples: the first 1,000 tokens of the ``pydoc`` haystack and the first 700 of ``licenses``
(``" ".join(kvjax.eval.haystack.sentences(name))``, no special tokens), budgets 64 and 256.
Positions in ``tests/data/kvpress_expected_attention_kept.json.gz``: one hexadecimal bit mask per
(layer, KV head)."""

import gzip
import json
import os

import numpy as np
import pytest

import kvjax

DATA = os.path.join(os.path.dirname(__file__), "data", "kvpress_expected_attention_kept.json.gz")
with gzip.open(DATA, "rt") as _f:
    RECORDS = json.load(_f)["records"]
NEAR_TIES = 1  # positions of 5,760 that float32 rounding moves (licenses, budget 64)


@pytest.mark.parametrize("sample", sorted({r["sample"] for r in RECORDS}))
def test_kept_positions_equal_kvpress(smollm2, sample):
    """kvpress's defaults are kvjax's: 4 sinks, no window, 512 future positions, the mean over the
    query heads; every (layer, KV head) keeps ``budget`` positions, kvpress's but for at most
    NEAR_TIES."""
    records = [r for r in RECORDS if r["sample"] == sample]
    prefilled = kvjax.prefill_full(smollm2, records[0]["context"])
    for record in records:
        context = prefilled.compress(budget=record["budget"], scorer="expected-attention")
        positions = np.asarray(context.cache.sorted_pos)[:, 0]  # [L, Hk, C]
        differ = 0
        for layer, masks in enumerate(record["kept"]):
            for h, mask in enumerate(masks):
                theirs = {p for p in range(len(record["context"])) if int(mask, 16) >> p & 1}
                mine = {int(p) for p in positions[layer, h] if p >= 0}
                assert len(mine) == len(theirs) == record["budget"]
                differ += len(mine - theirs)
        assert differ <= NEAR_TIES, (record["budget"], differ)
