"""Project layout promises: kernels import as kvjax.kernels only, and CI runs the README's test
command."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_import_as_kvjax_kernels():
    import kvjax.kernels

    assert Path(kvjax.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_transformers_does_not_mistake_our_kernels_folder_for_the_kernels_package():
    # Run from the repository root, where `kernels/` sits on sys.path as the current directory.
    probe = "from transformers.utils.import_utils import is_kernels_available as f; print(f())"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [
        line.strip() for line in readme.splitlines() if line.startswith("bash scripts/setup.sh")
    ]
    assert len(commands) >= 2, "the README's first two commands run the main job and the tests"
    assert commands[1] in ci.splitlines()
    assert "pytest" in commands[1] and "kvjax generate" in commands[0]
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def guide() -> str:
    """docs/guide.md as the site shows it: its generated tables in place (docs/hooks.py)."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        from hooks import render_tables
    finally:
        sys.path.remove(str(ROOT / "docs"))
    return render_tables((ROOT / "docs" / "guide.md").read_text())


def test_the_site_lists_every_scorer_name():
    from kvjax.eviction import SCORERS, scorer_table

    page = guide()
    assert all(f"| `{name}` |" in page for name in SCORERS)
    assert scorer_table() in page
    assert "docs/guide.md#scorer-names" in (ROOT / "README.md").read_text()


def test_the_site_lists_every_eviction_keyword_and_allocation():
    from kvjax.eviction import allocation_table
    from kvjax.runtime.options import options_table

    page = guide()
    assert options_table() in page and allocation_table() in page


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_kernels_import_nothing_of_kvjax_outside_kvjax_kernels():
    imported = []
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.append((path.name, node.module))
            elif isinstance(node, ast.Import):
                imported += [(path.name, alias.name) for alias in node.names]
    outside = [
        (f, m)
        for f, m in imported
        if m.split(".")[0] == "kvjax" and not m.startswith("kvjax.kernels")
    ]
    assert imported and not outside, outside


