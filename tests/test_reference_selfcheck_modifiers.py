"""Self-checks of the modifiers (OBCache, CAOTE, MomentKV) of the NumPy eviction reference
(tests/reference_eviction.py, docs/eviction.md "Modifiers"); independent of the JAX engine.

The brute-force checks below recompute attention from scratch with :func:`plain_attention` (written
here, not the module's :func:`attention`) and keep evicted sets explicitly instead of running sums.
"""

import itertools

import numpy as np
import pytest
import reference_eviction
from helpers import N, P, defaults
from reference_eviction import (
    MODIFIERS,
    SCORERS,
    Moments,
    Reference,
    caote_priorities,
    nc_correct,
    obcache_columns,
    parse_scorer,
    pool_priorities,
    protected_mask,
    select_kept,
    select_moment_informed,
)


def plain_attention(q, keys, values):
    """Softmax attention of one query [K] over ``keys``/``values`` [N, K]: (weights [N], output [K],
    logits [N])."""
    z = keys @ q / np.sqrt(len(q))
    e = np.exp(z - z.max())
    a = e / e.sum()
    return a, a @ values, z


def kv_of(ref, layer, kh, positions):
    hist, K = ref.history[layer], ref.cfg.head_dim
    keys = np.array([hist["k"][p][kh] for p in positions]).reshape(len(positions), K)
    values = np.array([hist["v"][p][kh] for p in positions]).reshape(len(positions), K)
    return keys, values


def expected_kept(positions, protected, prio, budget):
    """Protected plus the highest priorities, ties to the later position (the base's selection)."""
    unprotected = [i for i in range(len(positions)) if not protected[i]]
    order = sorted(
        range(len(unprotected)), key=lambda u: (prio[u], positions[unprotected[u]]), reverse=True
    )
    n_free = budget - int(np.sum(protected))
    keep = {positions[i] for i in range(len(positions)) if protected[i]}
    keep |= {positions[unprotected[u]] for u in order[:n_free]}
    return sorted(keep)


# --------------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------------


def test_scorer_grammar_and_default_aggregate(params):
    names = {"streamingllm", "h2o", "tova", "snapkv", "streamingllm+momentkv-nc", "momentkv"}
    names |= {"h2o-window"}
    names |= {
        f"{b}+{m}"
        for b in ("h2o", "h2o-window", "tova", "snapkv")
        for m in (
            "obcache-value",
            "obcache-key",
            "obcache-joint",
            "caote",
            "fastcaote",
            "momentkv",
            "momentkv-mi",
            "momentkv-nc",
            "momentkv-zeroth",
        )
    }
    assert set(SCORERS) == names and len(SCORERS) == len(names) == 43
    assert set(MODIFIERS) == {n.split("+")[1] for n in names if "+" in n}
    assert parse_scorer("momentkv") == ("snapkv", "momentkv")
    assert parse_scorer("snapkv+momentkv") == ("snapkv", "momentkv")
    assert parse_scorer("tova+fastcaote") == ("tova", "fastcaote")
    assert parse_scorer("h2o") == ("h2o", None)
    for bad in (
        "streamingllm+momentkv",
        "streamingllm+momentkv-mi",
        "streamingllm+caote",
        "momentkv-nc",
        "caote",
        "obcache-key",
        "h2o+",
        "+caote",
        "h2o+caote+momentkv-nc",
        "snapkv+momentkv-first",
        "H2O",
        "snapkv+snapkv",
        "momentkv+momentkv-nc",
    ):
        with pytest.raises(ValueError, match="scorer"):
            parse_scorer(bad)
        with pytest.raises(ValueError, match="scorer"):
            Reference(params, scorer=bad, budget=8)
    for name in SCORERS:
        ref = Reference(params, scorer=name, budget=None)
        assert ref.aggregate == ("sum" if "obcache" in name else "mean"), name
        assert Reference(params, scorer=name, budget=None, aggregate="max").aggregate == "max"


# --------------------------------------------------------------------------------------------------
# OBCache
# --------------------------------------------------------------------------------------------------


