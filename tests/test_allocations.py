"""Budget allocations on the paged cache: memory that follows the total budget, the page pool's
bookkeeping under many eviction points, and clear errors. (That every allocation keeps exactly what
the NumPy reference keeps is in test_engine_vs_reference.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvjax.kernels.eviction_place.reference import lowest_of
from reference_eviction import shared_counts

import kvjax
from kvjax.eviction import allocations
from kvjax.eviction.allocations import (
    FLOOR_MODES,
    AdaKV,
    floor_count,
    ranks,
    shared_drops,
    shared_targets,
)
from kvjax.runtime.decoding import Generation
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling
from kvjax.slots import inverse_permutation, true_first

SMOLLM2 = kvjax.ModelConfig(
    arch="llama",
    vocab_size=49152,
    d_model=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    d_ff=1536,
    max_seq_len=8192,
)
ALLOCATIONS = ("pyramidkv", "adakv", "global")


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("budget", [64, 128, 256, 512, 1024])
def test_cache_bytes_follow_the_total_budget(budget, batch):
    """SmolLM2's shapes: a compressed context's keys and values take what the uniform cache takes,
    plus at most 5% or one page per (layer, row, KV head) — never n_kv_heads × the largest head's
    share."""
    cfg, L, Hk = SMOLLM2, SMOLLM2.n_layers, SMOLLM2.n_kv_heads

    def kv_bytes(allocation):
        ev = eviction_from(budget=budget, scorer="snapkv", allocation=allocation, n_sink=0)
        return kvjax.cache_bytes(
            jax.eval_shape(lambda: ev.empty_cache(cfg, batch, ev.decode_spare(0), jnp.float32)),
            kv_only=True,
        ), ev

    uniform, _ = kv_bytes("uniform")
    assert uniform == 2 * L * batch * Hk * (budget + 1) * cfg.head_dim * 4
    for allocation in ALLOCATIONS:
        paged, ev = kv_bytes(allocation)
        page = 2 * ev.page_size * cfg.head_dim * 4
        assert uniform <= paged <= max(1.05 * uniform, uniform + L * batch * Hk * page), allocation
        largest = ev.policy.head_capacity(L, Hk)  # what a dense layout would hold per head
        assert paged < 2 * L * batch * Hk * largest * cfg.head_dim * 4


@pytest.fixture(scope="module")
def model():
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=97,
        d_model=32,
        n_layers=3,
        n_heads=6,
        n_kv_heads=3,
        head_dim=8,
        d_ff=48,
        max_seq_len=512,
        eos_token_ids=(3,),
        pad_token_id=0,
    )
    return kvjax.init_params(cfg, jax.random.key(7), scale=0.4)


def check_pool(cache, page_size):
    """Every used page belongs to one (layer, row, KV head); the rest are free; each head holds its
    tokens in slots 0 … n−1 backed by ⌈n / P⌉ pages."""
    table, n_pages, free = map(np.asarray, (cache.table, cache.n_pages, cache.free))
    pos = np.asarray(cache.pos)
    L, B, Hk, _ = table.shape
    for b in range(B):
        used = [
            table[layer, b, h, j]
            for layer in range(L)
            for h in range(Hk)
            for j in range(n_pages[layer, b, h])
        ]
        assert len(used) == len(set(used)), "a page is used twice"
        assert set(used) == set(np.flatnonzero(~free[b])), "the free pages are not the unused ones"
        for layer in range(L):
            for h in range(Hk):
                n = int((pos[layer, b, h] >= 0).sum())
                assert (pos[layer, b, h, :n] >= 0).all() and n_pages[layer, b, h] == -(
                    -n // page_size
                )


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_page_pool_stays_consistent_under_every_allocation(model, data):
    allocation = data.draw(st.sampled_from(("uniform",) + ALLOCATIONS))
    protocol = data.draw(st.sampled_from(("blockwise", "prefill")))
    page = data.draw(st.sampled_from((2, 4, 8)))
    lengths = data.draw(st.lists(st.integers(5, 60), min_size=1, max_size=3))
    evict_every = data.draw(st.integers(1, 3))
    options = dict(
        budget=24,
        scorer=data.draw(st.sampled_from(("snapkv", "h2o", "tova", "momentkv"))),
        allocation=allocation,
        protocol=protocol,
        block_size=8,
        evict_every=evict_every,
        page_size=page,
        obs_window=4,
        n_sink=0,
        window=0 if allocation == "pyramidkv" else 2,
    )
    ev = eviction_from(**options)
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    prompts = [rng.integers(4, 97, n).astype(np.int32) for n in lengths]
    gen = Generation.from_prompts(model, prompts, 12, Sampling(), 0, (), ev)
    check_pool(gen.state.cache, page)
    for _ in range(12):
        gen.run(1)
        check_pool(gen.state.cache, page)
    kept = (np.asarray(gen.state.cache.pos) >= 0).sum(-1)  # [L, B, Hk]
    total = ev.policy.total_budget(model.config.n_layers, model.config.n_kv_heads)
    assert (
        kept.sum((0, 2)) <= total + evict_every * model.config.n_layers * model.config.n_kv_heads
    ).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(scorer="adakv+snapkv", allocation="global"),
            "allocation='global' contradicts scorer='adakv\\+snapkv'",
        ),
        (dict(allocation="even"), "allocation='even' must be one of"),
        (
            dict(scorer="adakv", floor=1.5),
            r"floor=1.5 must be a fraction of the budget in \[0, 1\]",
        ),
        (
            dict(scorer="adakv", floor_mode="ada"),
            r"floor_mode='ada' must be one of \('adakv', 'kvpress'\)",
        ),
        (
            dict(decode_order="later"),
            r"decode_order='later' must be one of \('attend-first', 'evict-first'\)",
        ),
        (
            dict(scorer="global+snapkv", decode_order="evict-first"),
            "allocation='global' ranks every layer's tokens",
        ),
        (dict(chunk=0), "chunk=0 must be an integer >= 1"),
        (dict(allocation="adakv", page_size=0), "page_size=0 must be an integer >= 1"),
        (dict(allocation="heads"), "allocation='heads' belongs to scorer 'kvzip-head'"),
        (dict(scorer="adakv+adakv"), "names two allocations"),
        (
            dict(scorer="tova", aggregate="layer", allocation="adakv"),
            "aggregate='layer' keeps the same tokens",
        ),
        (dict(scorer="pyramidkv", budget=40), "gives layer 2 a budget of"),
    ],
)
def test_bad_allocation_arguments(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvjax.generate(model, np.arange(4, 60, dtype=np.int32), 2, **{"budget": 64} | kwargs)


def test_floor_count_readings():
    """b = 128, a 32-token window, α = 0.2: AdaKV's code keeps 32 + ⌊0.2 × 96⌋ = 51 per head;
    kvpress's ⌊0.2 × 128⌋ = 25 of the head's best, the window among them, which is no floor at all.
    """
    assert floor_count(0.2, 128, 32, "adakv") == 51
    assert floor_count(0.2, 128, 32, "kvpress") == 25
    assert floor_count(0.0, 128, 32, "adakv") == 32 and floor_count(0.0, 128, 32, "kvpress") == 0
    assert floor_count(0.001, 128, 0, "kvpress") == 1  # kvpress keeps at least one when α > 0


@pytest.mark.parametrize("floor_mode", FLOOR_MODES)
def test_adakv_targets_match_brute_force(floor_mode):
    """AdaKV's kept counts on random keys (heads of unequal lengths and score scales, sinks and
    window protected) against the NumPy reference's one-slot-at-a-time sharing, under both floor
    readings; the same under the head capacity the cache is sized to (the layer's total less the
    other heads' floors), which some head reaches."""
    rng = np.random.default_rng(0)
    L, B, Hk, S, b, n_sink, window = 2, 3, 4, 40, 12, 1, 3
    reached = 0
    for alpha in (0.2, 0.5, 0.9):
        count = rng.integers(b, S + 1, (L, B, Hk))
        pos = np.where(np.arange(S) < count[..., None], np.arange(S), -1)
        protected = (pos >= 0) & ((pos < n_sink) | (pos >= count[..., None] - window))
        scale = rng.uniform(0.01, 10.0, (L, B, Hk, 1))  # unequal heads, so the floor binds
        key = np.where(
            protected, np.inf, np.where(pos >= 0, rng.random((L, B, Hk, S)) * scale, -np.inf)
        )
        floor = floor_count(alpha, b, n_sink + window, floor_mode)
        got = np.asarray(
            AdaKV().targets(
                jnp.asarray(key, jnp.float32), jnp.asarray(pos, jnp.int32), (b,) * L, floor, Hk * b
            )
        )
        capacity = AdaKV().head_capacity(b, window, L, Hk, floor)
        assert capacity == Hk * b - (Hk - 1) * floor
        np.testing.assert_array_equal(
            np.asarray(
                AdaKV().targets(
                    jnp.asarray(key, jnp.float32),
                    jnp.asarray(pos, jnp.int32),
                    (b,) * L,
                    floor,
                    capacity,
                )
            ),
            got,
        )
        assert got.max() <= capacity
        reached += (got == capacity).sum()
        for layer in range(L):
            for row in range(B):
                heads = [
                    dict(
                        positions=pos[layer, row, h, : count[layer, row, h]],
                        protected=protected[layer, row, h, : count[layer, row, h]],
                        prio=key[layer, row, h][
                            (pos[layer, row, h] >= 0) & ~protected[layer, row, h]
                        ],
                    )
                    for h in range(Hk)
                ]
                expected, _, _ = shared_counts(heads, Hk * b, floor, Hk * b)
                assert list(got[layer, row]) == expected, (alpha, layer, row)
        assert (got >= min(floor, b)).all()
    assert reached > 0


def _shuffled(rng, key, pos):
    """key, pos [..., S] with each head's slots in a random order (as a paged cache's compaction
    leaves them), and that head's ``order``: its slots by position, valid ones first, then the
    empty ones ascending."""
    perm = np.argsort(rng.random(pos.shape), -1)
    key, pos = np.take_along_axis(key, perm, -1), np.take_along_axis(pos, perm, -1)
    slot = np.arange(pos.shape[-1])
    order = np.argsort(np.where(pos >= 0, pos, pos.shape[-1] * 4 + slot), -1, kind="stable")
    return jnp.asarray(key), jnp.asarray(pos, jnp.int32), jnp.asarray(order, jnp.int32)


def _lowest(key, order, picks):
    """``Lowest`` of the keys listed by position, as ``few_dropped`` takes them."""
    return lowest_of(jnp.take_along_axis(key, order, -1), picks)


def _mask(gone, order, S):
    """The [..., S] mask of the dropped slots in ``gone`` = (slots, places) [..., picks] (-1: none),
    checking that each place is its slot's place in ``order``."""
    slots, places = (np.asarray(x) for x in gone)
    assert ((slots >= 0) == (places >= 0)).all()
    np.testing.assert_array_equal(
        np.where(places >= 0, np.take_along_axis(np.asarray(order), places.clip(0), -1), -1), slots
    )
    return (np.arange(S)[:, None] == slots[..., None, :]).any(-1)


@pytest.mark.parametrize("floor", [0, 3, 6])
def test_a_decoding_steps_few_drops_equal_the_sorted_ranking(floor):
    """``shared_drops`` (AdaKV's eviction in a decoding step: at most one slot per head to drop over
    the layer's heads, by greedy min-reductions) drops exactly the slots that ``shared_targets`` and
    the ranking by (key, position, head) leave out: on keys with many exact ties (within and across
    heads, equal positions in several heads), zeros of both signs, protected slots, heads at their
    floor and heads over the cap (AdaKV's: the layer's total), with each head's slots out of
    position order."""
    rng = np.random.default_rng(floor)
    B, H, S, total = 600, 3, 24, 21  # a budget of 7 per head
    count = rng.integers(2, 13, (B, H))
    over = rng.integers(0, H + 1, B)  # how many slots over the total each row holds
    big = rng.random(B) < 0.2  # rows with one head near the total, over it where `over` allows
    count[big] = np.stack(
        [rng.integers(20, S + 1, big.sum()), np.ones(big.sum(), int), np.ones(big.sum(), int)], -1
    )
    for b in range(B):  # at most `over` above the total: the fullest head gives up its last slots
        while count[b].sum() > total + over[b]:
            count[b, np.argmax(count[b])] -= 1
    pos = np.where(
        np.arange(S) < count[..., None], np.arange(S) + rng.integers(0, 3, (B, H, 1)), -1
    )
    key = np.where(
        pos >= 0, rng.integers(0, 4, (B, H, S)).astype(np.float32), -np.inf
    )  # 4 values: ties
    key = np.where((pos >= 0) & (rng.random((B, H, S)) < 0.1), np.inf, key)
    key = np.where((key == 0) & (rng.random((B, H, S)) < 0.5), -0.0, key)
    key, pos, order = _shuffled(rng, key, pos)
    kept = shared_targets(key, pos, total, floor, total)
    expected = np.asarray((key > -jnp.inf) & ~(ranks(-key, -pos) < kept[..., None]))
    gone = shared_drops(_lowest(key, order, H), pos, order, total, floor, total)
    np.testing.assert_array_equal(_mask(gone, order, S), expected)
    drops = expected.sum((-2, -1))
    assert (drops > 0).mean() > 0.3 and (drops == H).any() and (count > total).any()


@pytest.mark.parametrize("kind", ["pyramidkv", "heads"])
def test_a_decoding_steps_drop_per_head_equals_the_sorted_ranking(kind):
    """Heads with budgets of their own (PyramidKV's per layer, kvzip-head's per head) holding at
    most one slot over
    them: ``few_dropped`` (one min-reduction per head) drops what ``targets`` and the ranking by
    (key, position) leave out, on keys with exact ties and protected slots, some heads holding more
    protected slots than their budget; one head two over its budget is not a fit."""
    rng = np.random.default_rng(len(kind))
    L, B, Hk, S = 4, 150, 3, 16
    spec, budgets = allocations.ALLOCATIONS[kind], (9, 7, 5, 3)
    head_budgets = (
        np.concatenate([rng.integers(4, 12, (L - 1, Hk)), [[3, 2, 1]]]) if kind == "heads" else None
    )
    limit = np.broadcast_to(np.asarray(spec.limits(budgets, head_budgets, Hk)), (L, B, Hk))
    count = np.minimum(limit + rng.integers(-2, 2, (L, B, Hk)), S).clip(1)
    pos = np.where(
        np.arange(S) < count[..., None], np.arange(S) + rng.integers(0, 3, (L, B, Hk, 1)), -1
    )
    key = np.where(pos >= 0, rng.integers(0, 4, (L, B, Hk, S)).astype(np.float32), -np.inf)
    key = np.where(
        (pos >= 0) & (rng.random((L, B, Hk, S)) < 0.3), np.inf, key
    )  # all protected, in some heads
    key, pos, order = _shuffled(rng, key, pos)
    kept = spec.targets(key, pos, budgets, 0, max(budgets), head_budgets)
    expected = np.asarray((key > -jnp.inf) & ~(ranks(-key, -pos) < kept[..., None]))
    fits, dropped = spec.few_dropped(
        _lowest(key, order, 1), pos, order, budgets, 0, max(budgets), head_budgets
    )
    assert bool(fits)
    np.testing.assert_array_equal(_mask(dropped(), order, S), expected)
    assert expected.sum(-1).max() == 1 and expected.any(-1).mean() > 0.2
    assert (
        np.asarray((key == jnp.inf).sum(-1)) > limit
    ).any()  # the ranking drops a protected slot there
    two_over = np.arange(S) < limit[1, 0, 2] + 2
    order = order.at[1, 0, 2].set(np.arange(S))
    fits, _ = spec.few_dropped(
        _lowest(key.at[1, 0, 2].set(np.where(two_over, 1.0, -np.inf)), order, 1),
        pos.at[1, 0, 2].set(np.where(two_over, np.arange(S), -1)),
        order,
        budgets,
        0,
        max(budgets),
        head_budgets,
    )
    assert not bool(fits)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 33), (2, 2, 3, 40)])
def test_sort_free_partitions_equal_numpys_sorts(shape):
    """The paged cache's bookkeeping without sorts: ``true_first`` (free pages, dropped slots, the
    tails among a few slots) and ``inverse_permutation`` (ranks) against NumPy's stable argsort, at
    every density and cut."""
    rng = np.random.default_rng(len(shape))
    for density in (0.0, 0.2, 0.5, 0.9, 1.0):
        mask = rng.random(shape) < density
        for k in sorted({1, max(1, shape[-1] // 3), shape[-1]}):
            np.testing.assert_array_equal(
                np.asarray(true_first(jnp.asarray(mask), k)),
                np.argsort(~mask, axis=-1, kind="stable")[..., :k],
            )
        permutation = np.argsort(rng.random(shape), axis=-1)
        np.testing.assert_array_equal(
            np.asarray(inverse_permutation(jnp.asarray(permutation))),
            np.argsort(permutation, axis=-1),
        )
