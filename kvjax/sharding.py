"""Sharding over a device mesh: one table from logical axes to mesh axes, for params, caches and
decode state.

Every array declares its logical axes once: the parameters in ``kvjax.model.params.param_specs``,
every cache and the decode state in their class's ``AXES`` (field -> axes). ``RULES`` maps logical
axes to the mesh axes ``data`` and ``model``; a dimension that its mesh axis does not divide stays
replicated — so a model with fewer KV heads than the model axis (SmolLM2 has 3) keeps its KV heads
whole on every device, as large serving stacks replicate them, while its MLP and vocabulary are
still split. Eviction decides per (layer, row, KV head), so with KV heads split over ``model`` it
needs no communication; decisions that cross heads cost one collective each (``docs/sharding.md``).

Under ``jax.set_mesh(mesh)``, the jitted functions place what they create with ``constrain``; with
no mesh set it is a no-op, so single-device code is unchanged. A mesh a user passes in may have axes
of any type: the entry points (``kvjax.generate``, ``prefill``, ``prefill_full``, the serving
``Engine``, ``shard``) run on its devices with Auto axes (``auto_mesh``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.model.params import Params, param_specs, params_from_flat

DATA, MODEL = "data", "model"
RULES = {"batch": DATA, "heads": MODEL, "kv_heads": MODEL, "ffw": MODEL, "vocab": MODEL}


def make_mesh(axes: str | dict[str, int], devices=None) -> Mesh:
    """A mesh with axes ``data`` and ``model`` from ``"data=2,model=4"`` (or a dict; a missing axis
    has size 1) over the first data × model devices (``devices``: default all of them), both axes of
    type Auto."""
    if isinstance(axes, str):
        try:
            axes = {
                name.strip(): int(size)
                for name, size in (part.split("=") for part in axes.split(",") if part)
            }
        except ValueError as e:
            raise ValueError(f"mesh={axes!r} must look like 'data=2,model=4'") from e
    if unknown := set(axes) - {DATA, MODEL}:
        raise ValueError(
            f"mesh axes {sorted(unknown)} are unknown; kvjax's mesh axes are {DATA!r} and {MODEL!r}"
        )
    shape = (axes.get(DATA, 1), axes.get(MODEL, 1))
    devices = list(jax.devices() if devices is None else devices)
    if min(shape) < 1 or shape[0] * shape[1] > len(devices):
        raise ValueError(
            f"mesh {DATA}={shape[0]}, {MODEL}={shape[1]} needs {shape[0] * shape[1]} devices; "
            f"{len(devices)} are available"
        )
    return jax.make_mesh(
        shape,
        (DATA, MODEL),
        axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices[: shape[0] * shape[1]],
    )


def auto_mesh(mesh: Mesh | None) -> Mesh | None:
    """A user's mesh as kvjax runs on it: any ``jax.sharding.Mesh`` whose axes are named ``data``
    and/or ``model``, whatever its axis types. kvjax places every array itself (``constrain``),
    which needs axes of type Auto, so a mesh with Explicit (``jax.make_mesh``'s default) or Manual
    axes is the same devices and names with Auto axes. None stays None."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (kvjax.make_mesh('data=2,model=4') or "
            f"jax.make_mesh((2, 4), ('data', 'model'))), got {type(mesh).__name__}"
        )
    if unknown := set(mesh.axis_names) - {DATA, MODEL}:
        raise ValueError(
            f"mesh axes {sorted(unknown)} are unknown: kvjax's mesh axes are {DATA!r} "
            f"(splits the batch) and {MODEL!r} (splits heads, MLP and vocabulary); name the axes "
            f"so, e.g. jax.make_mesh((2, 4), ('data', 'model'))"
        )
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def partition(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh) -> P:
    """The PartitionSpec of an array with logical ``axes`` and ``shape`` on ``mesh`` (``RULES``; a
    dimension its mesh axis does not divide is replicated)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    names = []
    for axis, dim in zip(axes, shape, strict=True):
        target = RULES.get(axis)
        names.append(target if sizes.get(target, 1) > 1 and dim % sizes[target] == 0 else None)
    return P(*names)


def specs(tree, mesh):
    """PartitionSpecs for a struct dataclass with ``AXES`` (caches, decode state; nested ones
    included) or for ``Params``; leaves that are None stay None."""
    if isinstance(tree, Params):
        flat = {
            path: partition(spec.axes, spec.shape, mesh)
            for path, spec in param_specs(tree.config).items()
        }
        stacked = params_from_flat(tree.config, flat)
        if not isinstance(tree.layers, tuple):
            return stacked
        one = jax.tree.map(lambda p: P(*p[1:]), stacked.layers, is_leaf=lambda x: isinstance(x, P))
        return stacked.replace(layers=(one,) * len(tree.layers))
    fields = {}
    for f in dataclasses.fields(tree):
        value = getattr(tree, f.name)
        if f.metadata.get("pytree_node", True) is False or value is None:
            continue
        axes = type(tree).AXES.get(f.name)
        fields[f.name] = (
            specs(value, mesh)
            if hasattr(type(value), "AXES")
            # an array, or arrays with the field's leading axes (quantized keys and their scales)
            else jax.tree.map(lambda x, a=axes: partition(a, np.shape(x), mesh), value)
        )
    return tree.replace(**fields)


def shard(params: Params, mesh: Mesh) -> Params:
    """The parameters placed on ``mesh`` (any axis types, ``auto_mesh``) as their logical axes say
    (``kvjax.shard``); already placed so, they are returned as they are."""
    mesh = auto_mesh(mesh)
    placement = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs(params, mesh), is_leaf=lambda x: isinstance(x, P)
    )
    if all(
        getattr(x, "sharding", None) == s
        for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(placement), strict=True)
    ):
        return params
    return jax.device_put(params, placement)


def on_mesh(mesh: Mesh | None):
    """``jax.set_mesh(mesh)`` as a context manager, or nothing for ``mesh=None``."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def check_batch(rows: int, mesh: Mesh | None) -> None:
    """A batch must split evenly over the mesh's ``data`` axis."""
    if rows % data_size(mesh):
        raise ValueError(
            f"tokens: a batch of {rows} rows on a mesh with {DATA}={data_size(mesh)}: give a "
            f"multiple of {data_size(mesh)} rows (kvjax.generate pads its batch itself)"
        )


