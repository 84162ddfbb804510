"""kvjax.runtime.jit: every jitted program of kvjax compiles with its backend's XLA options (on a
GPU: no Triton GEMM fusions, which copy each layer's weights out of the stacked arrays;
benchmarks/gpu/aot.py)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from kvjax.runtime import jit as jit_module

ROOT = Path(__file__).resolve().parent.parent


def test_each_backend_compiles_with_its_own_options(monkeypatch):
    """An option only the "gpu" entry names is passed to XLA when the default backend is a GPU, not
    on CPU (the option is one XLA rejects, so that reaching the compiler shows)."""
    monkeypatch.setitem(jit_module.OPTIONS, "gpu", {"xla_no_such_option": True})
    double = jit_module.jit(lambda x: 2 * x)
    assert double(jnp.ones(2)).tolist() == [2.0, 2.0]
    assert double.__name__ == "<lambda>" and double.lower(jnp.ones(2)).compile() is not None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(Exception, match="xla_no_such_option"):
        double(jnp.ones(3))


def test_called_inside_another_trace_it_is_the_plain_jit(monkeypatch):
    """JAX refuses compiler options on a jit staged into another trace (``eval_shape``, an outer
    ``jit``, a scan's body): there the function is the plain ``jax.jit`` and the outer program's
    options apply (the GPU run of 2026-11-28 failed on this; reproduced here with a CPU entry). The
    option is one XLA rejects, so that the top-level call shows it still reaches the compiler."""
    monkeypatch.setitem(jit_module.OPTIONS, "cpu", {"xla_no_such_option": True})
    double = jit_module.jit(lambda x: 2 * x)
    x = jnp.arange(3.0)
    assert jax.eval_shape(double, x).shape == (3,)
    assert jax.jit(lambda x: double(x) + 1)(x).tolist() == [1.0, 3.0, 5.0]
    assert jax.lax.scan(lambda c, _: (double(c), None), x, length=2)[0].tolist() == [0.0, 4.0, 8.0]
    with pytest.raises(Exception, match="xla_no_such_option"):
        double(x)


def test_on_a_gpu_triton_gemm_fusions_and_rematerialization_are_off():
    """The options, and XLA knows them (a misspelt one fails the compile, as above)."""
    assert jit_module.OPTIONS == {
        "gpu": {"xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "rematerialization"}
    }
    compiled = jax.jit(lambda x: x + 1, compiler_options=jit_module.OPTIONS["gpu"])
    assert compiled(jnp.arange(3.0)).tolist() == [1.0, 2.0, 3.0]


def test_no_module_jits_around_kvjax_jit():
    """A plain ``jax.jit`` in the library would compile its program without the options."""
    plain = [
        str(p.relative_to(ROOT))
        for top in ("kvjax", "kernels")
        for p in (ROOT / top).rglob("*.py")
        if "jax.jit" in p.read_text() and p != ROOT / "kvjax" / "runtime" / "jit.py"
    ]
    assert plain == []
