"""The quick-start notebook: committed without outputs, and it runs end to end (smaller sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"

# Small enough for ~a minute on 2 cores; the notebook's own values are its real quick start.
SMALL = """
NUM_LAYERS = 4
D_MODEL = 32
SEQ_LEN = 32
BATCH_SIZE = 4
NUM_MICROBATCHES = 2
STEPS = 12
REBALANCE_EVERY = 4
"""


def test_the_notebook_is_committed_without_outputs() -> None:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code, "the notebook has code cells"
    for i, cell in enumerate(code):
        assert cell["outputs"] == [], f"code cell {i} has outputs: strip them before committing"
        assert cell["execution_count"] is None, f"code cell {i} has an execution count: strip it"
    tagged = [c for c in code if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, "exactly one cell is tagged 'parameters' (the test shrinks it)"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_notebook_executes(monkeypatch: pytest.MonkeyPatch) -> None:
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed: pip install -e '.[dev]'")
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed: pip install -e '.[dev]'")
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install -e '.[dev]'")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed: pip install -e '.[dev]'")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    params = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    params.source = SMALL.strip()
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    text = "".join(
        out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert "4 blocks: ['DenseBlock', 'EarlyExitBlock'" in text
    assert "median tokens/s over the last 6 steps: static" in text and "final placement 0-" in text
