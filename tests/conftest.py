"""Shared fixtures: tiny random models, the real SmolLM2 weights, and the --runslow switch."""

import atexit
import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from helpers import QUICK_COMPILE

# Tests compile over a thousand small programs and run most on tiny shapes, where XLA:CPU's compile
# costs far more than its code saves (helpers.QUICK_COMPILE). On this 2-core machine: the backend's
# optimisation off, 25 min 21 s -> 19 min 0 s for the suite; then the older fusion emitters, 26 min
# 4 s -> 17 min 40 s (2026-11-28, --durations=0), though SmolLM2's generations run slower (one test
# measured alone: 87 s against 75 s). Float32 results differ in their last bits (up to 1.0e-5 on a
# tiny model's logits of 7). The notebooks and the installed package run with the user's flags
# (helpers.xla_env). Read when JAX's backend starts.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *QUICK_COMPILE]).strip()

SMOLLM2 = "smollm2-135m-instruct"
# The CLI turns JAX's persistent compilation cache on (kvjax.runtime.compilation_cache); tests that
# call it in-process must not write to the user's cache nor count its hits as compilations.
# test_compilation_cache turns it on.
os.environ["KVJAX_COMPILATION_CACHE"] = "off"
# Modules compile many of the same programs (SmolLM2's steps above all), and each module's compiled
# programs are dropped after it (_release_compiled_programs): each test process keeps what it
# compiled in a persistent cache of its own, a temporary directory removed when the process ends
# (one per process: JAX writes an entry in place, so a second writer could read it half written).
# count_compiles counts a program loaded from it as compiled. Three files in one process: 139 ->
# 118 s (2026-11-30).
_PROGRAMS = tempfile.mkdtemp(prefix="kvjax-tests-programs-")
atexit.register(shutil.rmtree, _PROGRAMS, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _PROGRAMS)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


# The files that take longest (measured in the full run, longest first), run first:
# ``pytest -n 2 --dist loadfile`` hands files to its workers in this order (pytest_configure), and a
# long file started last would leave one worker idle at the end.
LONGEST_FIRST = (
    "test_notebooks.py",
    "test_sharding.py",
    "test_engine_vs_reference.py",
    "test_serving.py",
    "test_ask_chat.py",
    "test_gpu_script.py",
    "test_output_aware_smollm2.py",
    "test_eval.py",
    "test_server_kills.py",
    "test_serving_contexts_api.py",
    "test_packaging.py",
    "test_engine.py",
    "test_smollm2.py",
    "test_layer_fields.py",
    "test_serve_soak.py",
    "test_kvzip_kvpress.py",
    "test_paged_kernels.py",
    "test_prefilled.py",
    "test_kernels.py",
    "test_generate.py",
)


def pytest_configure(config):
    # pytest-xdist sorts the files by their number of tests before handing them out unless told not
    # to, which undid LONGEST_FIRST (until 2026-11-30).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: rank.get(item.path.name, len(rank))
    )  # stable: the rest keep their order
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow real-model evaluation: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    import kvjax

    return kvjax.load(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    import kvjax

    return kvjax.load_tokenizer(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    from kvjax.checkpoint.registry import REGISTRY

    return REGISTRY[SMOLLM2].path()


@pytest.fixture
def checkpoint_root(tmp_path, monkeypatch):
    """Conversions of this test go to a temporary directory."""
    root = tmp_path / "checkpoints"
    monkeypatch.setenv("KVJAX_CHECKPOINTS", str(root))
    return root


@pytest.fixture(scope="session")
def tiny_llama():
    import kvjax

    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=97,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=48,
        max_seq_len=512,
        rope_theta=10000.0,
        norm_eps=1e-5,
        eos_token_ids=(3,),
        pad_token_id=0,
    )
    return kvjax.init_params(cfg, jax.random.key(0), scale=0.3)


@pytest.fixture(scope="module")
def params(tiny_llama):
    """The NumPy reference's self-checks: the tiny Llama."""
    return tiny_llama


@pytest.fixture(scope="module")
def prompt():
    """The NumPy reference's self-checks: a prompt of ``helpers.P`` random tokens."""
    from helpers import P

    return [int(t) for t in np.random.default_rng(0).integers(0, 97, P)]


@pytest.fixture(scope="module")
def no_eviction(params, prompt):
    """The NumPy reference with no eviction at all, whole prompt in one block, ``helpers.N`` new
    tokens."""
    from helpers import N, P
    from reference_eviction import run_reference

    return run_reference(
        params,
        prompt,
        N,
        scorer="h2o",
        budget=None,
        protocol="blockwise",
        block_size=P,
        n_sink=0,
        window=0,
    )


@pytest.fixture(scope="session")
def tiny_head_scores(tiny_llama, tmp_path_factory):
    """A file of (made-up) kvzip-head scores for the tiny Llama."""
    from kvjax.runtime.kvzip_pass import save_head_scores

    cfg = tiny_llama.config
    path = str(tmp_path_factory.mktemp("kvzip") / "heads.json")
    save_head_scores(
        path, np.linspace(0, 1, cfg.n_layers * cfg.n_kv_heads).reshape(cfg.n_layers, -1), cfg
    )
    return path


@pytest.fixture
def count_compiles():
    """``with count_compiles() as box:`` counts in ``box["n"]`` the programs that had to be
    compiled: XLA backend compilations and programs loaded from the tests' persistent cache."""
    import contextlib

    from jax import monitoring

    @contextlib.contextmanager
    def counter():
        box = {"n": 0}

        def compiled(event, duration, **kwargs):
            if event == "/jax/core/compile/backend_compile_duration":
                box["n"] += 1

        def loaded(event, **kwargs):
            if event == "/jax/compilation_cache/cache_hits":
                box["n"] += 1

        monitoring.register_event_duration_secs_listener(compiled)
        monitoring.register_event_listener(loaded)
        try:
            yield box
        finally:
            monitoring.unregister_event_duration_listener(compiled)
            monitoring.unregister_event_listener(loaded)

    return counter


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each module's compiled programs: hundreds of live XLA:CPU executables in one process
    exhaust the process's memory mappings (a segfault inside XLA's compiler was seen without this).
    """
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_smollm2_vocab(smollm2_tokenizer):
    """A random two-layer Llama over SmolLM2's vocabulary: real prompts, fast runs."""
    import kvjax

    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=len(smollm2_tokenizer),
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=48,
        max_seq_len=2048,
        norm_eps=1e-5,
        tie_embeddings=True,
        eos_token_ids=(2,),
        pad_token_id=0,
    )
    return kvjax.init_params(cfg, jax.random.key(1), scale=0.3)
