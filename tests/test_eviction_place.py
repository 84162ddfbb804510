"""``kvjax.kernels.lowest_place`` (a decoding step's one eviction per row and KV head in the dense
cache):

* the Triton kernel under the Pallas interpreter against the XLA reference, place for place: every
  aggregate it takes, both poolings and none, odd widths, query-head groups of 1, 3 and 4, ragged
  slot counts, empty slots, equal scores (ties go to the earlier position), heads with nothing to
  evict;
* the reference against ``eviction_keys`` (the keys by slot) permuted by position;
* SnapKV's decoding loop lowers to the kernel on CUDA and to the reference on TPU;
* bad shapes and an aggregate the kernel does not take name the argument.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from kvjax.kernels import lowest_place
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


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_snapkv_decoding_lowers_to_the_kernel_on_cuda(platform):
    text = decoding_module("snapkv", platform)
    calls = [line for line in text.splitlines() if "custom_call" in line and "lowest_place" in line]
    assert bool(calls) == (platform == "cuda")
    if platform == "cuda":  # its one call is vmapped over the layers: a grid of (L, B, Hk), over
        # the state of the query heads' mean (one per KV head: ``Policy.state_groups``)
        assert all(re.search(r"tensor<3x1x2x1x65xf32>", line) for line in calls), calls


def test_bad_arguments_name_them():
    state, pos, order, seen = layer(0)
    options = dict(n_sink=2, window=4, aggregate="mean", pool="max", kernel=3)
    with pytest.raises(ValueError, match=r"order must be \(B, Hk, S\)"):
        lowest_place(state, pos, order[..., :5], seen, **options)
    with pytest.raises(ValueError, match=r"seen must be \(B,\)"):
        lowest_place(state, pos, order, seen[:1], **options)
    with pytest.raises(ValueError, match="aggregate='layer': the GPU kernel takes"):
        lowest_place(
            state, pos, order, seen, **(options | dict(aggregate="layer")), impl="pallas_gpu"
        )
