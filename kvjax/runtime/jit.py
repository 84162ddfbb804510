"""``jit``: ``jax.jit`` whose compiled programs take kvjax's XLA options for their backend.

On CUDA GPUs, no Triton GEMM fusions (``xla_gpu_enable_triton_gemm=False``): XLA:GPU then
multiplies with cuBLAS, and its dynamic-slice fusion lets cuBLAS read a layer's weights in place
inside the stacked arrays that the layer scan slices, where a Triton GEMM fusion is handed a copy
of the slice (every weight read, written and read again per decoding step). Read from XLA:GPU's
compile of the 8B decoding step for an H200, made on a CPU without a device
(``benchmarks/gpu/aot.py``): the copy's buffer is one layer's weights with Triton GEMM fusions,
and absent without them (the figures: docs/performance.md, "Figures that used to live in code
comments").

Also on CUDA, no rematerialization pass (``xla_disable_hlo_passes``): XLA:GPU's memory limit for a
program is 80% of the device's memory less its arguments, so a decoding step whose cache fills the
card (the largest batch the memory holds) gets a limit of zero, and the pass then recomputes
products, reading their weights again, to save almost nothing (the 8B with SnapKV 1024 at 793 rows
and 32K: three more cuBLAS products per layer, 12.6 GB more read a step, for 0.2 GB less peak
memory: docs/performance.md).
"""

from __future__ import annotations

import functools

import jax

OPTIONS: dict[str, dict] = {
    "gpu": {"xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "rematerialization"}
}


class Jitted:
    """One function jitted once per backend (``jax.default_backend()`` when called), with that
    backend's ``OPTIONS``; calls, ``lower`` and the other attributes of a jitted function go to the
    current backend's. Called on tracers (inside another ``jit``, ``eval_shape``, a scan), where JAX
    refuses compiler options, it is the plain ``jax.jit``: the outer program's options apply."""

    def __init__(self, fun, kwargs: dict):
        self._fun, self._kwargs, self._by_backend = fun, kwargs, {}
        functools.update_wrapper(self, fun)

    def _jitted(self, nested: bool = False):
        backend = None if nested else jax.default_backend()
        if backend not in self._by_backend:
            self._by_backend[backend] = jax.jit(
                self._fun, compiler_options=OPTIONS.get(backend), **self._kwargs
            )
        return self._by_backend[backend]

    def __call__(self, *args, **kwargs):
        nested = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
        return self._jitted(nested)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted().lower(*args, **kwargs)

    def __getattr__(self, name: str):  # trace, eval_shape, ...: the current backend's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._jitted(), name)


def jit(fun=None, **kwargs):
    """``jax.jit(fun, **kwargs)`` with the current backend's ``OPTIONS``; as a decorator with or
    without keywords."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    return Jitted(fun, kwargs)
