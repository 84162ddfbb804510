"""Self-checks of the NumPy eviction reference (tests/reference_eviction.py); independent of the JAX
engine."""

import itertools

import jax
import numpy as np
import pytest
from helpers import N, P, defaults
from reference_eviction import (
    BASES,
    SCORERS,
    Reference,
    full_forward,
    pool_priorities,
    run_reference,
    select_kept,
    softmax,
)

import kvjax

PROTOCOLS = ("blockwise", "prefill")


def all_logits(result):
    return np.stack([result["prefill_logits"], *result["step_logits"]])


# --------------------------------------------------------------------------------------------------
# Budget large enough: no eviction, identical to the full cache
# --------------------------------------------------------------------------------------------------


def test_no_eviction_reference_matches_plain_forward_and_kvjax(params, prompt, no_eviction):
    seq = prompt + no_eviction["tokens"]
    assert len(no_eviction["step_logits"]) == N
    full64 = full_forward(params, seq)
    np.testing.assert_allclose(all_logits(no_eviction), full64[P - 1 :], rtol=0, atol=1e-10)
    # greedy: each generated token is the argmax of the logits before it
    assert no_eviction["tokens"] == [int(np.argmax(x)) for x in all_logits(no_eviction)[:-1]]
    full32 = np.asarray(kvjax.forward(params, np.asarray(seq, np.int32)))[0]
    np.testing.assert_allclose(full32, full64, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("qwen3", True)])
def test_qwen_variants_match_kvjax(arch, tie):
    """Biases (qwen2), q/k RMSNorm (qwen3) and tied embeddings (logits = hidden @ embed.T)."""
    cfg = kvjax.ModelConfig(
        arch=arch,
        vocab_size=53,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=48,
        max_seq_len=128,
        norm_eps=1e-6,
        tie_embeddings=tie,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )
    params = kvjax.init_params(cfg, jax.random.key(2), scale=0.3)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 53, 30)]
    r = run_reference(
        params,
        prompt,
        5,
        scorer="h2o",
        budget=None,
        protocol="blockwise",
        block_size=8,
        n_sink=0,
        window=0,
    )
    seq = prompt + r["tokens"]
    full64 = full_forward(params, seq)
    np.testing.assert_allclose(all_logits(r), full64[len(prompt) - 1 :], rtol=0, atol=1e-10)
    full32 = np.asarray(kvjax.forward(params, np.asarray(seq, np.int32)))[0]
    np.testing.assert_allclose(full32, full64, rtol=0, atol=1e-4)


@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("scorer", SCORERS)  # every name: with nothing evicted, NC is a no-op too
def test_budget_covering_everything_is_the_full_cache(
    params, prompt, no_eviction, scorer, protocol, block_size
):
    budget = P + N
    r = run_reference(
        params,
        prompt,
        N,
        scorer=scorer,
        budget=budget,
        protocol=protocol,
        block_size=block_size,
        **defaults(scorer, budget),
    )
    assert r["tokens"] == no_eviction["tokens"]
    np.testing.assert_allclose(all_logits(r), all_logits(no_eviction), rtol=0, atol=1e-10)
    assert r["kept_after_prefill"] == [[list(range(P))] * 2] * 2
    assert r["kept_after_steps"][-1] == [[list(range(P + N))] * 2] * 2
    assert all(np.all(m == 0) for m in r["moments"].values())
    assert r["near_ties"] == 0


# --------------------------------------------------------------------------------------------------
# StreamingLLM: sinks plus the most recent tokens
# --------------------------------------------------------------------------------------------------


