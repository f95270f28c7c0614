"""examples/tradeoffs.ipynb runs headless from the repository root, and is committed without outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "tradeoffs.ipynb"


def test_notebook_is_committed_without_outputs():
    data = json.loads(NOTEBOOK.read_text())
    code = [cell for cell in data["cells"] if cell["cell_type"] == "code"]
    assert code and all(cell["outputs"] == [] and cell["execution_count"] is None for cell in code)
    assert NOTEBOOK.stat().st_size < 20_000


@pytest.fixture
def this_python_kernel(tmp_path, monkeypatch) -> str:
    """A ``python3`` kernelspec that runs this interpreter, found before any user-wide one.

    A ``python3`` spec installed with ``ipykernel install --user`` may point to another Python;
    JUPYTER_PATH comes first in Jupyter's search path, so this one wins.
    """
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ckplan tests)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return "python3"


@pytest.mark.slow
def test_notebook_runs(this_python_kernel, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name=this_python_kernel, timeout=300,
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    images = [out["data"]["image/png"] for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 3  # the curve, the block heatmap, the timeline: each displayed once
    assert all(len(image) > 5000 for image in images)
    html = [out["data"]["text/html"] for out in outputs if "text/html" in out.get("data", {})]
    assert any("ckplan trade-off" in page for page in html) and any("ckplan plan" in page for page in html)
    text = "".join(out.get("text", "") for out in outputs)
    assert "measured" in text and "loss" in text
    nbformat.write(notebook, tmp_path / "executed.ipynb")  # kept for a look when debugging