def windowed_error(queries, query_pos, keys, values, j, t, what):
    """Σ_i ‖o_i(t) − o_i(0)‖² over the window when token j's value / key / both are scaled by (1 −
    t); query i sees the tokens at positions <= its own (token positions 0 … N-1)."""
    total = 0.0
    for q, p in zip(queries, query_pos):
        k, v = keys[: p + 1].copy(), values[: p + 1].copy()
        o0 = plain_attention(q, k, v)[1]
        if j <= p:
            if what in ("key", "joint"):
                k[j] *= 1 - t
            if what in ("value", "joint"):
                v[j] *= 1 - t
        total += np.sum((plain_attention(q, k, v)[1] - o0) ** 2)
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_obcache_closed_forms_are_the_second_order_term_of_the_windowed_error(seed):
    """OBD: E(t) = t² S + O(t³) where E is the windowed output error of scaling the token's
    value/key/both by (1 − t); the symmetric quotient (E(t) + E(−t)) / (2t²) = S + O(t²). Causal
    window: the query at position p sees tokens 0…p, so the last tokens are invisible to the early
    queries (A = 0 there)."""
    rng = np.random.default_rng(seed)
    n, K = 9, 8
    keys, values = rng.normal(size=(n, K)) * 1.5, rng.normal(size=(n, K))
    query_pos = [4, 6, 7, 8]
    queries = rng.normal(size=(len(query_pos), K)) * 1.5
    visible = np.arange(n)[None, :] <= np.array(query_pos)[:, None]
    z, A, o, _ = reference_eviction.attention(queries, keys, values, visible)
    t = 1e-4
    for kind in ("value", "key", "joint"):
        closed = obcache_columns(kind, A, z, values, o)
        fd = np.array(
            [
                (
                    windowed_error(queries, query_pos, keys, values, j, t, kind)
                    + windowed_error(queries, query_pos, keys, values, j, -t, kind)
                )
                / (2 * t * t)
                for j in range(n)
            ]
        )
        assert np.all(fd > 0)
        np.testing.assert_allclose(closed, fd, rtol=1e-6, atol=1e-12, err_msg=kind)
    # removing a value entirely is exactly linear: E(1) is the value score itself
    exact = [windowed_error(queries, query_pos, keys, values, j, 1.0, "value") for j in range(n)]
    np.testing.assert_allclose(obcache_columns("value", A, z, values, o), exact, rtol=1e-12)


def obcache_by_loops(kind, q_list, keys, values):
    """[N] Σ over the queries (each with the number of tokens it sees) of the OBCache closed form,
    by loops."""
    out = np.zeros(len(keys))
    for q, n_visible in q_list:
        a, o, z = plain_attention(q, keys[:n_visible], values[:n_visible])
        for j in range(n_visible):
            v_sq = values[j] @ values[j]
            val = a[j] ** 2 * v_sq
            key = (a[j] * z[j]) ** 2 * np.sum((values[j] - o) ** 2)
            cross = 2 * a[j] ** 2 * z[j] * (v_sq - values[j] @ o)
            out[j] += {"value": val, "key": key, "joint": val + key + cross}[kind]
    return out


@pytest.mark.parametrize("kind", ["value", "key", "joint"])
@pytest.mark.parametrize("base", ["h2o", "tova", "snapkv"])
def test_obcache_prefill_protocol_matches_direct_scores(params, prompt, no_eviction, base, kind):
    """Prefill protocol: nothing is evicted before the one eviction point, so the states are the
    closed forms over the base's scoring queries on plain causal attention; selection is the base's
    with aggregate ``sum``."""
    budget, W = 24, 20
    opts = dict(n_sink=2, window=W if base == "snapkv" else 4, obs_window=W, pool="max", kernel=5)
    ref = Reference(
        params,
        scorer=f"{base}+obcache-{kind}",
        budget=budget,
        protocol="prefill",
        block_size=16,
        **opts,
    )
    assert ref.aggregate == "sum"
    r = ref.run(prompt, 0)
    np.testing.assert_allclose(
        r["prefill_logits"], no_eviction["prefill_logits"], rtol=0, atol=1e-10
    )
    queries = {"h2o": range(P), "tova": [P - 1], "snapkv": range(P - W, P)}[base]
    for layer, kh in itertools.product(range(2), range(2)):
        (e,) = [e for e in ref.evictions if (e["layer"], e["kv_head"]) == (layer, kh)]
        keys, values = kv_of(ref, layer, kh, range(P))
        states = np.stack(
            [
                obcache_by_loops(
                    kind,
                    [(ref.history[layer]["q"][p][kh * ref.G + g], p + 1) for p in queries],
                    keys,
                    values,
                )
                for g in range(ref.G)
            ],
            axis=1,
        )
        np.testing.assert_allclose(e["states"], states, rtol=1e-10, atol=1e-14)
        d = select_kept(
            range(P),
            states,
            scorer=base,
            budget=budget,
            seen=P,
            n_sink=2,
            window=opts["window"],
            pool="max",
            kernel=5,
            aggregate="sum",
        )
        assert r["kept_after_prefill"][layer][kh] == [p for p in range(P) if d.keep[p]]


