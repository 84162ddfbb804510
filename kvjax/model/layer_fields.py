"""How each layer sees a cache: keys and values updated in place, the rest one layer at a time.

A cache's leaves carry a leading layer axis L. Its keys and values are read by the attention at a
layer index and written in place, so the layer loop carries them. The small per-layer fields that a
cache names in ``LAYER_FIELDS`` (slot positions, scorer state, slot order, moments) are scanned over
instead: ``cache.attend(layer, ...)`` gets and returns that layer's slice of them ([B, ...]), and
the loop stacks the results. Updated in place, a field that a layer reads without its write-back
depending on the read made XLA:CPU copy the whole stacked array in every layer
(docs/performance.md); XLA:GPU does the opposite (the stacked outputs are second buffers,
zero-filled every step), so on CUDA the scan carries them and writes each layer's slice in place
(``kvjax.model.decoder.FIELDS_CARRIED_ON``). A base scorer's statistics, which are sums, are
carried like the keys and values: each layer adds to its own with a scatter-add (``Base.observe``).
Read back, added to and written as a field, Expected Attention's [B, Hk, G, K, K] sums were copied
out of the stack in every layer on CUDA (4.4 GB per decoding step at the 8B's batch 64).

The carried form hands MomentKV's moments to each layer whole (``WHOLE_WHEN_CARRIED``): the decode
kernel reads the layer's [K, K] sums in place and the eviction adds to them with a scatter-add
(``Moments.at``, ``Moments.add``). Sliced out, they were a copy handed to the kernel every layer
(1.2 GB copied per step at the 8B's batch 64); carried whole on the CPU, they were copied twice a
layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_layers(cache, seg=None) -> tuple[object, dict]:
    """(``cache`` with its ``LAYER_FIELDS`` set to None, those fields by name); with the layer's
    ``seg``, only those its attention reads or writes there (``layer_fields``): the others stay
    stacked in the cache, which the layer loop carries untouched."""
    names = getattr(cache, "LAYER_FIELDS", ())
    if seg is not None and hasattr(cache, "layer_fields"):
        names = cache.layer_fields(seg)
    if not names:
        return cache, {}
    return cache.replace(**dict.fromkeys(names)), {name: getattr(cache, name) for name in names}


def join_layers(rest, fields: dict):
    """``split_layers`` undone: ``rest`` with ``fields`` put back (stacked or one layer's)."""
    return rest.replace(**fields) if fields else rest


def at_layer(tree, layer: jax.Array):
    """Layer ``layer`` of each stacked leaf of ``tree``: dynamic slices at an unsigned index (a
    scatter's bounds check, ``.at[].set``, and a signed index's wrapping made XLA:GPU copy slices
    out of the stack: the H200 compile of AdaKV 1024 at batch 64, 3,505 -> 1,754 MB copied per
    step)."""
    i = jnp.asarray(layer).astype(jnp.uint32)
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), tree)


def put_layer(stacked, tree, layer: jax.Array):
    """``stacked`` with layer ``layer`` of each leaf replaced by ``tree``'s (in place under jit)."""
    i = jnp.asarray(layer).astype(jnp.uint32)
    return jax.tree.map(lambda a, h: jax.lax.dynamic_update_index_in_dim(a, h, i, 0), stacked, tree)


WHOLE_WHEN_CARRIED = ("moments",)  # the fields the carried form hands to a layer whole


def carried_view(fields: tuple, layer: jax.Array) -> tuple:
    """Each group's fields (dicts by name) as the carried form hands them to layer ``layer``:
    its slice, or the whole field for those in ``WHOLE_WHEN_CARRIED``."""
    return tuple(
        {n: x if n in WHOLE_WHEN_CARRIED else at_layer(x, layer) for n, x in f.items()}
        for f in fields
    )


def carried_back(fields: tuple, here: tuple, layer: jax.Array) -> tuple:
    """``fields`` with what layer ``layer`` returned (``carried_view``'s form) written back."""
    return tuple(
        {n: h[n] if n in WHOLE_WHEN_CARRIED else put_layer(x, h[n], layer) for n, x in f.items()}
        for f, h in zip(fields, here, strict=True)
    )


def attend_stacked(cache, layer: jax.Array, q, k, v, seg):
    """``cache.attend`` for a cache that holds every layer's ``LAYER_FIELDS`` (a wrapper's inner
    cache, a test's): their layer ``layer`` is sliced out, attended and written back."""
    rest, fields = split_layers(cache)
    out, cache = join_layers(rest, jax.tree.map(lambda x: x[layer], fields)).attend(
        layer, q, k, v, seg
    )
    rest, here = split_layers(cache)
    return out, join_layers(rest, jax.tree.map(lambda full, x: full.at[layer].set(x), fields, here))