def streaming_kept(seen, budget, n_sink):
    if seen <= budget:
        return list(range(seen))
    return list(range(n_sink)) + list(range(seen - (budget - n_sink), seen))


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("evict_every", [1, 3])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_streamingllm_keeps_sinks_and_most_recent(params, prompt, protocol, evict_every, window):
    budget, n_sink, m = 20, 4, 16
    r = run_reference(
        params,
        prompt,
        N,
        scorer="streamingllm",
        budget=budget,
        protocol=protocol,
        block_size=m,
        n_sink=n_sink,
        window=window,
        evict_every=evict_every,
    )
    ends = list(range(m, P, m)) + [P] if protocol == "blockwise" else [P]
    assert len(r["kept_after_blocks"]) == len(ends)
    for end, kept in zip(ends, r["kept_after_blocks"]):
        assert kept == [[streaming_kept(end, budget, n_sink)] * 2] * 2
    assert r["kept_after_prefill"] == r["kept_after_blocks"][-1]
    expected = streaming_kept(P, budget, n_sink)
    for s, kept in enumerate(r["kept_after_steps"], start=1):
        expected = expected + [P + s - 1]
        if s % evict_every == 0:
            expected = streaming_kept(P + s, budget, n_sink)
        assert kept == [[expected] * 2] * 2, s
    assert r["near_ties"] == 0
    np.testing.assert_array_equal(r["moments"]["count"], P + N - len(expected))


# --------------------------------------------------------------------------------------------------
# Invariants for every scorer: protection, budget, moments
# --------------------------------------------------------------------------------------------------

CASES = [
    (s, p, k, de) for s in BASES for p in PROTOCOLS for k, de in ((1, True), (3, True), (1, False))
]


@pytest.mark.parametrize("scorer,protocol,evict_every,decode_evict", CASES)
def test_invariants(params, prompt, scorer, protocol, evict_every, decode_evict):
    budget, m = 20, 16
    opts = defaults(scorer, budget) | dict(n_sink=2)
    ref = Reference(
        params,
        scorer=scorer,
        budget=budget,
        protocol=protocol,
        block_size=m,
        evict_every=evict_every,
        decode_evict=decode_evict,
        **opts,
    )
    r = ref.run(prompt, N)
    n_sink, window = opts["n_sink"], opts["window"]

    # prefill: after each eviction point, per (layer, KV head)
    ends = list(range(m, P, m)) + [P] if protocol == "blockwise" else [P]
    assert len(r["kept_after_blocks"]) == len(ends)
    for layer, kh in itertools.product(range(2), range(2)):
        prev = []
        for i, end in enumerate(ends):
            kept = r["kept_after_blocks"][i][layer][kh]
            new = set(range(ends[i - 1] if i else 0, end))
            assert kept == sorted(set(kept))
            assert set(kept) <= set(prev) | new  # nothing comes back
            assert len(kept) == min(len(prev) + len(new), budget)
            assert {p for p in range(end) if p < n_sink or p >= end - window} <= set(kept)
            prev = kept
        assert r["kept_after_prefill"][layer][kh] == prev
    # per (layer, head) sequences over the decode steps
    for layer, kh in itertools.product(range(2), range(2)):
        prev = r["kept_after_prefill"][layer][kh]
        for s, kept_all in enumerate(r["kept_after_steps"], start=1):
            kept = kept_all[layer][kh]
            point = decode_evict and s % evict_every == 0
            assert set(kept) <= set(prev) | {P + s - 1}
            assert len(kept) <= (budget if point else len(prev) + 1)
            if point:
                assert len(kept) == min(len(prev) + 1, budget)
                seen = P + s
                assert {p for p in range(seen) if p < n_sink or p >= seen - window} <= set(kept)
            else:
                assert kept == prev + [P + s - 1]
            prev = kept
    # the engine's own log agrees: every eviction keeps exactly b, never a protected token
    for e in ref.evictions:
        assert len(e["kept"]) == budget and len(e["before"]) > budget
        assert not any(p < n_sink or p >= e["seen"] - window for p in e["evicted"])
        assert sorted(e["kept"] + e["evicted"]) == e["before"]
    # moments = sums over exactly the tokens that are no longer kept, from the stored keys/values
    mom = r["moments"]
    for layer, kh in itertools.product(range(2), range(2)):
        final = r["kept_after_steps"][-1][layer][kh]
        gone = sorted(set(range(P + N)) - set(final))
        hist = ref.history[layer]
        keys = np.array([hist["k"][p][kh] for p in gone]).reshape(len(gone), -1)
        vals = np.array([hist["v"][p][kh] for p in gone]).reshape(len(gone), -1)
        assert mom["count"][layer, kh] == len(gone)
        np.testing.assert_allclose(mom["k_sum"][layer, kh], keys.sum(0), atol=1e-12)
        np.testing.assert_allclose(mom["v_sum"][layer, kh], vals.sum(0), atol=1e-12)
        np.testing.assert_allclose(
            mom["vk_sum"][layer, kh], np.einsum("ni,nj->ij", vals, keys), atol=1e-12
        )
        assert (
            sorted(
                p
                for e in ref.evictions
                if (e["layer"], e["kv_head"]) == (layer, kh)
                for p in e["evicted"]
            )
            == gone
        )
        # stored keys are the ones the cache holds
        for slot in ref.cache[layer][kh]:
            np.testing.assert_array_equal(slot.key, hist["k"][slot.position][kh])