@pytest.mark.parametrize("kind", ["value", "key", "joint"])
def test_tova_obcache_every_eviction_point_blockwise_and_decoding(params, prompt, kind):
    """tova: the state at an eviction point is the closed form of the step's last query over every
    kept token."""
    budget = 20
    ref = Reference(
        params,
        scorer=f"tova+obcache-{kind}",
        budget=budget,
        protocol="blockwise",
        block_size=16,
        n_sink=1,
        window=2,
        aggregate="max",
    )
    ref.run(prompt, N)
    assert len(ref.evictions) == 2 * 2 * (P // 16 - 1 + N)
    for e in ref.evictions:
        layer, kh, seen = e["layer"], e["kv_head"], e["seen"]
        keys, values = kv_of(ref, layer, kh, e["before"])

        def q_list(g):
            return [(ref.history[layer]["q"][seen - 1][kh * ref.G + g], len(keys))]

        states = np.stack(
            [obcache_by_loops(kind, q_list(g), keys, values) for g in range(ref.G)], axis=1
        )
        np.testing.assert_allclose(e["states"], states, rtol=1e-10, atol=1e-14)
        protected = protected_mask(e["before"], seen=seen, n_sink=1, window=2)
        assert e["kept"] == expected_kept(
            e["before"], protected, states[~protected].max(axis=1), budget
        )


# --------------------------------------------------------------------------------------------------
# CAOTE
# --------------------------------------------------------------------------------------------------


def removal_error(q, keys, values, j):
    """‖o without token j − o‖ for one query, attention recomputed from scratch."""
    o = plain_attention(q, keys, values)[1]
    others = [i for i in range(len(keys)) if i != j]
    return np.linalg.norm(plain_attention(q, keys[others], values[others])[1] - o)


@pytest.mark.parametrize("seed", [0, 1])
def test_caote_with_one_query_is_the_exact_removal_error(seed):
    """tova state = one query's attention (already normalised): c_j = ‖o_{−j} − o‖ exactly (CAOTE
    Thm 3.2), for every unprotected token; protected tokens count in the normalisation. G=2: the
    mean of the two heads."""
    rng = np.random.default_rng(seed)
    n, K = 8, 6
    keys, values = rng.normal(size=(n, K)) * 2, rng.normal(size=(n, K))
    qs = rng.normal(size=(2, K)) * 2
    states = np.stack([plain_attention(q, keys, values)[0] for q in qs], axis=1)  # [N, G]
    protected = np.zeros(n, bool)
    protected[[0, 6]] = True
    prio = caote_priorities(states, values, protected, base="tova", fast=False, aggregate="mean")
    brute = [
        np.mean([removal_error(q, keys, values, j) for q in qs])
        for j in range(n)
        if not protected[j]
    ]
    np.testing.assert_allclose(prio, brute, rtol=1e-12)
    one = caote_priorities(
        states[:, :1], values, protected, base="h2o", fast=False, aggregate="sum"
    )
    np.testing.assert_allclose(
        one,
        [removal_error(qs[0], keys, values, j) for j in range(n) if not protected[j]],
        rtol=1e-12,
    )


def test_caote_and_fastcaote_by_hand():
    values = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 3.0]])
    states = np.array([[1.0], [2.0], [1.0]])  # h = [1/4, 1/2, 1/4]
    none = np.zeros(3, bool)
    # fastcaote: m = mean = (1, 1)
    fast = caote_priorities(states, values, none, base="h2o", fast=True)
    np.testing.assert_allclose(fast, [np.sqrt(2) / 3, np.sqrt(5), np.sqrt(5) / 3], rtol=1e-14)
    # caote: m = Σ h v = (1.5, 0.75)
    full = caote_priorities(states, values, none, base="h2o", fast=False)
    np.testing.assert_allclose(
        full, [np.sqrt(2.8125) / 3, np.sqrt(2.8125), np.sqrt(7.3125) / 3], rtol=1e-14
    )
    # negative states count as 0; a protected token's state counts in the normalisation but gets no
    # priority
    neg = caote_priorities(
        np.array([[1.0], [2.0], [1.0], [-5.0]]),
        np.vstack([values, [[9.0, 9.0]]]),
        np.array([False, False, False, True]),
        base="tova",
        fast=False,
    )
    np.testing.assert_allclose(neg, full, rtol=1e-14)
    prot = caote_priorities(
        np.array([[1.0], [2.0], [1.0], [4.0]]),
        np.vstack([values, [[0.0, 0.0]]]),
        np.array([False, False, False, True]),
        base="tova",
        fast=False,
    )
    h = np.array([1, 2, 1, 4]) / 8
    m = h @ np.vstack([values, [[0.0, 0.0]]])
    np.testing.assert_allclose(
        prot, [h[j] / (1 - h[j]) * np.linalg.norm(m - values[j]) for j in range(3)]
    )
    # all zero stays zero; h_j = 1 gives +inf (the documented reading of the division by zero)
    assert np.all(caote_priorities(np.zeros((3, 2)), values, none, base="h2o", fast=False) == 0)
    c = caote_priorities(np.array([[0.0], [3.0], [0.0]]), values, none, base="h2o", fast=True)
    assert c[1] == np.inf and c[0] == c[2] == 0
    # group aggregate over the heads
    st2 = np.hstack([states, states[::-1] * 3])
    for agg, f in (("mean", np.mean), ("sum", np.sum), ("max", np.max)):
        per_head = [
            caote_priorities(st2[:, g : g + 1], values, none, base="h2o", fast=False)
            for g in range(2)
        ]
        np.testing.assert_allclose(
            caote_priorities(st2, values, none, base="h2o", fast=False, aggregate=agg),
            f(per_head, axis=0),
            rtol=1e-14,
        )


