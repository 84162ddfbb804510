"""Every notebook in notebooks/ runs top to bottom on CPU, without its shell and magic lines.

Lines starting with ``!`` or ``%`` (pip installs, ``git clone``, ``%cd``; they need network or Colab) are left
out; the remaining code cells run in order, in one fresh namespace, in a subprocess at the repository root, and
the output must hold the notebook's line in ``EXPECTED``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT = 600
# A line each notebook's output must hold: the model answered what it was asked.
EXPECTED = {"quickstart_tpu.ipynb": "Paris", "serving_tpu.ipynb": "Paris",
            "eviction_methods.ipynb": "needle answered with the full cache: True"}

# Runs the extracted source in a fresh namespace; compiled under its file name so tracebacks show the lines.
RUNNER = "import sys; p = sys.argv[1]; exec(compile(open(p).read(), p, 'exec'), {'__name__': '__main__'})"


def cell_source(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def python_source(notebook: dict) -> str:
    """The code cells joined in order, each without its ``!`` / ``%`` lines (cell magics drop the cell)."""
    cells = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = cell_source(cell).splitlines()
        if lines and lines[0].startswith("%%"):
            continue
        cells.append("\n".join(line for line in lines if not line.lstrip().startswith(("!", "%"))))
    return "\n\n".join(cells) + "\n"


@pytest.mark.smollm2
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_on_cpu(path, tmp_path):
    assert path.name in EXPECTED, f"{path.name}: add the line its output must hold to EXPECTED"
    notebook = json.loads(path.read_text(encoding="utf-8"))
    assert notebook["nbformat"] == 4
    code_cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert code_cells, f"{path.name} has no code cells"
    stored = [i for i, c in enumerate(code_cells) if c.get("outputs") or c.get("execution_count") is not None]
    assert not stored, f"{path.name}: code cells {stored} store outputs or execution counts; clear them"

    script = tmp_path / f"{path.stem}.py"
    script.write_text(python_source(notebook), encoding="utf-8")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(script)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{path.name} did not finish within {TIMEOUT} s; stdout so far:\n{e.stdout}")
    report = f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"{path.name} exited with {proc.returncode}\n{report}"
    assert EXPECTED[path.name] in proc.stdout, f"{path.name}: no {EXPECTED[path.name]!r} in the output\n{report}"
