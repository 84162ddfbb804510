"""``kvjax.slots.scatter_set``: a narrow float array scattered as its bits is the same array as
``.at[].set`` gives, and XLA:CPU then converts none of it to float32 (it did for every scatter of a
bfloat16 array: a cache's scales, converted whole twice in every layer of every step); the caches'
writes of keys and values are scatters of unique updates."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moment_residuals import decoding_module

from kvjax.slots import inverse_permutation, scatter_at_layer, scatter_set, set_slots


def bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind != "i" else x


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "float32", "int8"])
def test_scatter_set_is_the_same_array(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 6, 5)) * 3, jnp.float32).astype(dtype)
    # float32 values, cast to a float dtype by the set
    values = jnp.asarray(rng.normal(size=(4, 3, 5)) * 5, jnp.float32)
    values = values.astype(dtype) if dtype == "int8" else values
    index = jnp.array([[0, 2, 5], [1, 3, 4], [5, 0, 1], [2, 4, 3]])
    at = (jnp.arange(4)[:, None], index)
    np.testing.assert_array_equal(
        bits(scatter_set(x, at, values)), bits(x.at[at].set(values.astype(dtype)))
    )
    # a scalar, and an index out of range dropped
    far, fill = index.at[0, 0].set(9), 3 if dtype == "int8" else 1.5
    np.testing.assert_array_equal(
        bits(scatter_set(x, (jnp.arange(4)[:, None], far), fill, mode="drop")),
        bits(x.at[jnp.arange(4)[:, None], far].set(fill, mode="drop")),
    )
    # the vmapped form over rows and heads
    y = x.reshape(2, 2, 6, 5)
    np.testing.assert_array_equal(
        bits(set_slots(y, index.reshape(2, 2, 3), values.reshape(2, 2, 3, 5))),
        bits(
            y.at[
                jnp.arange(2)[:, None, None], jnp.arange(2)[None, :, None], index.reshape(2, 2, 3)
            ].set(values.reshape(2, 2, 3, 5).astype(dtype))
        ),
    )


def test_xla_cpu_converts_no_bfloat16_array_around_the_scatter():
    """A cache's bfloat16 scales [L, B, Hk, S, 1] written at one layer's slots: no float32 array of
    their shape in the compiled program."""
    scales = jax.ShapeDtypeStruct((30, 8, 3, 2304, 1), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((8, 3, 1, 1), jnp.bfloat16)
    index = jax.ShapeDtypeStruct((8, 1, 1), jnp.int32)
    text = (
        jax.jit(scatter_at_layer)
        .lower(scales, jax.ShapeDtypeStruct((), jnp.int32), index, new)
        .compile()
        .as_text()
    )
    assert not re.search(r"f32\[30,8,3,2304,1\]", text), text


@pytest.mark.parametrize("scorer", ["snapkv", "adakv+snapkv"])
def test_cache_writes_say_their_updates_are_unique(scorer):
    """Every scatter into the keys and values of a decoding loop (the dense cache's stack; the paged
    pools: new tokens and the compaction's moves) says that its updates are unique: XLA:GPU
    otherwise writes each element with an atomic read-modify-write (for bfloat16 a compare-and-swap
    loop)."""
    text = decoding_module(scorer, "cuda")
    ops = re.findall(r'"stablehlo\.scatter"\((.*?)\}\) : \(tensor<([\dx]+)x(\w+)>', text, re.S)
    kv = [body for body, shape, dtype in ops if shape.endswith("x64") and dtype in ("bf16", "ui16")]
    assert len(kv) == (2 if scorer == "snapkv" else 4), len(kv)
    assert all("unique_indices = true" in body for body in kv)


def test_permutations_are_inverted_by_unique_scatters():
    """The inverse of a permutation scatters distinct indices, and says so: SnapKV+CAOTE's pooling
    (of each query head's scores) ranks the slots of every (layer, row, KV head) by position at
    each decoding step, an int32 [L, B, Hk, S] scatter that XLA:GPU would otherwise write with
    atomics. Plain SnapKV pools in position order and inverts nothing."""

    def rank_scatters(scorer):
        text = decoding_module(scorer, "cuda")
        ops = re.findall(r'"stablehlo\.scatter"\((.*?)\}\) : \(tensor<([\dx]+)x(\w+)>', text, re.S)
        return [body for body, shape, dtype in ops if (shape, dtype) == ("3x1x2x65", "i32")]

    ranks = rank_scatters("snapkv+caote")
    assert ranks and all("unique_indices = true" in body for body in ranks)
    assert not rank_scatters("snapkv")
    index = jax.random.permutation(jax.random.key(0), 9)
    perms = jnp.stack([index, index[::-1]])
    np.testing.assert_array_equal(inverse_permutation(perms), jnp.argsort(perms, axis=-1))