def test_snapkv_caote_pools_each_head_over_the_unprotected_tokens():
    """Per head: pool the unprotected tokens' states (protected ones are neither pooled nor
    neighbours), then normalise over all tokens. Pooling per head differs from pooling the group
    aggregate here."""
    states = np.array(
        [
            [4.0, 4.0],  # protected sink
            [1.0, 0.0],
            [0.0, 0.0],
            [0.0, 0.0],
            [0.0, 1.0],
            [2.0, 2.0],
        ]
    )  # protected window
    protected = np.array([True, False, False, False, False, True])
    values = np.arange(12.0).reshape(6, 2) ** 1.5
    got = caote_priorities(
        states, values, protected, base="snapkv", fast=True, pool="max", kernel=3, aggregate="mean"
    )
    pooled = np.array([[4.0, 4.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [2.0, 2.0]])
    m = values.mean(axis=0)
    c = np.zeros((4, 2))
    for g in range(2):
        h = pooled[:, g] / pooled[:, g].sum()
        c[:, g] = [h[j] / (1 - h[j]) * np.linalg.norm(m - values[j]) for j in range(1, 5)]
    np.testing.assert_allclose(got, c.mean(axis=1), rtol=1e-14)
    # avg pooling: missing neighbours count as 0
    got = caote_priorities(
        states, values, protected, base="snapkv", fast=True, pool="avg", kernel=3
    )
    pooled = np.array(
        [[4.0, 4.0], [1 / 3, 0.0], [1 / 3, 0.0], [0.0, 1 / 3], [0.0, 1 / 3], [2.0, 2.0]]
    )
    for g in range(2):
        h = pooled[:, g] / pooled[:, g].sum()
        c[:, g] = [h[j] / (1 - h[j]) * np.linalg.norm(m - values[j]) for j in range(1, 5)]
    np.testing.assert_allclose(got, c.mean(axis=1), rtol=1e-14)


@pytest.mark.parametrize("evict_every", [1, 3])
def test_tova_caote_every_eviction_point_is_the_exact_removal_error(params, prompt, evict_every):
    """tova+caote (blockwise prefill and decoding): at every eviction point the priority of an
    unprotected token is the mean over the G heads of ‖o_{−j} − o‖ for the step's last query over
    the kept tokens."""
    budget = 20
    ref = Reference(
        params,
        scorer="tova+caote",
        budget=budget,
        protocol="blockwise",
        block_size=16,
        n_sink=1,
        window=2,
        evict_every=evict_every,
    )
    ref.run(prompt, N)
    assert len(ref.evictions) == 2 * 2 * (P // 16 - 1 + N // evict_every)
    for e in ref.evictions:
        layer, kh, seen = e["layer"], e["kv_head"], e["seen"]
        keys, values = kv_of(ref, layer, kh, e["before"])
        protected = protected_mask(e["before"], seen=seen, n_sink=1, window=2)
        qs = [ref.history[layer]["q"][seen - 1][kh * ref.G + g] for g in range(ref.G)]
        brute = [
            np.mean([removal_error(q, keys, values, j) for q in qs])
            for j in range(len(keys))
            if not protected[j]
        ]
        np.testing.assert_allclose(e["priorities"], brute, rtol=1e-9)
        assert e["kept"] == expected_kept(e["before"], protected, brute, budget)


@pytest.mark.parametrize(
    "scorer", ["h2o+fastcaote", "snapkv+caote", "snapkv+fastcaote", "h2o+caote"]
)
def test_caote_priorities_in_the_reference_use_the_base_states_and_kept_values(
    params, prompt, scorer
):
    budget = 20
    opts = defaults(scorer, budget)
    ref = Reference(
        params,
        scorer=scorer,
        budget=budget,
        protocol="blockwise",
        block_size=16,
        pool="avg",
        kernel=3,
        **opts,
    )
    ref.run(prompt, N)
    base, modifier = parse_scorer(scorer)
    for e in ref.evictions:
        _, values = kv_of(ref, e["layer"], e["kv_head"], e["before"])
        protected = protected_mask(
            e["before"], seen=e["seen"], n_sink=opts["n_sink"], window=opts["window"]
        )
        unprotected = np.flatnonzero(~protected)
        c = []
        for g in range(ref.G):
            s = e["states"][:, g].copy()
            if base == "snapkv":
                s[unprotected] = pool_priorities(s[unprotected], "avg", 3)
            h = s / s.sum()
            m = values.mean(0) if modifier == "fastcaote" else h @ values
            c.append([h[j] / (1 - h[j]) * np.linalg.norm(m - values[j]) for j in unprotected])
        np.testing.assert_allclose(e["priorities"], np.mean(c, axis=0), rtol=1e-12)
        assert e["kept"] == expected_kept(e["before"], protected, np.mean(c, axis=0), budget)


# --------------------------------------------------------------------------------------------------
# MomentKV: moment-informed eviction
# --------------------------------------------------------------------------------------------------


def empty_moments(K):
    return Moments(0, np.zeros(K), np.zeros(K), np.zeros((K, K)))


def moments_of(keys, values):
    keys, values = (
        np.asarray(keys).reshape(len(keys), -1),
        np.asarray(values).reshape(len(values), -1),
    )
    return Moments(len(keys), keys.sum(0), values.sum(0), np.einsum("ni,nj->ij", values, keys))


def brute_force_mi(
    positions, keys, values, protected, priorities, budget, gone_keys, gone_values, zeroth
):
    """Algorithm 1's loop with the evicted set kept explicitly (centred S̃ = Σ v_e (k_e − k̄)ᵀ).
    Returns the eviction order (indices), the scores of each round and the number of exact ties."""
    K = keys.shape[1]
    gone_k, gone_v = [np.asarray(k) for k in gone_keys], [np.asarray(v) for v in gone_values]
    P_of = dict(zip([j for j in range(len(positions)) if not protected[j]], priorities))
    candidates = sorted(P_of, key=lambda j: positions[j])
    order, rounds, ties = [], [], 0
    for _ in range(len(positions) - budget):
        scores = {}
        for j in candidates:
            if not gone_v:
                r = values[j]
            else:
                n = len(gone_v)
                v_bar, k_bar = np.mean(gone_v, axis=0), np.mean(gone_k, axis=0)
                s_tilde = sum(np.outer(v, k - k_bar) for v, k in zip(gone_v, gone_k))
                r = (
                    values[j] - v_bar
                    if zeroth
                    else values[j] - v_bar - s_tilde @ keys[j] / (n * np.sqrt(K))
                )
            scores[j] = P_of[j] * np.linalg.norm(r)
        best = candidates[0]
        for j in candidates[1:]:  # position order, strict '<': the earlier position wins a tie
            if scores[j] < scores[best]:
                best = j
        ties += sum(1 for j in candidates if j != best and scores[j] == scores[best]) > 0
        order.append(best)
        rounds.append(scores)
        candidates.remove(best)
        gone_k.append(keys[best])
        gone_v.append(values[best])
    return order, rounds, ties


def test_moment_informed_by_hand():
    """P ≡ 1, keys 0 (so S̃ k = 0). Round 1 (n = 0): ‖v‖ = [1, 5, 2.2, 1.80] -> evict 0. Round 2 (v̄
    = (0, 1)): ‖v − v̄‖ = [-, 5.10, 1.2, 1.5] -> evict 2, although a one-shot ranking by ‖v‖ would
    evict 3."""
    values = np.array([[0.0, 1.0], [5.0, 0.0], [0.0, 2.2], [1.5, 1.0]])
    keys = np.zeros((4, 2))
    for zeroth in (False, True):
        d = select_moment_informed(
            [0, 1, 2, 3],
            keys,
            values,
            np.zeros(4, bool),
            np.ones(4),
            2,
            empty_moments(2),
            zeroth=zeroth,
        )
        assert d.evicted == [0, 2] and list(d.keep) == [False, True, False, True]
        np.testing.assert_allclose(d.scores[0], [1, 5, 2.2, np.hypot(1.5, 1)])
        np.testing.assert_allclose(d.scores[1], [np.nan, np.hypot(5, 1), 1.2, 1.5])
        assert d.near_ties == d.exact_ties == 0
    # the base priority weights the residual: P = [1, 1, 1, 0.6] -> round 1: 0.6 · 1.80 = 1.08 > 1,
    # 0 goes; round 2: 0.6 · 1.5 = 0.9 < 1.2, 3 goes
    d = select_moment_informed(
        [0, 1, 2, 3],
        keys,
        values,
        np.zeros(4, bool),
        np.array([1, 1, 1, 0.6]),
        2,
        empty_moments(2),
        zeroth=False,
    )
    assert d.evicted == [0, 3]
    # existing statistics (one evicted token with value (0, 2.2)) count from the first round on
    d = select_moment_informed(
        [0, 1, 2, 3],
        keys,
        values,
        np.zeros(4, bool),
        np.ones(4),
        3,
        moments_of(np.zeros((1, 2)), [[0.0, 2.2]]),
        zeroth=True,
    )
    assert d.evicted == [2]
    # protected tokens are never candidates
    d = select_moment_informed(
        [0, 1, 2, 3],
        keys,
        values,
        np.array([True, False, True, False]),
        np.ones(2),
        3,
        empty_moments(2),
        zeroth=False,
    )
    assert d.evicted == [3]


def test_moment_informed_ties_go_to_the_earlier_position():
    """All priorities 0: every round is an exact tie; the earliest unprotected token goes first."""
    rng = np.random.default_rng(3)
    positions = [0, 3, 4, 7, 9, 12, 13]
    keys, values = rng.normal(size=(7, 4)), rng.normal(size=(7, 4))
    protected = np.array([True, False, False, False, False, False, True])
    d = select_moment_informed(
        positions, keys, values, protected, np.zeros(5), 3, empty_moments(4), zeroth=False
    )
    assert [positions[j] for j in d.evicted] == [3, 4, 7, 9]
    assert d.near_ties == d.exact_ties == 4
    # near (not exact) tie between the two smallest scores: flagged as near only; the smaller one
    # goes
    for small, other in ((1, 2), (2, 1)):
        vals = np.full((7, 4), 7.0)
        vals[small], vals[other] = 1.0, 1.0 + 1e-9
        d = select_moment_informed(
            positions,
            np.zeros((7, 4)),
            vals,
            protected,
            np.ones(5),
            6,
            empty_moments(4),
            zeroth=True,
        )
        assert d.evicted == [small] and d.near_ties == 1 and d.exact_ties == 0


@pytest.mark.parametrize("zeroth", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_moment_informed_equals_brute_force(seed, zeroth):
    rng = np.random.default_rng(seed)
    n, K, budget = 11, 4, 5
    positions = np.sort(rng.choice(40, n, replace=False))
    keys, values = rng.normal(size=(n, K)) * 2, rng.normal(size=(n, K))
    protected = np.zeros(n, bool)
    protected[[0, n - 1]] = True
    priorities = rng.uniform(0.1, 1.0, n - 2)
    n_gone = [0, 1, 3, 3][seed]
    gone_k, gone_v = rng.normal(size=(n_gone, K)) * 2, rng.normal(size=(n_gone, K))
    moments = moments_of(gone_k, gone_v) if n_gone else empty_moments(K)
    d = select_moment_informed(
        positions, keys, values, protected, priorities, budget, moments, zeroth=zeroth
    )
    order, rounds, ties = brute_force_mi(
        positions, keys, values, protected, priorities, budget, gone_k, gone_v, zeroth
    )
    assert d.evicted == order and d.exact_ties == ties == 0
    for scores, brute in zip(d.scores, rounds):
        np.testing.assert_allclose([scores[j] for j in brute], list(brute.values()), rtol=1e-10)
        assert np.all(np.isnan([scores[j] for j in range(n) if j not in brute]))
    assert moments.count == n_gone  # the caller's statistics are not modified


@pytest.mark.parametrize(
    "scorer,protocol",
    [
        ("snapkv+momentkv-mi", "blockwise"),
        ("h2o+momentkv", "prefill"),
        ("tova+momentkv-zeroth", "blockwise"),
        ("momentkv", "prefill"),
    ],
)
def test_moment_informed_in_the_reference_equals_brute_force(params, prompt, scorer, protocol):
    """Every eviction point of a run: P from the logged base states (base rule), then the
    brute-force loop with the evicted set reconstructed from the log; the moments of the run are the
    sums over everything evicted."""
    budget = 20
    opts = defaults(scorer, budget) | dict(n_sink=1)
    ref = Reference(params, scorer=scorer, budget=budget, protocol=protocol, block_size=16, **opts)
    r = ref.run(prompt, N)
    base, modifier = parse_scorer(scorer)
    differs_from_base = 0
    near = 0
    for layer, kh in itertools.product(range(2), range(2)):
        gone = []
        for e in [e for e in ref.evictions if (e["layer"], e["kv_head"]) == (layer, kh)]:
            before = e["before"]
            keys, values = kv_of(ref, layer, kh, before)
            protected = protected_mask(before, seen=e["seen"], n_sink=1, window=opts["window"])
            prio = select_kept(
                before,
                e["states"],
                scorer=base,
                budget=budget,
                seen=e["seen"],
                n_sink=1,
                window=opts["window"],
            ).priorities
            np.testing.assert_allclose(e["priorities"], prio, rtol=0, atol=0)
            gone_k, gone_v = kv_of(ref, layer, kh, gone)
            order, _, _ = brute_force_mi(
                before,
                keys,
                values,
                protected,
                prio,
                budget,
                gone_k,
                gone_v,
                modifier == "momentkv-zeroth",
            )
            assert e["evicted"] == [before[j] for j in order], (layer, kh, e["seen"])
            assert e["kept"] == sorted(set(before) - set(e["evicted"]))
            differs_from_base += set(e["kept"]) != set(
                expected_kept(before, protected, prio, budget)
            )
            near += e["near_ties"]
            gone += e["evicted"]
        keys, values = kv_of(ref, layer, kh, gone)
        m = r["moments"]
        assert m["count"][layer, kh] == len(gone)
        np.testing.assert_allclose(m["v_sum"][layer, kh], values.sum(0), atol=1e-12)
        np.testing.assert_allclose(
            m["vk_sum"][layer, kh], np.einsum("ni,nj->ij", values, keys), atol=1e-12
        )
    assert differs_from_base > 0
    assert r["near_ties"] == near


# --------------------------------------------------------------------------------------------------
# MomentKV: normalization-corrected inference
# --------------------------------------------------------------------------------------------------


def full_output(q, keys, values):
    return plain_attention(q, keys, values)[1]


def kept_attention(qs, keys, values):
    z, A, o, log_z = reference_eviction.attention(
        qs, keys, values, np.ones((len(qs), len(keys)), bool)
    )
    return o, log_z


def test_nc_with_no_evicted_tokens_is_plain_attention():
    rng = np.random.default_rng(0)
    qs, keys, values = rng.normal(size=(3, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
    o, log_z = kept_attention(qs, keys, values)
    for zeroth in (False, True):
        np.testing.assert_array_equal(nc_correct(qs, o, log_z, empty_moments(4), zeroth=zeroth), o)
    np.testing.assert_allclose(o, [full_output(q, keys, values) for q in qs], rtol=1e-13)


@pytest.mark.parametrize("seed", range(3))
def test_nc_is_exact_when_the_evicted_logits_are_all_equal(seed):
    """When every evicted token has the same logit for q (δ_i = 0), both approximations are exact:
    Jensen is tight, Ẑ_E = n exp(q·k̄/√d) = Z_E, and f_E = Σ e^{δ_i} v_i / Σ e^{δ_i} = v̄. The
    first-order term S̃ q / (n√d) = Σ_i v_i δ_i / n vanishes (S̃ q = Σ_i v_i (k_i − k̄)·q = 0). So ŵ
    o_R + (1 − ŵ) f̂ is the full attention output over kept ∪ evicted tokens (up to rounding),
    whatever the evicted values. (a) identical evicted keys: S̃ = 0 itself (its rounding residue is
    clamped to 0); (b) evicted keys that differ only orthogonally to q: S̃ ≠ 0 but S̃ q = 0 — this
    also pins the orientation of
        S̃ (S̃ᵀ q = Σ (k_i − k̄)(v_i·q) would not vanish)."""
    rng = np.random.default_rng(seed)
    K = 6
    keys, values = rng.normal(size=(5, K)) * 1.5, rng.normal(size=(5, K))
    gone_v = rng.normal(size=(4, K)) * 2
    q = rng.normal(size=K) * 1.5
    # (a) identical keys, several queries
    qs = np.vstack([q, rng.normal(size=(2, K))])
    gone_k = np.tile(rng.normal(size=K), (4, 1))
    o, log_z = kept_attention(qs, keys, values)
    for zeroth in (False, True):
        got = nc_correct(qs, o, log_z, moments_of(gone_k, gone_v), zeroth=zeroth)
        want = [full_output(x, np.vstack([keys, gone_k]), np.vstack([values, gone_v])) for x in qs]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # (b) keys equal along q, different across q
    u = q / np.linalg.norm(q)
    gone_k = rng.normal(size=(4, K)) * 2
    gone_k = gone_k - np.outer(gone_k @ u, u) + 0.7 * u  # every k_i·q = 0.7 ‖q‖
    np.testing.assert_allclose(gone_k @ q, 0.7 * np.linalg.norm(q))
    m = moments_of(gone_k, gone_v)
    s_tilde = m.vk_sum - np.outer(m.v_sum, m.k_sum) / m.count
    assert np.abs(s_tilde).max() > 0.1 and np.linalg.norm(s_tilde.T @ q) > 0.1
    o, log_z = kept_attention(q[None], keys, values)
    got = nc_correct(q[None], o, log_z, m, zeroth=False)[0]
    want = full_output(q, np.vstack([keys, gone_k]), np.vstack([values, gone_v]))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # plain eviction (no correction) is visibly wrong here
    assert np.linalg.norm(o[0] - want) > 1e-2


def test_nc_first_order_error_is_second_order_in_the_key_spread():
    """Evicted keys k̄ + ε u_i: the corrected output's error is O(ε²) (first order) vs O(ε) (zeroth
    order)."""
    rng = np.random.default_rng(5)
    K = 6
    keys, values = rng.normal(size=(5, K)), rng.normal(size=(5, K))
    q = rng.normal(size=K)
    k_bar, spread, gone_v = rng.normal(size=K), rng.normal(size=(6, K)), rng.normal(size=(6, K))
    o, log_z = kept_attention(q[None], keys, values)
    errors = {False: [], True: []}
    for eps in (4e-2, 2e-2, 1e-2):
        gone_k = k_bar + eps * spread
        want = full_output(q, np.vstack([keys, gone_k]), np.vstack([values, gone_v]))
        for zeroth in (False, True):
            got = nc_correct(q[None], o, log_z, moments_of(gone_k, gone_v), zeroth=zeroth)[0]
            errors[zeroth].append(np.linalg.norm(got - want))
    first, zero = np.array(errors[False]), np.array(errors[True])
    assert np.all((3.5 < first[:-1] / first[1:]) & (first[:-1] / first[1:] < 4.5)), first
    assert np.all((1.8 < zero[:-1] / zero[1:]) & (zero[:-1] / zero[1:] < 2.2)), zero


def test_nc_clamps_small_entries_of_s_tilde():
    """Entries of S̃ with magnitude below 1e-6 are 0 in f̂; larger ones are used. Here s_v = s_k =
    0, so S̃ = S."""
    K = 2
    keys, values = np.array([[1e-3, -1e-3], [5e-4, -4e-4]]), np.array([[1.0, 0.0], [0.0, 1.0]])
    q = np.array([1000.0, 1000.0])  # kept logits ≈ 0 and k̄ = 0: ŵ ≈ 1/2
    S = np.array([[5e-7, -9.9e-7], [-2e-6, 3e-6]])
    m = Moments(2, np.zeros(K), np.zeros(K), S)
    o, log_z = kept_attention(q[None], keys, values)
    got = nc_correct(q[None], o, log_z, m, zeroth=False)[0]
    Z = np.exp(log_z[0])
    w = Z / (Z + 2 * np.exp(0.0))
    want_clamped = w * o[0] + (1 - w) * (np.array([[0, 0], [-2e-6, 3e-6]]) @ q / (2 * np.sqrt(K)))
    want_unclamped = w * o[0] + (1 - w) * (S @ q / (2 * np.sqrt(K)))
    assert 0.4 < w < 0.6
    np.testing.assert_allclose(got, want_clamped, rtol=0, atol=1e-14)
    assert np.abs(want_clamped - want_unclamped).max() > 5e-5


def test_nc_is_computed_in_log_space():
    """Logits far beyond exp's range: ŵ from log Z and log n + q·k̄/√d stays finite and correct."""
    keys, values = (
        np.array([[400.0, 0, 0, 0], [399.0, 0, 0, 0]]),
        np.array([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]),
    )
    q = np.array([8.0, 0, 0, 0])  # logits 1600 and 1596
    gone_k, gone_v = np.array([[400.5, 0, 0, 0]] * 3), np.array([[0, 0, 1.0, 0]] * 3)  # logit 1602
    o, log_z = kept_attention(q[None], keys, values)
    got = nc_correct(q[None], o, log_z, moments_of(gone_k, gone_v), zeroth=False)[0]
    want = full_output(q, np.vstack([keys, gone_k]), np.vstack([values, gone_v]))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "scorer,protocol",
    [
        ("snapkv+momentkv-nc", "blockwise"),
        ("h2o+momentkv-zeroth", "blockwise"),
        ("streamingllm+momentkv-nc", "prefill"),
        ("momentkv", "blockwise"),
    ],
)
def test_nc_outputs_in_the_reference_equal_the_formula_over_the_evicted_set(
    params, prompt, scorer, protocol
):
    """Every output of every query (prefill blocks and decode steps): recompute the corrected output
    from the kept tokens it saw and the set evicted *before its step* (explicit means and centred
    S̃, no running sums)."""
    budget, m = 20, 16
    opts = defaults(scorer, budget)
    ref = Reference(
        params, scorer=scorer, budget=budget, protocol=protocol, block_size=m, evict_every=2, **opts
    )
    ref.run(prompt, N)
    zeroth = parse_scorer(scorer)[1] == "momentkv-zeroth"
    steps = [range(s, min(s + m, P)) for s in range(0, P, m)] + [
        range(p, p + 1) for p in range(P, P + N)
    ]
    G, K = ref.G, ref.cfg.head_dim
    corrected = 0
    for layer, kh in itertools.product(range(2), range(2)):
        log = [e for e in ref.evictions if (e["layer"], e["kv_head"]) == (layer, kh)]
        for step in steps:
            gone = sorted(p for e in log if e["seen"] <= step[0] for p in e["evicted"])
            gone_k, gone_v = kv_of(ref, layer, kh, gone)
            for p in step:
                visible = [x for x in range(p + 1) if x not in gone]
                keys, values = kv_of(ref, layer, kh, visible)
                for g in range(G):
                    q = ref.history[layer]["q"][p][kh * G + g]
                    a, o, z = plain_attention(q, keys, values)
                    want = o
                    if gone:
                        n = len(gone)
                        k_bar, v_bar = gone_k.mean(0), gone_v.mean(0)
                        s_tilde = sum(np.outer(v, k - k_bar) for v, k in zip(gone_v, gone_k))
                        s_tilde[np.abs(s_tilde) < 1e-6] = 0
                        Z = np.sum(np.exp(z))
                        w = Z / (Z + n * np.exp(q @ k_bar / np.sqrt(K)))
                        f_hat = v_bar if zeroth else v_bar + s_tilde @ q / (n * np.sqrt(K))
                        want = w * o + (1 - w) * f_hat
                        corrected += np.linalg.norm(want - o) > 1e-3
                    np.testing.assert_allclose(
                        ref.history[layer]["o"][p][kh * G + g], want, rtol=0, atol=1e-10
                    )
    assert corrected > 50


def test_nc_changes_only_outputs_not_scores(params, prompt):
    """NC alone (no MI) evicts by the base rule from the base states. Prefill protocol: nothing is
    evicted before its one eviction point, so n = 0 during the whole prefill and h2o+momentkv-nc's
    logits, states and decisions there equal h2o's (afterwards the corrected outputs make the runs
    differ)."""
    budget = 20
    a = Reference(
        params,
        scorer="h2o+momentkv-nc",
        budget=budget,
        protocol="prefill",
        block_size=16,
        n_sink=2,
        window=5,
    )
    b = Reference(
        params, scorer="h2o", budget=budget, protocol="prefill", block_size=16, n_sink=2, window=5
    )
    ra, rb = a.run(prompt, 0), b.run(prompt, 0)
    assert (
        ra["kept_after_prefill"] == rb["kept_after_prefill"]
    )  # nothing was evicted before the prefill point
    np.testing.assert_allclose(ra["prefill_logits"], rb["prefill_logits"], rtol=0, atol=1e-12)
    assert len(a.evictions) == len(b.evictions) == 4
    for ea, eb in zip(a.evictions, b.evictions):
        np.testing.assert_array_equal(ea["states"], eb["states"])
        assert ea["kept"] == eb["kept"]
