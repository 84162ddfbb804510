"""``kvjax.kernels.lowest_place`` (a decoding step's one eviction per row and KV head in the dense
cache) and ``lowest_places`` (the few lowest with their counts: the paged cache's):

* the Triton kernel under the Pallas interpreter against the XLA reference, place for place: every
  aggregate it takes, both poolings and none, odd widths, query-head groups of 1, 3 and 4, ragged
  slot counts, empty slots, equal scores (ties go to the earlier position), heads with nothing to
  evict;
* the reference against ``eviction_keys`` (the keys by slot) permuted by position;
* ``lowest_places``: the kernel against the reference field for field (places, keys, counts) at
  1, 3 and 8 picks over the same cases, heads with every slot protected or empty; the reference
  against NumPy's stable argsort of the keys by position;
* SnapKV's decoding loop lowers to the kernel on CUDA and to the reference on TPU;
* bad shapes and an aggregate the kernel does not take name the argument.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from kvjax.kernels import lowest_place, lowest_places
from kvjax.kernels.eviction_place import reference
from test_moment_residuals import decoding_module
from test_priority import layer, policy_of

from kvjax.eviction import eviction_keys

CASES = [
    dict(aggregate="mean", pool="max", kernel=7),  # SnapKV's defaults
    dict(aggregate="max", pool="avg", kernel=5),
    dict(aggregate="sum", pool="max", kernel=3),
    dict(aggregate="mean", pool="none", kernel=1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize(("G", "S", "empty"), [(4, 80, 5), (3, 37, 0), (1, 130, 64)])
def test_gpu_kernel_equals_the_reference(case, G, S, empty):
    for seed in range(2):
        state, pos, order, seen = layer(seed, G=G, S=S, empty=empty)
        options = dict(n_sink=2, window=4, **case)
        want = lowest_place(state, pos, order, seen, impl="xla", **options)
        got = lowest_place(state, pos, order, seen, impl="pallas_gpu", interpret=True, **options)
        np.testing.assert_array_equal(got, want)


def test_heads_with_nothing_to_evict_and_ties():
    """Everything protected (a window over every position): the first place, as argmin's; equal
    keys: the earlier position."""
    state, pos, order, seen = layer(0, S=16, empty=0)
    options = dict(n_sink=0, aggregate="mean", pool="none", kernel=1)
    for window in (16, 0):
        flat = jnp.ones_like(state) if window == 0 else state
        want = lowest_place(flat, pos, order, seen, window=window, impl="xla", **options)
        got = lowest_place(
            flat, pos, order, seen, window=window, impl="pallas_gpu", interpret=True, **options
        )
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(want, 0)


def test_the_reference_is_argmin_of_the_keys_by_position():
    policy = policy_of("snapkv", n_sink=2, window=4)
    state, pos, order, seen = layer(1)
    keys = eviction_keys(policy, state, pos, None, None, order, None, seen)[0]
    place = lowest_place(
        state,
        pos,
        order,
        seen,
        n_sink=2,
        window=4,
        aggregate=policy.aggregate,
        pool=policy.pool,
        kernel=policy.kernel,
        impl="xla",
    )
    np.testing.assert_array_equal(place, jnp.argmin(jnp.take_along_axis(keys, order, -1), -1))
    assert reference.AGGREGATES == ("sum", "mean", "max", "layer")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize(("G", "S", "empty"), [(4, 80, 5), (3, 37, 0), (1, 130, 64)])
def test_gpu_kernel_of_the_few_lowest_equals_the_reference(case, G, S, empty):
    for seed, picks in ((0, 1), (1, 3), (2, 8)):
        state, pos, order, seen = layer(seed, G=G, S=S, empty=empty)
        options = dict(n_sink=2, window=4, picks=picks, **case)
        want = lowest_places(state, pos, order, seen, impl="xla", **options)
        got = lowest_places(state, pos, order, seen, impl="pallas_gpu", interpret=True, **options)
        for field, w, g in zip(want._fields, want, got):
            np.testing.assert_array_equal(g, w, err_msg=field)


def test_the_few_lowest_are_numpys_stable_argsort_of_the_keys():
    """Valid slots by key, then by place; empty ones (key -inf) after them; a head whose slots are
    all protected gives its first places; one with a single valid slot, that slot and then the
    empty ones."""
    options = dict(n_sink=2, window=4, aggregate="mean", pool="max", kernel=3)
    state, pos, order, seen = layer(3, B=3, S=24, empty=6)
    pos = pos.at[2, 1].set(jnp.where(pos[2, 1] == 0, 0, -1))  # one token, at a sink
    order = order.at[2, 1].set(jnp.argsort(pos[2, 1] < 0, stable=True).astype(jnp.int32))
    for picks in (1, 5, 24):
        got = lowest_places(state, pos, order, seen, picks=picks, impl="xla", **options)
        key = np.asarray(
            reference.keys_by_position(
                state,
                pos,
                order,
                seen,
                how="mean",
                **{k: options[k] for k in ("n_sink", "window", "pool", "kernel")},
            )
        )
        rank = np.where(key > -np.inf, key + 0.0, np.inf)
        want = np.argsort(rank, -1, kind="stable")[..., :picks]
        np.testing.assert_array_equal(got.place, want)
        np.testing.assert_array_equal(got.key, np.take_along_axis(key, want, -1))
        np.testing.assert_array_equal(got.count, (key > -np.inf).sum(-1))
        np.testing.assert_array_equal(got.protected, (key == np.inf).sum(-1))
        kernel = lowest_places(
            state, pos, order, seen, picks=picks, impl="pallas_gpu", interpret=True, **options
        )
        for field, w, g in zip(got._fields, got, kernel):
            np.testing.assert_array_equal(g, w, err_msg=field)
    np.testing.assert_array_equal(got.place[2, 1, :3], [0, 1, 2])
    assert int(got.count[2, 1]) == 1 and (got.protected[:2] < got.count[:2]).all()
    everything = options | dict(window=24)  # every valid slot protected: the first places
    for impl in ("xla", "pallas_gpu"):
        low = lowest_places(
            state, pos, order, seen, picks=5, impl=impl, interpret=True, **everything
        )
        np.testing.assert_array_equal(low.place, np.broadcast_to(np.arange(5), low.place.shape))
        np.testing.assert_array_equal(low.protected, low.count)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_snapkv_decoding_lowers_to_the_kernel_on_cuda(platform):
    text = decoding_module("snapkv", platform)
    calls = [line for line in text.splitlines() if "custom_call" in line and "lowest_place" in line]
    assert bool(calls) == (platform == "cuda")
    if platform == "cuda":  # its one call is vmapped over the layers: a grid of (L, B, Hk), over
        # the state of the query heads' mean (one per KV head: ``Policy.state_groups``)
        assert all(re.search(r"tensor<3x1x2x1x65xf32>", line) for line in calls), calls


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_adakv_decoding_lowers_to_the_few_lowest_kernel_on_cuda(platform):
    """AdaKV's paged decoding step takes each head's 2 lowest (its layer's 2 KV heads' new tokens)
    from one kernel call over every layer and row: a grid of (L·B, Hk), the query heads' mean."""
    text = decoding_module("adakv", platform)
    calls = [
        line for line in text.splitlines() if "custom_call" in line and "lowest_places" in line
    ]
    assert bool(calls) == (platform == "cuda")
    if platform == "cuda":
        assert len(calls) == 1 and re.search(r"tensor<3x2x1x\d+xf32>", calls[0]), calls


def test_bad_arguments_name_them():
    state, pos, order, seen = layer(0)
    options = dict(n_sink=2, window=4, aggregate="mean", pool="max", kernel=3)
    with pytest.raises(ValueError, match=r"order must be \(B, Hk, S\)"):
        lowest_place(state, pos, order[..., :5], seen, **options)
    with pytest.raises(ValueError, match=r"seen must be \(B,\)"):
        lowest_place(state, pos, order, seen[:1], **options)
    with pytest.raises(ValueError, match=r"picks=0 must be in \[1, S=80\]"):
        lowest_places(state, pos, order, seen, picks=0, **options)
    with pytest.raises(ValueError, match="aggregate='layer': the GPU kernel takes"):
        lowest_place(
            state, pos, order, seen, **(options | dict(aggregate="layer")), impl="pallas_gpu"
        )
