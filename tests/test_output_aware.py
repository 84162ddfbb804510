"""Output-aware scorers checked against what their formulas approximate: OBCache against the
second-order Taylor expansion (jax.hessian) and the exact error of removing a token, CAOTE against
the exact change of the attention output, MomentKV's correction against plain attention and the full
cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import covering, moments_of, own_pass, scorer_requirements
from kvjax.kernels import attention_with_scores, corrected_attention

import kvjax
from kvjax.eviction import SCORERS, split_name
from kvjax.eviction.moments import LAYER_CHUNK, LONG_LOOP, Moments, over_layers
from kvjax.eviction.priority import caote

S, W, K, G = 24, 6, 16, 3  # slots, perturbation window, head dim, query heads per KV head


def random_head(seed, scale=1.2):
    """One KV head with G query heads; the window's W queries sit at positions S-W..S-1 (causal)."""
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(1, W, G, K)) * scale, jnp.float32)
    k = jnp.asarray(r.normal(size=(1, 1, S, K)) * scale, jnp.float32)
    v = jnp.asarray(r.normal(size=(1, 1, S, K)), jnp.float32)
    mask = (jnp.arange(S)[None, :] <= jnp.arange(S - W, S)[:, None])[None, None]
    return q, k, v, mask


def outputs(q, k, v, mask):
    return attention_with_scores(q, k, v, mask)[0][0]  # [W, G, K]


def taylor_error(q, k, v, mask, slot, kind):
    """½ f''(0) per query head, f(t) = Σ_i ‖o_i(t) − o_i(0)‖² with the slot's value/key/both scaled
    by 1 − t."""
    e = jnp.zeros((S, 1)).at[slot].set(1.0)
    base = outputs(q, k, v, mask)

    def f(t):
        kt = k - t * e * k if kind in ("key", "joint") else k
        vt = v - t * e * v if kind in ("value", "joint") else v
        return jnp.sum((outputs(q, kt, vt, mask) - base) ** 2, axis=(0, 2))  # [G]

    return 0.5 * jax.hessian(f)(0.0)


@pytest.mark.parametrize("kind", ["value", "key", "joint"])
@pytest.mark.parametrize("seed", [0, 1])
def test_obcache_closed_forms_equal_the_second_order_taylor_expansion(kind, seed):
    q, k, v, mask = random_head(seed)
    col = attention_with_scores(q, k, v, mask, jnp.ones((1, W)), f"obcache-{kind}")[2][
        0, 0
    ]  # [G, S]
    expected = jnp.stack([taylor_error(q, k, v, mask, slot, kind) for slot in range(S)], axis=-1)
    np.testing.assert_allclose(np.asarray(col), np.asarray(expected), rtol=1e-4, atol=1e-5)


def spearman(a, b):
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return np.corrcoef(ra, rb)[0, 1]


def test_obcache_ranks_tokens_closer_to_the_exact_removal_error_than_attention():
    """Exact error of evicting a token: recompute the window's attention without it (softmax
    renormalised)."""
    rho = {name: [] for name in ("attn", "obcache-value", "obcache-key", "obcache-joint")}
    for seed in range(12):
        q, k, v, mask = random_head(seed, scale=1.5)
        base = outputs(q, k, v, mask)
        exact = np.array(
            [
                float(jnp.sum((outputs(q, k, v, mask & (jnp.arange(S) != j)) - base) ** 2))
                for j in range(S)
            ]
        )
        for name in rho:
            col = attention_with_scores(q, k, v, mask, jnp.ones((1, W)), name)[2][0, 0].sum(0)
            rho[name].append(spearman(np.asarray(col), exact))
    means = {name: float(np.mean(r)) for name, r in rho.items()}
    print("mean Spearman rank correlation with the exact removal error:", means)
    assert means["obcache-joint"] > means["attn"]
    assert means["obcache-key"] > means["attn"]


@pytest.mark.parametrize("fast", [False, True])
def test_caote_equals_the_exact_output_change_for_one_query(fast):
    q, k, v, mask = random_head(3)
    q, mask = q[:, -1:], mask[:, :, -1:]  # one query (TOVA's setting), attending every slot
    _, _, attn = attention_with_scores(q, k, v, mask, jnp.ones((1, 1)))
    score = caote(attn, v, jnp.ones((1, 1, S), bool), fast=fast)[0, 0]  # [G, S]
    base = outputs(q, k, v, mask)[0]  # [G, K]
    exact = np.stack(
        [
            np.linalg.norm(
                np.asarray(outputs(q, k, v, mask & (jnp.arange(S) != j))[0] - base), axis=-1
            )
            for j in range(S)
        ],
        axis=-1,
    )
    if fast:  # FastCAOTE swaps the output for the mean value: exact only in that replacement
        mean_v = np.asarray(v[0, 0]).mean(0)
        a = np.asarray(attn[0, 0])
        exact = (
            a / (1 - a) * np.linalg.norm(mean_v[None, None] - np.asarray(v[0, 0])[None], axis=-1)
        )
    np.testing.assert_allclose(np.asarray(score), exact, rtol=1e-5, atol=1e-6)