def test_vk_sum_orientation(params):
    """[i, j] = Σ v_i k_j, not its transpose (a hand-made cache, one token evicted)."""
    import reference_eviction as re_mod

    ref = Reference(params, scorer="streamingllm", budget=2, n_sink=1)
    k, v = np.arange(8.0), np.arange(8.0) + 10
    ref.cache[0][1] = [re_mod.Slot(p, k * (p + 1), v * (p + 1), np.zeros(2)) for p in range(3)]
    ref.seen = 3
    ref._evict(0, 1)
    assert [s.position for s in ref.cache[0][1]] == [0, 2]
    np.testing.assert_array_equal(ref.vk_sum[0, 1], 4 * v[:, None] * k[None, :])
    assert ref.vk_sum[0, 1][0, 1] == 4 * 10 * 1 and ref.vk_sum[0, 1][1, 0] == 0
    np.testing.assert_array_equal(ref.k_sum[0, 1], 2 * k)
    np.testing.assert_array_equal(ref.v_sum[0, 1], 2 * v)
    np.testing.assert_array_equal(ref.count, [[0, 1], [0, 0]])
    assert not ref.vk_sum[0, 0].any() and not ref.vk_sum[1].any()


# --------------------------------------------------------------------------------------------------
# Scores recomputed directly from the stored queries and keys
# --------------------------------------------------------------------------------------------------


def direct_columns(ref, layer, kh, positions, queries):
    """[G, N] Σ over ``queries`` of their attention (over ``positions`` <= the query position) per
    head."""
    G, hist = ref.G, ref.history[layer]
    keys = np.array([hist["k"][p][kh] for p in positions])
    pos = np.asarray(positions)
    cols = np.zeros((G, len(positions)))
    for g in range(G):
        for qp in queries:
            z = keys @ hist["q"][qp][kh * G + g] / np.sqrt(keys.shape[1])
            cols[g] += softmax(np.where(pos <= qp, z, -np.inf))
    return cols


OPTION_SETS = [
    ("h2o", dict(aggregate="mean")),
    ("h2o", dict(aggregate="max")),
    ("tova", dict(aggregate="sum")),
    ("snapkv", dict(pool="max", kernel=7)),
    ("snapkv", dict(pool="avg", kernel=5)),
    ("snapkv", dict(pool="none", aggregate="max")),
    ("snapkv", dict(pool="max", kernel=4)),
]


