"""Updates along the slot axis of per-(row, KV head) arrays.

Written as a scatter vmapped over the row and KV-head axes, so that those stay batch dimensions of
the scatter: when they are split over a device mesh, every device updates its own rows and heads
with no communication (a scatter indexed by broadcast row and head numbers would gather its updates
first).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def scatter_set(
    x: jax.Array, at, values, mode: str | None = None, unique: bool = False
) -> jax.Array:
    """``x.at[at].set(values, mode=mode, unique_indices=unique)``, a float narrower than 32 bits
    (bfloat16, float16, float8) scattered as its bits, which is the same array: XLA:CPU otherwise
    converts the whole of ``x`` to float32 and back around every such scatter (a cache's scales:
    129 of a 212 ms decoding step of SmolLM2 at batch 8).

    unique: the caller guarantees that no two updates share coordinates. XLA:GPU then stores each
    element; otherwise it writes every element with an atomic read-modify-write, which for 16- and
    8-bit elements is a compare-and-swap loop on the word around them."""
    dtype = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return x.at[at].set(values, mode=mode, unique_indices=unique)
    bits = jnp.dtype(f"uint{8 * dtype.itemsize}")
    as_bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=bits)
    new = as_bits(jnp.asarray(values, dtype))
    out = as_bits(x).at[at].set(new, mode=mode, unique_indices=unique)
    return jax.lax.bitcast_convert_type(out, dtype)


def _per_row_head(update, lead: int = 2):
    for _ in range(lead):
        update = jax.vmap(update)
    return update


def set_slots(
    x: jax.Array,
    index: jax.Array,
    values,
    lead: int = 2,
    mode: str | None = None,
    unique: bool = False,
) -> jax.Array:
    """x [B, Hk, S, ...] with ``x[b, h, index[b, h, i]] = values[b, h, i]``.

    Args:
        values: may be a scalar.
        lead: how many leading axes are per-row-and-head, e.g. 3 for [L, B, Hk, S].
        mode: "drop" skips out-of-range indices.
        unique: no two indices of a (row, KV head) are equal (``scatter_set``).
    """
    if not hasattr(values, "shape") or values.ndim == 0:
        return _per_row_head(lambda xi, ii: scatter_set(xi, ii, values, mode, unique), lead)(
            x, index
        )
    return _per_row_head(lambda xi, ii, vi: scatter_set(xi, ii, vi, mode, unique), lead)(
        x, index, values
    )


def per_row(fn, *arrays, axes):
    """``fn`` applied to each batch row: ``arrays`` have their row axis at ``axes`` (one per array),
    the result has it first. A vmap, so that a row axis split over devices needs no
    communication."""
    return jax.vmap(fn, in_axes=axes)(*arrays)


def max_slots(x: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """x [B, Hk, S] with ``x[b, h, index[b, h, i]] = max(x[...], values[b, h, i])``."""
    return _per_row_head(lambda xi, ii, vi: xi.at[ii].max(vi))(x, index, values)


def set_layer_slots(
    x: jax.Array, layer: jax.Array, index: jax.Array, values: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(x [L, B, Hk, S, ...] with ``x[layer, b, h, index[b, h, i]] = values[b, h, i]``, its layer
    ``layer`` [B, Hk, S, ...] so updated).

    Where the layer is not read (a decoding step evicting after the step), XLA drops it. The
    stacked array is written in place, on each platform as its compiler does it without copies:
    - CUDA: one scatter whose coordinates are the layer, the row, the KV head and the slot
      (``scatter_at_layer``, as ``FullCache.write``); the layer is its slice of the result, which
      XLA:GPU reads in place. Writing the updated slice back (below) made XLA:GPU copy each layer's
      keys and values out of the stack and back in every step, and scattering into the slice of
      ``x`` made it copy the slice for an in-layer eviction (docs/performance.md, "Figures that
      used to live in code comments").
    - elsewhere: the slice updated by a scatter whose batch dimensions are the row and KV-head axes
      (leading there), and written back (``dynamic_update_slice``). On CPU the scatter above holds
      more temporaries (``benchmarks/decode_temporaries.py``); a scatter batched over the stacked
      array's middle axes made XLA:CPU transpose and copy all of it for every layer, and reading
      the layer from the stacked result can make XLA:CPU keep a copy of the whole stacked array
      for every layer."""
    return jax.lax.platform_dependent(
        x, layer, index, values, cuda=scatter_layer_slots, default=write_back_layer_slots
    )


