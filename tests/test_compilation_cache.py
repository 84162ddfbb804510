"""JAX's persistent compilation cache under the command line: the second run of a command compiles
nothing."""

import json
import os
import subprocess
import sys

import pytest

# Runs ``kvjax.cli.main.main`` and reports what the persistent cache did: compilations that asked
# it, and hits.
SCRIPT = """
import json, sys
from jax import monitoring
from kvjax.cli.main import main
counts = {"requests": 0, "hits": 0}
names = {
    "/jax/compilation_cache/compile_requests_use_cache": "requests",
    "/jax/compilation_cache/cache_hits": "hits",
}


def count(event, **kw):
    if event in names:
        counts[names[event]] += 1


monitoring.register_event_listener(count)
code = main(sys.argv[1:])
print(json.dumps(dict(counts, code=code)), file=sys.stderr)
"""


def _run(cache: str, *argv: str) -> dict:
    env = dict(os.environ, KVJAX_COMPILATION_CACHE=cache)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["code"] == 0, done.stderr[-3000:]
    return report


@pytest.mark.smollm2
def test_second_run_compiles_nothing(tmp_path):
    cache = str(tmp_path / "jax-cache")
    argv = (
        "generate",
        "--chat",
        "What is the capital of France?",
        "--max-new-tokens",
        "4",
        "--budget",
        "64",
        "--scorer",
        "snapkv",
    )
    cold = _run(cache, *argv)
    assert cold["requests"] > 0 and cold["hits"] == 0, cold
    assert os.listdir(cache)
    warm = _run(cache, *argv)
    assert warm["requests"] == cold["requests"] and warm["hits"] == warm["requests"], warm


def test_cache_dir_default_override_and_off(tmp_path, monkeypatch):
    from kvjax.runtime import compilation_cache

    monkeypatch.setenv("KVJAX_CHECKPOINTS", str(tmp_path / "ckpt"))
    monkeypatch.delenv("KVJAX_COMPILATION_CACHE")
    assert compilation_cache.cache_dir() == str(tmp_path / "ckpt" / "jax-cache")
    monkeypatch.setenv("KVJAX_COMPILATION_CACHE", str(tmp_path / "mine"))
    assert compilation_cache.cache_dir() == str(tmp_path / "mine")
    monkeypatch.setenv("KVJAX_COMPILATION_CACHE", "off")
    assert compilation_cache.cache_dir() is None
