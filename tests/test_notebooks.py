"""Every notebook in notebooks/ runs top to bottom on CPU under nbclient (a Jupyter kernel, as Colab
runs it).

Cells tagged ``skip-execution`` are Colab's setup (pip installs, ``git clone``, ``%cd`` into the
clone: they need network or Colab's paths) and may hold nothing else; nbclient skips them and runs
every other cell in order in one kernel started at the repository root, and the printed output must
hold the notebook's line in ``EXPECTED``.
"""

from pathlib import Path

import nbformat
import pytest
from helpers import xla_env
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT = 600  # seconds per cell
SKIP = "skip-execution"  # nbclient's default skip_cells_with_tag
# A line each notebook's output must hold: the model answered what it was asked.
EXPECTED = {
    "quickstart_tpu.ipynb": "Paris",
    "serving_tpu.ipynb": "Paris",
    "eviction_methods.ipynb": "needle answered with the full cache: True",
}


def printed(cell) -> str:
    return "".join(
        out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream"
    )


@pytest.mark.smollm2
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_on_cpu(path, monkeypatch):
    assert path.name in EXPECTED, f"{path.name}: add the line its output must hold to EXPECTED"
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert code_cells, f"{path.name} has no code cells"
    stored = [i for i, c in enumerate(code_cells) if c.outputs or c.execution_count is not None]
    assert not stored, (
        f"{path.name}: code cells {stored} store outputs or execution counts; clear them"
    )
    for cell in code_cells:
        # only Colab's shell and magic lines may go unexecuted
        if SKIP in cell.metadata.get("tags", []):
            assert all(
                line.lstrip().startswith(("!", "%"))
                for line in cell.source.splitlines()
                if line.strip()
            ), f"{path.name}: a {SKIP} cell holds Python code:\n{cell.source}"

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the kernel inherits the environment
    monkeypatch.setenv(
        "XLA_FLAGS", xla_env(optimized=True)["XLA_FLAGS"]
    )  # as a user's kernel compiles
    client = NotebookClient(
        notebook,
        timeout=TIMEOUT,
        kernel_name="python3",
        skip_cells_with_tag=SKIP,
        resources={"metadata": {"path": str(ROOT)}},
    )
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as e:
        pytest.fail(f"{path.name}: {e}")
    output = "".join(printed(c) for c in notebook.cells if c.cell_type == "code")
    assert EXPECTED[path.name] in output, (
        f"{path.name}: no {EXPECTED[path.name]!r} in the output\n{output[-5000:]}"
    )