@pytest.mark.parametrize("scorer,extra", OPTION_SETS)
def test_prefill_protocol_matches_direct_scores(params, prompt, no_eviction, scorer, extra):
    """Prefill protocol: nothing is evicted before the single eviction point, so every layer's
    scores are plain causal attention columns over the scoring queries, accumulated across blocks
    (W=20 spans two blocks)."""
    budget, W = 24, 20
    opts = dict(n_sink=2, window=4 if scorer != "snapkv" else W, obs_window=W) | extra
    ref = Reference(params, scorer=scorer, budget=budget, protocol="prefill", block_size=16, **opts)
    r = ref.run(prompt, N)
    np.testing.assert_allclose(
        r["prefill_logits"], no_eviction["prefill_logits"], rtol=0, atol=1e-10
    )
    queries = {"h2o": range(P), "tova": [P - 1], "snapkv": range(P - W, P)}[scorer]
    for layer, kh in itertools.product(range(2), range(2)):
        cols = direct_columns(ref, layer, kh, range(P), queries)
        d = select_kept(
            range(P),
            cols.T,
            scorer=scorer,
            budget=budget,
            seen=P,
            n_sink=opts["n_sink"],
            window=opts["window"],
            **{k: v for k, v in extra.items()},
        )
        assert r["kept_after_prefill"][layer][kh] == [p for p in range(P) if d.keep[p]]
    assert len(r["kept_after_blocks"]) == 1 and r["kept_after_blocks"][0] == r["kept_after_prefill"]


@pytest.mark.parametrize("scorer", ["h2o", "tova", "snapkv"])
def test_one_block_blockwise_equals_prefill_protocol(params, prompt, scorer):
    opts = dict(budget=24, n_sink=2, window=6, obs_window=12)
    a = run_reference(params, prompt, N, scorer=scorer, protocol="blockwise", block_size=P, **opts)
    b = run_reference(params, prompt, N, scorer=scorer, protocol="prefill", block_size=16, **opts)
    assert a["kept_after_prefill"] == b["kept_after_prefill"]
    assert a["kept_after_steps"] == b["kept_after_steps"]
    np.testing.assert_allclose(all_logits(a), all_logits(b), rtol=0, atol=1e-10)


@pytest.mark.parametrize("evict_every", [1, 2])
@pytest.mark.parametrize("scorer", ["tova", "snapkv"])
def test_decode_scores_come_from_queries_since_last_eviction(params, prompt, scorer, evict_every):
    """tova: the newest query only; snapkv: the queries since the last eviction (state reset after
    it)."""
    budget = 20
    opts = dict(n_sink=2, window=0 if scorer == "tova" else 4, obs_window=4)
    ref = Reference(
        params,
        scorer=scorer,
        budget=budget,
        protocol="blockwise",
        block_size=16,
        evict_every=evict_every,
        **opts,
    )
    r = ref.run(prompt, N)
    for layer, kh in itertools.product(range(2), range(2)):
        kept = r["kept_after_prefill"][layer][kh]
        since = []  # (query position, kept positions it attended to)
        for s in range(1, N + 1):
            qp = P + s - 1
            kept = kept + [qp]
            since.append((qp, list(kept)))
            if s % evict_every:
                assert r["kept_after_steps"][s - 1][layer][kh] == kept
                continue
            states = np.zeros((ref.G, len(kept)))
            for q_pos, attended in since[-1:] if scorer == "tova" else since:
                cols = direct_columns(ref, layer, kh, attended, [q_pos])
                idx = [kept.index(p) for p in attended]
                states[:, idx] += cols
            d = select_kept(
                kept,
                states.T,
                scorer=scorer,
                budget=budget,
                seen=qp + 1,
                n_sink=opts["n_sink"],
                window=opts["window"],
            )
            kept = [p for p, k in zip(kept, d.keep) if k]
            since = []
            assert r["kept_after_steps"][s - 1][layer][kh] == kept, (layer, kh, s)


# --------------------------------------------------------------------------------------------------
# Hand-made cases: pooling, aggregation, tie rule
# --------------------------------------------------------------------------------------------------


