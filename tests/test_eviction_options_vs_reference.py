"""AdaKV's two floor readings (``floor_mode``) and the decode order (``decode_order``) against the
NumPy reference (tests/reference_eviction.py), with the checks of test_engine_vs_reference.py: the
same kept positions after every step, logits to 1e-4 and the moment statistics, with GQA and a
right-padded batch. (A module of its own: one module's compiled programs are released together, and
more of them in one process exhaust XLA:CPU's memory mappings; see conftest.py.)"""

import jax
import numpy as np
import pytest
from reference_eviction import run_reference
from test_engine_vs_reference import (
    BLOCK,
    BUDGET,
    NEW_TOKENS,
    check_against_reference,
    distinct_prompts,
)

import kvjax


@pytest.fixture(scope="module")
def model3():
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=89,
        d_model=48,
        n_layers=3,
        n_heads=6,
        n_kv_heads=2,
        head_dim=8,
        d_ff=64,
        max_seq_len=512,
        norm_eps=1e-5,
        eos_token_ids=(3,),
        pad_token_id=0,
    )
    return kvjax.init_params(cfg, jax.random.key(5), scale=0.4)


def test_adakv_floor_modes_match_reference(model3):
    """AdaKV's floor (the sinks and window plus ⌊α (b − n_sink − window)⌋: 13 here) and kvpress's
    (⌊α b⌋, the protected among them: 12), each against the reference, at an α where they keep
    different tokens."""
    case = dict(
        scorer="snapkv",
        n_sink=2,
        window=4,
        obs_window=4,
        pool="max",
        kernel=3,
        allocation="adakv",
        floor=0.9,
        page_size=4,
    )
    kept = [
        [
            r["kept_after_prefill"]
            for r in check_against_reference(
                model3, case | dict(floor_mode=mode), "prefill", 2, distinct_prompts()
            )
        ]
        for mode in ("adakv", "kvpress")
    ]
    assert kept[0] != kept[1]


# decode_order="evict-first": each layer evicts as soon as its attention has scored the new token
# and outputs the attention over the tokens it keeps, which the reference recomputes from scratch
# without the evicted ones (with MomentKV's correction from the moments that now hold them); dense
# and paged caches.
EVICT_FIRST_CASES = [
    dict(scorer="tova", n_sink=2, window=0),
    dict(scorer="h2o+caote", n_sink=2, window=3),
    dict(scorer="momentkv", n_sink=1, window=4, obs_window=4, pool="max", kernel=3),
    dict(
        scorer="snapkv+obcache-key",
        n_sink=2,
        window=4,
        obs_window=4,
        pool="max",
        kernel=3,
        allocation="adakv",
        page_size=4,
    ),
    dict(
        scorer="h2o+momentkv-nc", n_sink=0, window=0, budget=20, allocation="pyramidkv", page_size=4
    ),
    # the in-layer eviction reads its layer of the statistics, stacked and just added to
    dict(scorer="expected-attention", n_sink=2, window=0),
    dict(scorer="expected-attention", n_sink=1, window=2, allocation="adakv", page_size=4),
]


@pytest.mark.parametrize("evict_every", [1, 3])
@pytest.mark.parametrize(
    "case", EVICT_FIRST_CASES, ids=lambda c: f"{c['scorer']}-{c.get('allocation', 'uniform')}"
)
def test_evict_first_decoding_matches_reference(model3, case, evict_every):
    refs = check_against_reference(
        model3, case | dict(decode_order="evict-first"), "prefill", evict_every, distinct_prompts()
    )
    settings = (
        dict(budget=BUDGET, protocol="prefill", block_size=BLOCK, evict_every=evict_every) | case
    )
    attend_first = run_reference(
        model3,
        distinct_prompts()[0],
        NEW_TOKENS,
        **{k: v for k, v in settings.items() if k != "page_size"},
    )
    assert not np.allclose(
        refs[0]["step_logits"], attend_first["step_logits"]
    )  # the order matters here