def test_correction_with_nothing_evicted_is_plain_attention():
    q, k, v, mask = random_head(4)
    out, lse, _ = attention_with_scores(q, k, v, mask)
    empty = moments_of(jnp.zeros((1, 1, 0, K)), jnp.zeros((1, 1, 0, K)))
    np.testing.assert_array_equal(
        np.asarray(corrected_attention(out, lse, q.reshape(1, W, G, K), empty, False)),
        np.asarray(out),
    )


def test_correction_is_exact_when_the_evicted_keys_coincide():
    """With all evicted keys equal (zero centred spread) Jensen's bound is tight and the moment
    estimate is the evicted tokens' exact mean value, so the correction recovers the full attention
    output."""
    q, k, v, mask = random_head(5)
    k = k.at[:, :, :8].set(k[:, :, :1])
    full = attention_with_scores(q, k, v, mask)[0]
    kept = mask & (jnp.arange(S) >= 8)
    out, lse, _ = attention_with_scores(q, k, v, kept)
    corrected = corrected_attention(out, lse, q, moments_of(k[:, :, :8], v[:, :, :8]), False)
    np.testing.assert_allclose(np.asarray(corrected), np.asarray(full), atol=1e-5)
    assert np.abs(np.asarray(out) - np.asarray(full)).max() > 1e-2  # plain renormalisation is off


@pytest.mark.parametrize("zeroth", [False, True])
def test_correction_stays_finite_with_large_logits(zeroth):
    q, k, v, mask = random_head(6)
    q = q * 80 / jnp.abs(jnp.einsum("btgk,bhsk->bgts", q, k) / np.sqrt(K)).max()  # logits up to ±80
    kept = mask & (jnp.arange(S) >= 8)
    out, lse, _ = attention_with_scores(q, k, v, kept)
    corrected = corrected_attention(out, lse, q, moments_of(k[:, :, :8], v[:, :, :8]), zeroth)
    assert np.all(np.isfinite(np.asarray(corrected)))


def test_every_scorer_name_runs_end_to_end(tiny_llama, tiny_head_scores, request):
    """Names through kvjax.generate under the block-wise protocol: each modifier once by default
    (every base and alias runs through kvjax.generate on SmolLM2:
    tests/test_output_aware_smollm2.py), every name with --runslow (the prefill protocol:
    tests/test_prefilled.py, through kvjax.prefill and kvjax.decode; the combinations against the
    NumPy reference in tests/test_engine_vs_reference.py)."""
    prompt = np.random.default_rng(0).integers(4, 97, 60).astype(np.int32)
    names = (
        SCORERS
        if request.config.getoption("--runslow")
        else [n for n in covering(SCORERS) if split_name(n)[2]]
    )
    for name in names:
        protocol = "prefill" if own_pass(name) else "blockwise"
        out = kvjax.generate(
            tiny_llama,
            prompt,
            max_new_tokens=4,
            budget=24,
            scorer=name,
            protocol=protocol,
            block_size=16,
            obs_window=8,
            stop_ids=(),
            **scorer_requirements(name, tiny_head_scores),
        )
        assert len(out) == 4, (name, protocol)


def test_unknown_or_invalid_combinations_list_the_valid_names(tiny_llama):
    for bad in ("snapkv+magic", "streamingllm+caote", "h2o+caote+obcache-key", "obcache-key"):
        with pytest.raises(ValueError, match=r"is unknown; valid scorers: .*snapkv\+obcache-joint"):
            kvjax.generate(tiny_llama, np.arange(4, 20), max_new_tokens=2, budget=40, scorer=bad)


@pytest.mark.parametrize("kind", ["key", "joint"])
def test_obcache_stays_accurate_when_a_query_attends_to_one_token(kind):
    """Where one token takes nearly all of a query's attention its value is the output (o ≈ v), and
    the expanded ‖v‖² − 2 v·o + ‖o‖² loses every digit in float32; the scores must still match
    float64."""
    q, k, v, mask = random_head(7)
    k = k.at[0, 0, 5].set(
        q[0, -1, 0] * 4.0
    )  # the last query of head 0 puts almost all its weight on slot 5
    col = attention_with_scores(q, k, v, mask, jnp.ones((1, W)), f"obcache-{kind}")[2][
        0, 0
    ]  # [G, S]
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q[0], k[0, 0], v[0, 0]))
    expected = np.zeros((G, S))
    for t in range(W):
        for g in range(G):
            visible = np.asarray(mask[0, 0, t])
            z = k64 @ q64[t, g] / np.sqrt(K)
            a = np.where(visible, np.exp(z - z[visible].max()), 0.0)
            a /= a.sum()
            o = a @ v64
            az = a * z
            expected[g] += az**2 * np.sum((v64 - o) ** 2, -1)
            if kind == "joint":
                expected[g] += a**2 * np.sum(v64**2, -1) + 2 * a * az * np.sum(v64 * (v64 - o), -1)
    assert (
        np.max(np.asarray(attention_with_scores(q, k, v, mask, jnp.ones((1, W)))[2][0, 0, 0]))
        > 0.99
    )
    np.testing.assert_allclose(np.asarray(col), expected, rtol=1e-3, atol=1e-7)