def test_pooling_by_hand():
    v = np.array([1, 5, 2, 0, 0, 3, 0], float)
    np.testing.assert_array_equal(pool_priorities(v, "max", 3), [5, 5, 5, 2, 3, 3, 3])
    np.testing.assert_allclose(pool_priorities(v, "avg", 3), np.array([6, 8, 7, 2, 3, 3, 3]) / 3)
    np.testing.assert_array_equal(pool_priorities(v, "max", 1), v)
    np.testing.assert_array_equal(pool_priorities(v, "avg", 1), v)
    np.testing.assert_array_equal(pool_priorities(v, "none", 7), v)
    # kernel wider than the sequence: max over all, avg = (what is inside) / kernel
    np.testing.assert_array_equal(pool_priorities(v[:3], "max", 7), [5, 5, 5])
    np.testing.assert_allclose(pool_priorities(v[:3], "avg", 7), [8 / 7] * 3)
    # kernel 5: window i-2 … i+2
    np.testing.assert_allclose(pool_priorities(v, "avg", 5), np.array([8, 8, 8, 10, 5, 3, 3]) / 5)
    # even kernel 4: window i-2 … i+1
    np.testing.assert_array_equal(pool_priorities(v, "max", 4), [5, 5, 5, 5, 3, 3, 3])
    np.testing.assert_allclose(pool_priorities(v, "avg", 4), np.array([6, 8, 8, 7, 5, 3, 3]) / 4)


def states_for(aggregates, G=2):
    """States [N, G] whose group mean is ``aggregates`` (and whose rows differ, to exercise the
    mean)."""
    a = np.asarray(aggregates, float)
    return np.stack([a - 0.25, a + 0.25], axis=1) if G == 2 else a[:, None]


def test_snapkv_pooling_and_ties_by_hand():
    # positions 0…9, seen 10; protected: sink 0 and the window 8, 9. Unprotected 1…7 with aggregates
    # [0, 9, 0, 0, 4, 4, 4]. The sink's huge score must not leak into the pooling (it is not a
    # neighbour).
    agg = [100, 0, 9, 0, 0, 4, 4, 4, 0, 0]
    common = dict(scorer="snapkv", budget=5, seen=10, n_sink=1, window=2, kernel=3)
    # max-pool: [9, 9, 9, 4, 4, 4, 4] at 1…7; two free slots, three-way tie at 9 -> the later two
    # (2, 3)
    d = select_kept(range(10), states_for(agg), pool="max", **common)
    np.testing.assert_allclose(d.priorities, [9, 9, 9, 4, 4, 4, 4])
    assert [p for p in range(10) if d.keep[p]] == [0, 2, 3, 8, 9]
    assert d.near_tie and d.exact_tie
    # avg-pool: [3, 3, 3, 4/3, 8/3, 4, 8/3] -> 6 (4), then the tie at 3 -> 3
    d = select_kept(range(10), states_for(agg), pool="avg", **common)
    np.testing.assert_allclose(d.priorities, [3, 3, 3, 4 / 3, 8 / 3, 4, 8 / 3])
    assert [p for p in range(10) if d.keep[p]] == [0, 3, 6, 8, 9]
    # no pooling: 2 (9), then the tie at 4 between 5, 6, 7 -> 7
    d = select_kept(range(10), states_for(agg), pool="none", **common)
    assert [p for p in range(10) if d.keep[p]] == [0, 2, 7, 8, 9]
    # pooling runs over the kept unprotected tokens in position order, not over position numbers
    positions = [0, 3, 10, 11, 20, 30, 31]
    d = select_kept(
        positions,
        states_for([0, 1, 0, 0, 0, 7, 0]),
        scorer="snapkv",
        budget=3,
        seen=32,
        n_sink=1,
        window=1,
        pool="max",
        kernel=3,
    )
    np.testing.assert_allclose(d.priorities, [1, 1, 0, 7, 7])  # over positions 3, 10, 11, 20, 30
    assert [p for p, k in zip(positions, d.keep) if k] == [0, 30, 31]


