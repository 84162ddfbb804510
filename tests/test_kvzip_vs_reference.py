"""KVzip end to end against the NumPy reference (tests/reference_eviction.py, run_kvzip_reference):
the kept positions of every (layer, row, KV head) after ``kvjax.prefill``, its logits and moment
statistics, and the greedy tokens of ``kvjax.decode(..., evict=False)`` after a question and of
``kvjax.generate``; KVzip's names with GQA, a right-padded batch, both forms of the repeat prompt,
contexts of several repeat chunks and budgets at the prompt's length."""

import json

import numpy as np
import pytest
from helpers import distinct_prompts
from helpers import kept_positions as kept
from reference_eviction import assert_kept_sums, full_forward, run_kvzip_reference
from reference_quantized import resolved

import kvjax
import kvjax.runtime.kvzip_pass
from kvjax.eviction import RepeatPrompt

PROMPTS = distinct_prompts((37, 20))  # a right-padded batch
QUESTIONS = distinct_prompts((6, 3), seed=1)
PAPER = RepeatPrompt(first=(5, 6, 7), later=(5, 6, 8), colon=(9,), form="paper")
# kvpress's form: a 5-token template head neither repeated nor scored, 4 sinks in every softmax
KVPRESS = RepeatPrompt(
    first=(5, 6, 7, 11, 12), later=(5, 6, 8), colon=(11, 12), skip=5, sinks=4, form="kvpress"
)
CHUNK = 16  # repeat chunks: 3 and 2 of the rows under the paper's form, 2 and 1 under kvpress's
BUDGET = 14
NEW = 5
LOGITS = dict(atol=1e-4, rtol=1e-4)  # float32 against float64, as tests/test_engine_vs_reference.py


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Repeat chunks of CHUNK tokens in kvjax (``kvzip_scores`` binds kvjax.runtime.kvzip_pass.CHUNK
    as its default when it is defined: patching CHUNK would change nothing)."""
    monkeypatch.setattr(kvjax.runtime.kvzip_pass.kvzip_scores, "__defaults__", (CHUNK,))


def check(model, settings: dict, *, generate: bool = False, head_scores=None) -> list[dict]:
    """The engine against the reference, row by row: kept positions, prefill logits and moments
    of ``kvjax.prefill``; tokens of ``kvjax.decode`` (a question, no eviction) and ``generate``."""
    options = {k: v for k, v in settings.items() if k != "head_scores"}
    if head_scores is not None:
        options |= dict(head_scores=head_scores)
    if head_scores is not None or isinstance(settings["budget"], float):
        options |= dict(context=max(len(p) for p in PROMPTS))
    context = kvjax.prefill(model, PROMPTS, **settings)
    pos, moments = np.asarray(context.cache.sorted_pos), context.cache.moments
    sums = assert_kept_sums(moments, settings["scorer"])  # only what MomentKV reads
    answers = kvjax.decode(model, context, QUESTIONS, NEW, evict=False, stop_ids=())
    got = kvjax.generate(model, PROMPTS, NEW, stop_ids=(), **settings) if generate else None

    def compare(row, ref):
        # exact agreement is only well posed away from near ties (exact ones follow the tie rule)
        assert ref["near_ties"] - ref["exact_ties"] == 0, f"row {row}: near ties"
        assert kept(pos, row) == ref["kept_after_prefill"], f"row {row}"
        logits, count = np.asarray(context.logits[row]), np.asarray(moments.count[:, row])
        np.testing.assert_allclose(logits, ref["prefill_logits"], **LOGITS)
        np.testing.assert_array_equal(count, ref["moments"]["count"])
        for name in sums:
            expected = ref["moments"][name]
            np.testing.assert_allclose(
                np.asarray(getattr(moments, name)[:, row]),
                expected,
                atol=1e-5 * max(1.0, np.abs(expected).max()),
                rtol=1e-4,
            )
        assert answers[row].tolist() == ref["tokens"], f"row {row}: the answer's tokens"

    refs = [
        resolved(
            lambda p=p, q=q: run_kvzip_reference(model, p, NEW, question=q, chunk=CHUNK, **options),
            lambda ref, row=row: compare(row, ref),
        )
        for row, (p, q) in enumerate(zip(PROMPTS, QUESTIONS, strict=True))
    ]
    if generate:
        for row, p in enumerate(PROMPTS):
            resolved(
                lambda p=p: run_kvzip_reference(model, p, NEW, chunk=CHUNK, **options),
                lambda ref, row=row: _equal(got[row].tolist(), ref["tokens"]),
            )
    return refs


def _equal(got, want):
    assert got == want, (got, want)


# Left out for time (each NC scorer compiles its own decoding, ~5 s): kvzip+momentkv-nc (kvzip's
# choice, momentkv's correction) and kvzip+momentkv-zeroth; tests/test_prefilled.py checks them
# against the reference with --runslow.
CASES = [
    dict(scorer="kvzip", repeat_prompt=PAPER, n_sink=2),
    dict(scorer="kvzip", repeat_prompt=KVPRESS),  # its default n_sink=4, the sinks of the softmax
    dict(scorer="kvzip+caote", repeat_prompt=PAPER, n_sink=1, window=2),
    dict(scorer="kvzip+fastcaote", repeat_prompt=KVPRESS, n_sink=2),
    dict(scorer="kvzip+momentkv", repeat_prompt=PAPER, n_sink=1),
    dict(scorer="kvzip+momentkv-mi", repeat_prompt=KVPRESS, n_sink=2),
    dict(scorer="uniform+kvzip", repeat_prompt=PAPER, n_sink=2),
    dict(scorer="global+kvzip", repeat_prompt=KVPRESS, n_sink=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["scorer"] + "-" + c["repeat_prompt"].form)
def test_kvzip_matches_reference(tiny_llama, case):
    generate = case["scorer"] == "kvzip" and case["repeat_prompt"] is PAPER  # kvjax.generate too
    refs = check(tiny_llama, case | dict(budget=BUDGET), generate=generate)
    assert all(r["moments"]["count"].sum() > 0 for r in refs)  # both rows lost tokens


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_kvzip_on_a_quantized_cache_matches_reference(tiny_llama, kv_dtype):
    """The repeat pass reads the keys as the cache holds them (round-tripped in the oracle)."""
    check(tiny_llama, dict(scorer="kvzip", repeat_prompt=KVPRESS, budget=BUDGET, kv_dtype=kv_dtype))


@pytest.mark.parametrize("budget", [5, 0.2])
def test_global_puts_no_limit_on_a_head(tiny_llama, budget):
    """global+kvzip as kvpress's KVzipPress(): one head keeps more than n_kv_heads × budget (the
    limit under an allocation that evicts again), and a fractional budget keeps kvpress's count,
    L·Hk·n − ⌊L·Hk·n·0.8⌋ over the longest prompt n (here not a multiple of L·Hk)."""
    cfg, layers = tiny_llama.config, tiny_llama.layers
    # layer 0's first KV head attends more sharply (its queries ×3), so its tokens score higher
    peaked = tiny_llama.replace(
        layers=layers.replace(wqkv=layers.wqkv.at[0, :, 0, : cfg.group_size].multiply(3))
    )
    refs = check(
        peaked, dict(scorer="global+kvzip", repeat_prompt=KVPRESS, n_sink=2, budget=budget)
    )
    per_head = 5 if budget == 5 else max(map(len, PROMPTS)) - int(max(map(len, PROMPTS)) * 0.8)
    most = max(len(h) for r in refs for layer in r["kept_after_prefill"] for h in layer)
    assert most > cfg.n_kv_heads * per_head
    if isinstance(budget, float):
        rows, n = cfg.n_layers * cfg.n_kv_heads, max(map(len, PROMPTS))
        assert (
            sum(len(h) for layer in refs[0]["kept_after_prefill"] for h in layer)
            == rows * n - int(rows * n * 0.8)
            == 30
        )


def test_kvzip_head_matches_reference(tiny_llama, tiny_head_scores):
    """Whole heads by the saved scores: round(4 · (20 − 4)/(37 − 4)) = 2 heads keep the context (n:
    the batch's longest prompt), the others their sink and window."""
    with open(tiny_head_scores) as f:
        heads = np.asarray(json.load(f)["scores"])
    refs = check(
        tiny_llama,
        dict(scorer="kvzip-head", budget=20, n_sink=1, window=3, head_scores=tiny_head_scores),
        generate=True,
        head_scores=heads,
    )
    sizes = sorted(len(h) for layer in refs[0]["kept_after_prefill"] for h in layer)
    assert sizes == [4, 4, 37, 37]


def test_whole_heads_longer_than_the_decoding_slots_survive(tiny_llama, tmp_path):
    """kvzip-head's whole heads of a 900-token context, longer than the slots a budget of 240 gives
    decoding (240 rounded up to CAPACITY_STEP, plus the question's and the answer's), are all
    attended while the question and the answer are decoded: the tokens equal the reference's."""
    import dataclasses

    from kvjax.runtime.kvzip_pass import save_head_scores

    model = tiny_llama.replace(config=dataclasses.replace(tiny_llama.config, max_seq_len=1024))
    heads, path = np.linspace(0, 1, 4).reshape(2, 2), str(tmp_path / "heads.json")
    save_head_scores(path, heads, model.config)
    # kvzip-head ranks whole heads, not tokens: repeated tokens make no ties
    prompt, question = (
        np.random.default_rng(2).integers(4, 97, 900).astype(np.int32),
        np.arange(5, 11),
    )
    settings = dict(scorer="kvzip-head", budget=240, n_sink=1, window=3)  # one whole head of four
    ref = run_kvzip_reference(
        model, prompt, 8, question=question, head_scores=heads, context=len(prompt), **settings
    )
    assert max(len(h) for layer in ref["kept_after_prefill"] for h in layer) == len(prompt)
    context = kvjax.prefill(model, prompt, head_scores=path, **settings)
    # (when decoding fitted the context into 640 slots per head, the whole head lost 522 of its 906
    # tokens and the 4th token differed)
    assert (
        kvjax.decode(model, context, question, 8, evict=False, stop_ids=()).tolist()
        == ref["tokens"]
    )


@pytest.mark.parametrize("scorer, budget", [("kvzip", 37), ("kvzip", 36), ("kvzip-head", 37)])
def test_budget_at_the_prompt_length(tiny_llama, tiny_head_scores, scorer, budget):
    """A budget of the longest prompt keeps every token, and the reference's continuation is then a
    plain full causal pass's; one less evicts from the longest row only."""
    with open(tiny_head_scores) as f:
        heads = np.asarray(json.load(f)["scores"])
    head = scorer == "kvzip-head"
    needs = dict(head_scores=tiny_head_scores) if head else dict(repeat_prompt=KVPRESS)
    refs = check(
        tiny_llama,
        dict(scorer=scorer, budget=budget, n_sink=2, window=1) | needs,
        head_scores=heads if head else None,
    )
    lost = [int(r["moments"]["count"].sum()) for r in refs]
    assert lost == ([2 + 2, 0] if budget == 36 else [0, 0])  # each layer: 2 × 36 slots for 2 × 37
    if budget == 37:
        for prompt, question, ref in zip(PROMPTS, QUESTIONS, refs, strict=True):
            tokens = [*prompt, *question]
            for _ in range(NEW):
                tokens.append(int(np.argmax(full_forward(tiny_llama, tokens)[-1])))
            assert ref["tokens"] == tokens[-NEW:]


def test_repeat_chunks_change_what_is_kept(tiny_llama):
    """The chunking the tests above run (CHUNK tokens) keeps other positions than one chunk would,
    so their agreement checks the engine's chunks."""
    settings = dict(scorer="kvzip", budget=BUDGET, repeat_prompt=PAPER, n_sink=2)
    short, whole = (
        run_kvzip_reference(tiny_llama, PROMPTS[0], 0, chunk=c, **settings) for c in (CHUNK, 2048)
    )
    assert short["kept_after_prefill"] != whole["kept_after_prefill"]