def _modules() -> dict[str, Path]:
    """Every module of kvjax (kernels/ as kvjax.kernels) by dotted name."""
    mods = {}
    for base, pkg in ((ROOT / "kvjax", "kvjax"), (ROOT / "kernels", "kvjax.kernels")):
        for path in base.rglob("*.py"):
            parts = [pkg, *path.relative_to(base).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the kvjax modules it imports anywhere (top level, in functions, under
    TYPE_CHECKING); ``from package import submodule`` points at the submodule."""
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvjax"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
                edges[m] |= subs | ({node.module} if len(subs) < len(node.names) else set())
            elif isinstance(node, ast.Import):
                edges[m] |= {a.name for a in node.names if a.name.startswith("kvjax")}
        edges[m] = (edges[m] & mods.keys()) - {m}
    return edges


def test_no_import_circles():
    edges = _imports(_modules())
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m not in done:
            path.append(m)
            for n in sorted(edges[m]):
                visit(n)
            path.pop()
            done.add(m)

    for m in sorted(edges):
        visit(m)


def test_no_module_imports_private_names_of_another_package():
    """``from a.b import _x`` or ``from a._b import x`` only inside the package holding the name."""
    reached = []
    for m, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvjax")
            ):
                continue
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            for i, part in enumerate(parts + names):
                if part.startswith("_") and not part.startswith("__"):
                    owner = ".".join(
                        parts[: min(i, len(parts))]
                    )  # the package holding the private name
                    if not m.startswith(owner + ".") and m != owner:
                        reached.append((m, node.module, part))
    assert not reached, reached


# The layers of kvjax, bottom first: a module imports only its own layer and the ones below (no back
# arrows).
LAYERS = (
    ("kvjax.kernels",),
    ("kvjax.slots", "kvjax.extras", "kvjax.model"),
    ("kvjax.checkpoint", "kvjax.loading", "kvjax.sharding", "kvjax.eviction"),
    ("kvjax.cache",),
    ("kvjax.runtime",),
    ("kvjax",),  # the public API (kvjax/__init__.py), which the interfaces use
    ("kvjax.serving", "kvjax.eval", "kvjax.cli"),
    ("kvjax.__main__",),
)


def _layer(module: str) -> int:
    """The index in ``LAYERS`` of a module's most specific (longest) prefix."""
    found = [
        (len(p), i)
        for i, names in enumerate(LAYERS)
        for p in names
        if module == p or module.startswith(p + ".")
    ]
    assert found, f"{module} is in no layer"
    return max(found)[1]


def test_imports_point_down_the_layers():
    edges = _imports(_modules())
    back = [(m, n) for m, targets in edges.items() for n in targets if _layer(n) > _layer(m)]
    assert not back, back


def test_the_repository_is_ruff_clean():
    """pyproject.toml's ruff rules (line length 100) hold over the whole repository, tests,
    benchmarks and notebooks included (``.ci/run`` runs the same command)."""
    ruff = Path(sys.executable).with_name("ruff")
    done = subprocess.run(
        [str(ruff), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


def test_the_caches_name_no_scorer_or_modifier():
    """kvjax/cache/ holds storage: no base scorer, alias or modifier name (nor MomentKV's flags)
    appears in its code as a name, an attribute or a string; the modifiers' hooks
    (kvjax.eviction.modifiers) hold their behaviour."""
    from kvjax.eviction import ALIASES, BASES, MODIFIERS

    words = {w.replace("-", "_") for w in (*BASES, *ALIASES, *MODIFIERS)} | {"zeroth", "mi", "nc"}
    found = []
    for path in sorted((ROOT / "kvjax" / "cache").glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, (ast.FunctionDef, ast.arg)):
                names = [getattr(node, "name", None) or node.arg]
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
            ):
                names = [node.value.replace("-", "_")]
            for name in names:
                parts = set(name.lower().split("_")) | {name.lower()}
                if hits := {w for w in words if w in parts or (len(w) > 3 and w in name.lower())}:
                    found.append(f"{path.name}:{node.lineno}: {name} ({', '.join(sorted(hits))})")
    assert not found, found


def test_every_base_and_modifier_has_its_oracle_entry():
    """A base scorer is one module, one registration line (kvjax.eviction.names.BASES) and one
    oracle entry (tests/reference_eviction.py's ORACLE_BASES, with the same scoring queries, state
    folding, reset, pooling and modifiers), and a modifier one module and one oracle entry
    (ORACLE_MODIFIERS); KVzip's bases have their own oracle (KVzipReference)."""
    from reference_eviction import MODIFIERS, ORACLE_BASES, ORACLE_MODIFIERS

    from kvjax.eviction import BASES
    from kvjax.eviction import MODIFIERS as ENGINE_MODIFIERS

    assert set(BASES) - {"kvzip", "kvzip-head"} == set(ORACLE_BASES)
    assert set(ENGINE_MODIFIERS) == set(ORACLE_MODIFIERS) == set(MODIFIERS)
    for name, oracle in ORACLE_BASES.items():
        base = BASES[name]
        assert (oracle.queries, oracle.replace, oracle.resets) == (
            base.queries,
            base.replace,
            base.reset_after_evict,
        ), name
        assert oracle.pools == (base.default_pool != "none"), name
        assert set(oracle.modifiers) == set(base.modifiers) & set(ENGINE_MODIFIERS), name


def test_every_cache_is_a_cache():
    """The full, recording, dense and paged caches (and the evaluation's recorder) all meet the one
    protocol the model's layers use (kvjax.cache.layout.Cache: attend and kv); the budget caches the
    evicting one."""
    import jax

    import kvjax
    from kvjax.cache.full import FullCache
    from kvjax.cache.layout import Cache, EvictingCache
    from kvjax.eval.fidelity import OutputRecorder
    from kvjax.runtime.options import eviction_from
    from kvjax.runtime.prefilled import RecordingCache

    cfg = kvjax.ModelConfig(
        arch="llama",
        vocab_size=32,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        d_ff=16,
        max_seq_len=64,
    )
    full = FullCache.init(cfg, 1, 8, jax.numpy.float32)
    budget = [
        eviction_from(budget=8, scorer=s, window=2).empty_cache(cfg, 1, 1, jax.numpy.float32)
        for s in ("snapkv", "adakv")
    ]
    for cache in (
        full,
        RecordingCache(full=full, q=None),
        OutputRecorder(inner=full, outs=None),
        *budget,
    ):
        assert isinstance(cache, Cache), type(cache)
    assert all(isinstance(c, EvictingCache) for c in budget) and not isinstance(full, EvictingCache)