def batched_eviction_reference(
    priority, candidates, n_evict, k, v, pos, count, k_sum, v_sum, vk_sum, batch
):
    """NumPy float64: per step, evict the ``batch`` candidates of lowest priority·‖r‖ (ties: earlier
    position) under the current statistics, then add them all."""
    evicted = np.zeros(len(priority), bool)
    while evicted.sum() < n_evict:
        n = max(count, 1.0)
        if count > 0:
            s_tilde = vk_sum - np.outer(v_sum, k_sum) / n
            resid = v - v_sum / n - k @ s_tilde.T / (n * np.sqrt(k.shape[1]))
        else:
            resid = v
        score = np.where(candidates & ~evicted, priority * np.linalg.norm(resid, axis=1), np.inf)
        order = sorted(range(len(score)), key=lambda j: (score[j], pos[j]))
        chosen = [j for j in order if candidates[j] and not evicted[j]][
            : min(batch, n_evict - evicted.sum())
        ]
        for j in chosen:
            evicted[j] = True
            count, k_sum, v_sum, vk_sum = (
                count + 1,
                k_sum + k[j],
                v_sum + v[j],
                vk_sum + np.outer(v[j], k[j]),
            )
    return evicted


def test_moment_eviction_scores_a_rounding_apart_tie():
    """Two equal tokens under equal priorities tie; read at other slots their scores can round apart
    (here the later one is made lower by 2e-7 relative, and float32 keeps it lower). The exact loop
    calls that a tie and evicts the earlier position, as the float64 reference does on the equal
    tokens."""
    from kvjax.eviction.moments import Moments, moment_informed_eviction

    r = np.random.default_rng(7)
    N = 6
    k, v = r.normal(size=(1, 1, N, K)), r.normal(size=(1, 1, N, K)) * 3.0
    v[0, 0, 4] = v[0, 0, 1] * (1.0 - 2e-7)  # slot 4 holds the later position (9)
    pos = np.array([[[0, 2, 3, 5, 9, 7]]], np.int32)
    priority = np.full((1, 1, N), 0.5)
    priority[0, 0, [0, 2, 3, 5]] = 4.0
    v32 = jnp.asarray(v, jnp.float32)
    norms = np.asarray(jnp.linalg.norm(v32[0, 0], axis=-1))
    assert norms[4] < norms[1]  # without the tie rule the later position would go
    args = (
        jnp.asarray(priority, jnp.float32),
        jnp.ones((1, 1, N), bool),
        jnp.array([[1]]),
        jnp.asarray(k, jnp.float32),
        v32,
        jnp.asarray(pos),
    )
    got = np.asarray(moment_informed_eviction(*args, Moments.zeros((1, 1), (K, K)), False, 1))[0, 0]
    np.testing.assert_array_equal(np.flatnonzero(got), [1])


def test_moment_eviction_finds_a_copy_of_the_evicted_token():
    """With one token evicted, a copy of its value is predicted exactly (v̄ = v_e, S̃ = 0: r = 0)
    and goes next. The scalars' cancelling sum leaves rounding noise on its score above the other
    candidates' scores (priority 1e-5): screened by that sum rather than its lower bound (``FLOOR``
    = 0), the copy is missed."""
    from kvjax.eviction.moments import moment_informed_eviction

    r = np.random.default_rng(11)
    N = 10
    k, v = r.normal(size=(1, 1, N, K)) * 3.0, r.normal(size=(1, 1, N, K)) * 10.0
    v[0, 0, 6] = v[0, 0, 0]
    k[0, 0, 6] = r.normal(size=K) * 3.0  # another position: another key
    priority = np.full((1, 1, N), 1e-5)
    priority[0, 0, 6] = 1.0
    moments = moments_of(
        jnp.asarray(k[:, :, :1], jnp.float32), jnp.asarray(v[:, :, :1], jnp.float32)
    )
    candidates = np.arange(N) > 0
    args = (
        jnp.asarray(priority, jnp.float32),
        jnp.asarray(candidates)[None, None],
        jnp.array([[1]]),
        jnp.asarray(k, jnp.float32),
        jnp.asarray(v, jnp.float32),
        jnp.arange(N, dtype=jnp.int32)[None, None],
    )
    got = np.asarray(moment_informed_eviction(*args, moments, False, 1))[0, 0]
    want = batched_eviction_reference(
        priority[0, 0],
        candidates,
        1,
        k[0, 0],
        v[0, 0],
        np.arange(N),
        1.0,
        k[0, 0, 0],
        v[0, 0, 0],
        np.outer(v[0, 0, 0], k[0, 0, 0]),
        1,
    )
    assert np.flatnonzero(want).tolist() == [6]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("batch", [1, 3, 50])
