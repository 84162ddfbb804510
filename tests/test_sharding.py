"""Sharding: the rules table and mesh errors here; the 8-device runs (tests/multidevice_checks.py)
in a subprocess with 8 fake CPU devices, so that this process keeps one; a two-process run under
jax.distributed."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import xla_env
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import kvjax
from kvjax.sharding import make_mesh, partition

TESTS = Path(__file__).resolve().parent


def test_logical_axes_go_to_their_mesh_axis_when_it_divides_them():
    mesh = AbstractMesh((2, 4), ("data", "model"))
    assert partition(
        ("layers", "batch", "kv_heads", "slots", "head_dim"), (30, 8, 8, 513, 64), mesh
    ) == P(None, "data", "model", None, None)
    # SmolLM2: 3 KV heads and 9 query heads do not split over 4 devices: replicated, as serving
    # stacks do
    assert partition(("layers", "embed", "kv_heads", "head_dim"), (30, 576, 3, 64), mesh) == P(
        None, None, None, None
    )
    assert partition(("layers", "embed", "ffw"), (30, 576, 1536), mesh) == P(None, None, "model")
    assert partition(("batch", "vocab"), (3, 49152), mesh) == P(None, "model")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("data=two", "must look like 'data=2,model=4'"),
        ("data=2,pipeline=2", "mesh axes \\['pipeline'\\] are unknown"),
        ("data=64", "needs 64 devices; 1 are available"),
    ],
)
def test_bad_meshes_are_clear_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        make_mesh(spec)


def test_any_jax_mesh_with_data_and_model_axes_runs_with_auto_axes():
    import jax
    from jax.sharding import AxisType

    from kvjax.sharding import auto_mesh

    explicit = jax.make_mesh(
        (1, 1), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit)
    )
    mesh = auto_mesh(explicit)
    assert (
        mesh.axis_types == (AxisType.Auto, AxisType.Auto)
        and mesh.devices.tolist() == explicit.devices.tolist()
    )
    assert auto_mesh(mesh) is mesh and auto_mesh(None) is None
    with pytest.raises(ValueError, match="mesh axes \\['x'\\] are unknown.*name the axes so"):
        auto_mesh(jax.make_mesh((1,), ("x",)))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        kvjax.generate(
            kvjax.init_params(
                kvjax.ModelConfig("llama", 16, 8, 1, 2, 1, 8, 16, 64), jax.random.key(0)
            ),
            [1, 2, 3],
            mesh="data=2",
        )


def _run(cmd, env_extra, timeout):
    env = os.environ | env_extra | {"PYTHONPATH": str(TESTS)}
    return subprocess.run(
        cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_on_8_devices():
    """tests/multidevice_checks.py: meshes (data=8), (data=2, model=4), (model=8) and SmolLM2 on
    (data=2) and (model=2) equal the one-device run; shardings; no gathered cache in the decode
    step."""
    result = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/multidevice_checks.py",
        ],
        xla_env(8),
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def test_two_processes_under_jax_distributed_generate_the_one_process_tokens():
    from multihost_model import PROMPTS, SETTINGS, model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    worker = [sys.executable, str(TESTS / "multihost_worker.py")]
    second = subprocess.Popen(
        worker + ["1", "2", port],
        cwd=TESTS,
        env=os.environ | xla_env(2) | {"PYTHONPATH": str(TESTS)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = _run(worker + ["0", "2", port], xla_env(2), timeout=600)
    second.wait(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4 and report["local"] == 2
    params = model()
    for name, options in SETTINGS.items():
        alone = kvjax.generate(params, PROMPTS, 6, stop_ids=(), **options)
        assert report["tokens"][name] == [np.asarray(row).tolist() for row in alone], name
