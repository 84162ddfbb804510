"""What kvjax hands XLA:GPU, checked from the CPU (the card's own compiles are read by
benchmarks/gpu/aot.py, benchmarks/gpu/NOTES.md): the budget caches' per-layer write scatters into
the stacked keys and values on CUDA and reads the layer from the result, and a layer's new keys and
values are whole before its cache write."""

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import slots
from kvjax.cache.full import FullCache
from kvjax.model.decoder import decode_hidden
from kvjax.model.segment import Segment


def layer_slots_case():
    """x [L, B, Hk, S, K], layer 1, two distinct slots per (row, KV head), their values."""
    L, B, Hk, S, K = 3, 2, 2, 7, 4
    x = jax.random.normal(jax.random.key(0), (L, B, Hk, S, K))
    index = jnp.array([[[6, 1], [0, 3]], [[2, 5], [4, 0]]], jnp.int32)
    values = jax.random.normal(jax.random.key(1), (B, Hk, 2, K))
    return x, jnp.int32(1), index, values


def test_both_ways_of_writing_a_layers_slots_equal_numpy():
    x, layer, index, values = layer_slots_case()
    expected = np.array(x)
    for b, h, i in np.ndindex(*index.shape):
        expected[int(layer), b, h, int(index[b, h, i])] = values[b, h, i]
    for write in (slots.scatter_layer_slots, slots.write_back_layer_slots, slots.set_layer_slots):
        stacked, part = write(x, layer, index, values)
        np.testing.assert_array_equal(np.asarray(stacked), expected)
        np.testing.assert_array_equal(np.asarray(part), expected[int(layer)])


def test_on_cuda_the_stacked_array_is_scattered_into_not_written_back():
    """Lowered for CUDA from this CPU: a scatter and no dynamic_update_slice producing the stacked
    array (which made XLA:GPU copy each layer out and back); lowered for CPU, the write-back."""
    traced = jax.jit(lambda *a: slots.set_layer_slots(*a)[0]).trace(*layer_slots_case())
    stacked = "-> tensor<3x2x2x7x4xf32>"

    def writes_back(text):
        return any("dynamic_update_slice" in line and stacked in line for line in text.splitlines())

    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.scatter" in cuda and not writes_back(cuda)
    assert writes_back(traced.lower(lowering_platforms=("cpu",)).as_text())


def test_on_cuda_the_layer_is_read_from_the_scattered_stack():
    """One scatter on CUDA gives both results: the layer is a slice of the written stack (a second
    scatter into the slice as it was made XLA:GPU copy each layer's keys and values for MomentKV's
    in-layer eviction)."""
    assert (
        jax.jit(slots.scatter_layer_slots)
        .lower(*layer_slots_case())
        .as_text()
        .count('"stablehlo.scatter"')
        == 1
    )


def test_new_keys_and_values_pass_an_optimization_barrier_before_the_cache():
    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=32,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        d_ff=32,
        max_seq_len=64,
        norm_eps=1e-5,
        eos_token_ids=(1,),
        pad_token_id=0,
    )
    params = kvjax.init_params(cfg, jax.random.key(0))
    seg = Segment(positions=jnp.zeros((1, 1), jnp.int32))
    step = lambda p, c: decode_hidden(p, jnp.zeros((1, 1), jnp.int32), c, seg)  # noqa: E731
    text = str(jax.make_jaxpr(step)(params, FullCache.init(cfg, 1, 8, jnp.float32)))
    assert "optimization_barrier" in text