def test_tie_rule_and_aggregates_by_hand():
    # h2o, all equal: the latest unprotected positions are kept
    positions = [0, 2, 5, 7, 9, 11]
    d = select_kept(
        positions, np.full((6, 2), 0.5), scorer="h2o", budget=3, seen=12, n_sink=1, window=0
    )
    assert [p for p, k in zip(positions, d.keep) if k] == [0, 9, 11]
    assert d.near_tie and d.exact_tie
    # a tie between two specific tokens
    d = select_kept(
        [0, 1, 2, 3], states_for([3, 1, 3, 2]), scorer="tova", budget=1, seen=4, n_sink=0, window=0
    )
    assert list(d.keep) == [False, False, True, False]
    d = select_kept(
        [0, 1, 2, 3], states_for([3, 1, 3, 2]), scorer="tova", budget=2, seen=4, n_sink=0, window=0
    )
    assert list(d.keep) == [True, False, True, False] and not d.near_tie
    # aggregate: mean prefers the second token, max the first; sum ranks like mean
    st = np.array([[1.0, 0.0], [0.6, 0.6]])
    for aggregate, kept in (
        ("mean", [False, True]),
        ("sum", [False, True]),
        ("max", [True, False]),
    ):
        d = select_kept(
            [0, 1], st, scorer="h2o", budget=1, seen=2, n_sink=0, window=0, aggregate=aggregate
        )
        assert list(d.keep) == kept, aggregate
    # near tie (not exact) is flagged; a clear gap is not
    d = select_kept(
        [0, 1], states_for([1.0, 1.0 + 1e-9]), scorer="h2o", budget=1, seen=2, n_sink=0, window=0
    )
    assert list(d.keep) == [False, True] and d.near_tie and not d.exact_tie
    d = select_kept(
        [0, 1], states_for([1.0, 1.0 + 1e-3]), scorer="h2o", budget=1, seen=2, n_sink=0, window=0
    )
    assert not d.near_tie
    # streamingllm: recency is the priority, the window and sinks are protected regardless
    d = select_kept(
        [0, 1, 2, 3, 4, 5], None, scorer="streamingllm", budget=3, seen=6, n_sink=1, window=0
    )
    assert list(d.keep) == [True, False, False, False, True, True]
    # at or under the budget nothing is evicted
    d = select_kept([0, 1, 2], np.zeros((3, 2)), scorer="h2o", budget=3, seen=3, n_sink=0, window=0)
    assert d.keep.all()


def test_state_rules_after_blockwise_prefill(params, prompt):
    """h2o: a sink's state is the sum over every block's queries of its attention (each block seeing
    the tokens kept at the time) and survives evictions; tova and snapkv: every kept state is 0
    after an eviction."""
    m, budget = 16, 20
    ref = Reference(
        params, scorer="h2o", budget=budget, protocol="blockwise", block_size=m, n_sink=1, window=4
    )
    ref.run(prompt, 0)
    for layer, kh in itertools.product(range(2), range(2)):
        log = {e["seen"]: e for e in ref.evictions if (e["layer"], e["kv_head"]) == (layer, kh)}
        kept, expected = [], np.zeros(ref.G)
        for start in range(0, P, m):
            visible = kept + list(range(start, start + m))
            expected += direct_columns(ref, layer, kh, visible, range(start, start + m))[:, 0]
            kept = log[start + m]["kept"] if start + m in log else visible
        sink = ref.cache[layer][kh][0]
        assert sink.position == 0 and np.all(sink.state > 0)
        np.testing.assert_allclose(sink.state, expected, rtol=1e-12)
    for scorer in ("tova", "snapkv"):
        ref = Reference(
            params,
            scorer=scorer,
            budget=budget,
            protocol="blockwise",
            block_size=m,
            window=4,
            obs_window=4,
        )
        ref.run(prompt, 0)
        assert all(np.all(s.state == 0) for layer in ref.cache for slots in layer for s in slots)


def test_configuration_errors(params):
    with pytest.raises(ValueError, match="budget"):
        Reference(params, scorer="h2o", budget=8, n_sink=4, window=4)
    with pytest.raises(ValueError, match="scorer"):
        Reference(params, scorer="lru", budget=8)
    with pytest.raises(ValueError, match="pool"):
        Reference(params, scorer="snapkv", budget=8, pool="min")