def scatter_at_layer(x, layer, index, values) -> jax.Array:
    """x [L, B, Hk, S, ...] with ``x[layer, b, h, index[b, h, i]] = values[b, h, i]`` by one
    scatter at (layer, row, KV head, slot), which XLA does in place; index [B, Hk or 1, T]
    broadcasts over the KV heads of values [B, Hk, T, ...] and names distinct slots of each (row,
    KV head) (each token its own: a position, or a free slot), so the updates are unique."""
    B, Hk = values.shape[:2]
    at = (layer, jnp.arange(B)[:, None, None], jnp.arange(Hk)[None, :, None], index)
    return scatter_set(x, at, values, unique=True)


def scatter_layer_slots(x, layer, index, values) -> tuple[jax.Array, jax.Array]:
    """``set_layer_slots`` on CUDA: the stacked array by ``scatter_at_layer``; the layer, its
    slice of the result."""
    stacked = scatter_at_layer(x, layer, index, values)
    return stacked, stacked[layer]


def write_back_layer_slots(x, layer, index, values) -> tuple[jax.Array, jax.Array]:
    """``set_layer_slots`` elsewhere: the layer's slice updated, and written back."""
    part = set_slots(x[layer], index, values)
    return jax.lax.dynamic_update_index_in_dim(x, part, layer, 0), part


def inverse_permutation(permutation: jax.Array) -> jax.Array:
    """[..., N] the inverse of each permutation along the last axis (``jnp.argsort(permutation)``,
    by a scatter instead of a second sort)."""
    index = jnp.broadcast_to(jnp.arange(permutation.shape[-1]), permutation.shape)
    return set_slots(
        jnp.zeros_like(index), permutation, index, lead=permutation.ndim - 1, unique=True
    )


# ``true_first`` cuts of at most this many entries are one ``jax.lax.top_k`` pass (XLA:GPU runs
# top-k of up to 16 in a kernel of its own, larger ones as a sort)
FEW_FIRST = 16


def true_first(mask: jax.Array, k: int | None = None) -> jax.Array:
    """[..., k] indices of mask [..., N]'s True entries ascending, then of its False ones ascending:
    the first ``k`` (default N) of ``jnp.argsort(~mask, stable=True)``, by a cumulative sum and a
    scatter instead of a sort; up to ``FEW_FIRST`` of them out of more (a decoding step's dropped
    slots) by one ``jax.lax.top_k`` over N − index where True and 0 where False (its ties go to the
    lower index), which writes no [..., N] index array for a scatter (all N of them would be a
    sort)."""
    N = mask.shape[-1]
    k = N if k is None else k
    if k <= FEW_FIRST and k < N:
        index = jnp.arange(N, dtype=jnp.float32)  # exact below 2**24
        first = jax.lax.top_k(jnp.where(mask, N - index, 0.0), k)[1]
        # fused into its users, the cut made XLA:CPU sort whole rows (docs/performance.md)
        return jax.lax.optimization_barrier(first.astype(jnp.int32))
    index = jnp.broadcast_to(jnp.arange(N), mask.shape)
    trues = jnp.cumsum(mask, -1, dtype=jnp.int32)  # inclusive: i − trues Falses before a False i
    rank = jnp.where(mask, trues - 1, trues[..., -1:] + index - trues)
    out = jnp.zeros(mask.shape[:-1] + (k,), jnp.int32)
    return set_slots(out, rank, index, lead=mask.ndim - 1, mode="drop", unique=True)
