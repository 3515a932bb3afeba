"""The quick-start notebook: committed with its (small) outputs, and it runs end to end (smaller sizes)."""

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
FREEZE_EVERY = 3
"""


MAX_NOTEBOOK_BYTES = 400_000  # outputs are a few PNG plots and lines of text


def test_the_notebook_is_committed_with_its_outputs() -> None:
    # A reader on GitHub sees the plots: every code cell ran, in order, without an error, and the outputs
    # stay small (PNG plots and text only).
    assert NOTEBOOK.stat().st_size < MAX_NOTEBOOK_BYTES
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code, "the notebook has code cells"
    counts = [cell["execution_count"] for cell in code]
    assert counts == list(range(1, len(code) + 1)), f"execution counts {counts}: run it top to bottom once"
    kinds = {key for c in code for out in c["outputs"] for key in out.get("data", {"text/plain": 0})}
    assert "image/png" in kinds, "the committed notebook shows its plots"
    assert kinds <= {"image/png", "text/plain"}, f"outputs beyond PNG and text: {kinds}"
    assert not [out for c in code for out in c["outputs"] if out["output_type"] == "error"]
    tagged = [c for c in code if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, "exactly one cell is tagged 'parameters' (the test shrinks it)"


def test_the_notebook_imports_nothing_from_benchmarks() -> None:
    source = "\n".join("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"])
    assert "benchmarks" not in source.replace("benchmarks/README.md", "").replace("`benchmarks/`", "")
    assert "sys.path" not in source


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_notebook_executes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed: pip install -e '.[dev]'")
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed: pip install -e '.[dev]'")
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install -e '.[dev]'")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed: pip install -e '.[dev]'")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # figures as PNG outputs
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    params = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    params.source = SMALL.strip() + f"\nFIGURES = {str(tmp_path)!r}"
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    text = "".join(
        out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert "4 blocks: ['DenseBlock', 'DenseBlock'" in text
    assert "median tokens/s over the last 6 steps: static" in text and "final placement 0-" in text
    assert "within noise" in text or "beyond noise" in text  # the comparison says which it is
    assert "DynMo decided" in text  # read back from the CSV logger's dynmo/stage*/num_layers
    images = [
        o
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(images) == 3, "the three figures are shown"
    written = sorted(p.name for p in tmp_path.glob("*.png"))
    assert written == ["placement.png", "stage_busy.png", "step_time.png"]
