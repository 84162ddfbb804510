"""Decoding that evicts at every step under a scorer that zeroes its state at every eviction point
(SnapKV, TOVA, and SnapKV under MomentKV or AdaKV) computes each step's state from its own column
and leaves it at its eviction point (``Segment.fresh_state``; ``decode_steps`` zeroes it once at
its end). It must decode exactly as the stored state's update and reset do: the same tokens,
slots, positions, order and moments, and a zero state after."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.runtime.decoding import decode_step, decode_steps, feed_budget
from kvjax.runtime.options import eviction_from
from kvjax.runtime.sampling import Sampling

STEPS = 6

CASES = {
    "snapkv": dict(scorer="snapkv"),
    "tova": dict(scorer="tova"),
    "snapkv, prefill protocol": dict(scorer="snapkv", protocol="prefill"),
    "snapkv, evict-first": dict(scorer="snapkv", decode_order="evict-first"),
    "momentkv (in-layer)": dict(scorer="momentkv"),
    "adakv (paged)": dict(scorer="adakv", page_size=4),
    "tova, int8": dict(scorer="tova", kv_dtype="int8"),
}


def prompt_state(params, options: dict):
    """(the decode state after a 2-row prompt of 40 and 29 tokens at budget 12, its eviction)."""
    ev = eviction_from(context=64, budget=12, block_size=8, obs_window=4, **options)
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 4, 97)
    lengths = jnp.array([40, 29])
    args = (params, None, tokens, jnp.zeros(2, jnp.int32), lengths, jax.random.key(0), ev)
    return feed_budget(*args, 16, ev.decode_spare(16)), ev


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_decoding_from_fresh_states_equals_the_stored_state_update(tiny_llama, options):
    state, ev = prompt_state(tiny_llama, options)
    ev = ev.decoding()
    assert ev.fresh_state
    assert not np.asarray(state.cache.state).any()  # every prompt ends with an eviction point

    fresh = decode_steps(
        tiny_llama,
        jax.tree.map(jnp.copy, state),
        jnp.int32(16),
        jnp.int32(STEPS),
        Sampling(),
        (),
        ev,
    )
    stored = jax.jit(lambda s: decode_step(tiny_llama, s, Sampling(), (), 16, ev)[0])
    for _ in range(STEPS):
        state = stored(state)
        assert not np.asarray(state.cache.state).any()  # reset at every eviction point

    assert not np.asarray(fresh.cache.state).any()
    for name, a, b in zip(
        ("cache", "logits", "lengths"),
        (fresh.cache, fresh.logits, fresh.lengths),
        (state.cache, state.logits, state.lengths),
        strict=True,
    ):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_fresh_steps_leave_their_columns_until_the_loop_ends(tiny_llama):
    """Inside the loop a fresh step's eviction point leaves the state it scored with (the next step
    overwrites it): the only write it needs."""
    state, ev = prompt_state(tiny_llama, CASES["snapkv"])
    ev = ev.decoding()
    fresh = jax.jit(lambda s: decode_step(tiny_llama, s, Sampling(), (), 16, ev, True)[0])
    after = fresh(state)
    assert np.asarray(after.cache.state).any()


def test_only_every_step_eviction_under_resetting_scorers_is_fresh():
    def fresh(**options):
        return eviction_from(context=64, budget=12, obs_window=4, **options).decoding().fresh_state

    assert fresh(scorer="snapkv") and fresh(scorer="tova")
    assert not fresh(scorer="h2o")  # accumulates its state over the steps
    assert not fresh(scorer="snapkv", evict_every=4)  # the state accumulates between points
    assert not fresh(scorer="snapkv", decode_evict=False)