def test_batched_moment_eviction_matches_its_numpy_reference(batch):
    from kvjax.eviction.moments import moment_informed_eviction

    r = np.random.default_rng(batch)
    B, Hk, N = 1, 2, 30
    k, v = r.normal(size=(B, Hk, N, K)), r.normal(size=(B, Hk, N, K))
    priority = r.uniform(0.1, 1.0, size=(B, Hk, N))
    candidates = r.uniform(size=(B, Hk, N)) < 0.8
    pos = np.stack([r.permutation(N) for _ in range(B * Hk)]).reshape(B, Hk, N).astype(np.int32)
    gone_k, gone_v = r.normal(size=(B, Hk, 5, K)), r.normal(size=(B, Hk, 5, K))
    moments = moments_of(jnp.asarray(gone_k, jnp.float32), jnp.asarray(gone_v, jnp.float32))
    n_evict = np.array([[12, 17]])
    args = [jnp.asarray(x, jnp.float32) for x in (priority,)] + [
        jnp.asarray(candidates),
        jnp.asarray(n_evict),
        jnp.asarray(k, jnp.float32),
        jnp.asarray(v, jnp.float32),
        jnp.asarray(pos),
    ]
    got = np.asarray(moment_informed_eviction(*args, moments, False, 20, batch))
    for h in range(Hk):
        want = batched_eviction_reference(
            priority[0, h],
            candidates[0, h],
            n_evict[0, h],
            k[0, h],
            v[0, h],
            pos[0, h],
            5.0,
            gone_k[0, h].sum(0),
            gone_v[0, h].sum(0),
            np.einsum("ei,ej->ij", gone_v[0, h], gone_k[0, h]),
            batch,
        )
        np.testing.assert_array_equal(got[0, h], want)


def test_every_layers_moments_take_an_eviction_at_the_layer_in_place():
    """``Moments.add`` to every layer's moments (the carried layer scan's form) adds to the layer
    given exactly as to that layer's own; ``Moments.at`` reads it back; without a layer it
    refuses."""

    rng = np.random.default_rng(3)
    L, B, Hk, E, K = 3, 2, 2, 2, 8
    stack = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32),
        Moments.zeros((L, B, Hk), (K, K)),
    )
    weight = jnp.asarray(rng.integers(0, 2, (B, Hk, E)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, Hk, E, K)), jnp.float32) for _ in range(2))
    added = stack.add(weight, k, v, jnp.int32(1))
    one = stack.at(jnp.int32(1)).add(weight, k, v)
    jax.tree.map(np.testing.assert_array_equal, added.at(jnp.int32(1)), one)
    for i in (0, 2):
        jax.tree.map(np.testing.assert_array_equal, added.at(jnp.int32(i)), stack.at(jnp.int32(i)))
    assert one.at(jnp.int32(1)) is one  # one layer's: itself
    with pytest.raises(ValueError, match="layer: adding to every layer's moments"):
        stack.add(weight, k, v)


def test_layers_in_chunks_take_empty_leaves():
    """A zeroth-order cache's Σ v kᵀ is [L, B, Hk, 0, 0], which ``lax.map``'s chunks cannot reshape:
    ``over_layers`` past ``LONG_LOOP`` evictions (``LAYER_CHUNK`` layers at a time, two chunks and
    one layer here) hands ``fn`` each layer's empty slice and takes its empty outputs, and gives
    what every layer at once gives."""
    rng = np.random.default_rng(4)
    L = 2 * LAYER_CHUNK + 1
    moments = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32),
        Moments.zeros((L, 2, 3), (8, 0)),
    )

    def fn(m):
        assert m.vk_sum.shape == (2, 3, 0, 0)
        return m.count + m.v_sum.sum(-1) * m.k_sum.sum(-1), m.add(
            m.count[..., None], m.k_sum[:, :, None], m.v_sum[:, :, None]
        )

    chunked, at_once = over_layers(fn, moments, LONG_LOOP + 1), over_layers(fn, moments, LONG_LOOP)
    assert chunked[1].vk_sum.shape == (L, 2, 3, 0, 0)
    jax.tree.map(np.testing.assert_array_equal, chunked, at_once)