def constrain(tree):
    """``tree`` (a cache or decode state) placed as its ``AXES`` say on the mesh set by
    ``jax.set_mesh``; unchanged when no mesh is set. For use inside ``jit``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    return jax.lax.with_sharding_constraint(tree, specs(tree, mesh))


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated array's value on the host, also in a multi-process run (where only the local
    copy can be read)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError(
            f"an array split over processes ({x.sharding}) cannot be read whole on one host"
        )
    return np.asarray(x.addressable_data(0))


def data_size(mesh: Mesh | None) -> int:
    """How many ways the batch is split on ``mesh`` (1 without one)."""
    return (
        1 if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get(DATA, 1)
    )


def per_shard(fn, args: tuple, axes: tuple, out_axes: tuple, batch: int, kv_heads: int):
    """``fn(*args)`` run on each device's shard under ``jax.shard_map`` when a mesh is set
    (else called as is): for attention kernels, whose work is independent per (row, KV head) and
    which XLA cannot partition itself (a Pallas call is opaque to it).

    Args:
        axes / out_axes: per argument / output, the logical axes of its leading dimensions
            ("batch", "heads", "kv_heads" or None; a pytree argument's leaves all start so; None
            arguments and outputs stay None).
        batch, kv_heads: rows split over ``data`` and heads over ``model`` only when ``batch`` and
            ``kv_heads`` divide evenly (query heads follow their KV heads), else those dimensions
            are whole on every device.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(*args)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    split = {"batch": DATA if batch % sizes.get(DATA, 1) == 0 and sizes.get(DATA, 1) > 1 else None}
    split["heads"] = split["kv_heads"] = (
        MODEL if kv_heads % sizes.get(MODEL, 1) == 0 and sizes.get(MODEL, 1) > 1 else None
    )
    spec = lambda names: P(*(split.get(n) for n in names))  # noqa: E731
    return jax.shard_map(
        fn, in_specs=tuple(map(spec, axes)), out_specs=tuple(map(spec, out_axes)), check_vma=False
    )(*args)
