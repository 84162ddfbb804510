"""``kvjax.eviction.priority``: the dense cache's eviction keys listed by position
(``keys_by_position``, pooled in position order) equal ``eviction_keys`` permuted by position, bit
for bit: every aggregate and pooling, GQA, empty slots, sinks and a window, slots in any order."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.eviction import eviction_keys, make_policy
from kvjax.eviction.keywords import EvictionKeywords
from kvjax.eviction.priority import keys_by_position


def layer(seed, B=2, Hk=3, G=4, S=80, empty=5):
    """One layer's state [B, Hk, G, S] (three slots' scores equal to three others': ties), positions
    (``empty`` slots of each head at -1; the rest a shuffled 0 … S − empty − 1), the order (the
    slots by position, the empty ones last) and seen [B]."""
    rng = np.random.default_rng(seed)
    state = rng.random((B, Hk, G, S), np.float32)
    state[..., :3] = state[..., 3:6]  # equal scores: the tie rule acts
    pos = np.full((B, Hk, S), -1, np.int32)
    order = np.zeros((B, Hk, S), np.int32)
    for b, h in itertools.product(range(B), range(Hk)):
        slots = rng.permutation(S)
        pos[b, h, slots[: S - empty]] = np.arange(S - empty)
        order[b, h] = slots
    return jnp.asarray(state), jnp.asarray(pos), jnp.asarray(order), jnp.array([S - empty] * B)


def policy_of(scorer: str, **keywords):
    return make_policy(EvictionKeywords(scorer=scorer, budget=64, **keywords), 64)


@pytest.mark.parametrize(
    "aggregate, pool, kernel",
    [
        ("mean", "max", 7),
        ("max", "avg", 5),
        ("sum", "max", 3),
        ("layer", "avg", 3),
        ("mean", "max", 1),
    ],
)
def test_keys_by_position_are_the_keys_in_position_order(aggregate, pool, kernel):
    policy = policy_of("snapkv", n_sink=2, window=4, aggregate=aggregate, pool=pool, kernel=kernel)
    assert policy.pooled_aggregate
    for seed in range(3):
        state, pos, order, seen = layer(seed)
        key = eviction_keys(policy, state, pos, None, None, order, None, seen)[0]
        np.testing.assert_array_equal(
            keys_by_position(policy, state, pos, order, seen), jnp.take_along_axis(key, order, -1)
        )


def test_only_a_pooled_aggregate_takes_the_position_order():
    pooled = lambda name, **kw: policy_of(name, **kw).pooled_aggregate  # noqa: E731
    assert pooled("snapkv") and pooled("h2o", pool="max", kernel=3)
    assert not pooled("h2o")  # no pooling
    assert not pooled("snapkv+caote") and not pooled("snapkv", chunk=4)
    assert not pooled("expected-attention", pool="max", kernel=3)  # a priority of its own


@pytest.mark.parametrize(
    "scorer, aggregate, groups",
    [
        ("snapkv", "mean", 1),
        ("h2o", "sum", 1),
        ("tova", "layer", 1),
        ("adakv", "mean", 1),
        ("snapkv", "max", 4),  # a maximum of sums is no sum of maxima
        ("snapkv+caote", "mean", 4),  # CAOTE scores each query head's state
    ],
)
def test_the_state_keeps_the_query_heads_aggregate_where_it_may(scorer, aggregate, groups):
    """A sum or mean over the query heads is kept as it accumulates (one value per KV head; the
    reference tests compare the kept sets with the float64 oracle's per-head states); the state of
    one step's column then gives the aggregate's keys, to float32 rounding."""
    p = policy_of(scorer, aggregate=aggregate)
    assert p.state_groups(4) == groups
    state, pos, order, seen = layer(7)
    folded = p.fold(state)
    assert folded.shape[2] == groups
    v = jnp.asarray(np.random.default_rng(8).standard_normal(pos.shape + (16,)), jnp.float32)
    ours = eviction_keys(p, folded, pos, None, v, order, None, seen)[0]
    theirs = eviction_keys(p, state, pos, None, v, order, None, seen)[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
