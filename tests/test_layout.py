"""Project layout promises: kernels import as kvjax.kernels only, and CI runs the README's test command."""

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
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in readme.splitlines() if line.startswith("bash scripts/setup.sh")]
    assert len(commands) >= 2, "the README's first two commands run the main job and the tests"
    assert commands[1] in ci.splitlines()
    assert "pytest" in commands[1] and "kvjax generate" in commands[0]
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def test_readme_lists_every_scorer_name():
    from kvjax.scorers import SCORERS, scorer_table

    readme = (ROOT / "README.md").read_text()
    assert all(f"| `{name}` |" in readme for name in SCORERS)
    assert scorer_table() in readme


def test_readme_lists_every_eviction_keyword_and_allocation():
    from kvjax.allocation import allocation_table
    from kvjax.options import options_table

    readme = (ROOT / "README.md").read_text()
    assert options_table() in readme and allocation_table() in readme


def test_kernels_import_nothing_of_kvjax_outside_kvjax_kernels():
    imported = []
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.append((path.name, node.module))
            elif isinstance(node, ast.Import):
                imported += [(path.name, alias.name) for alias in node.names]
    outside = [(f, m) for f, m in imported if m.split(".")[0] == "kvjax" and not m.startswith("kvjax.kernels")]
    assert imported and not outside, outside
