"""lightning_dynmo.plots: the dynmo/* columns of a CSV log become three PNG figures."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install -e '.[dev]'")

from lightning_dynmo.plots import main, read_metrics  # after the skip above

COLUMNS = ["step", "train_loss", "dynmo/step_time_s", "dynmo/imbalance", "dynmo/stage0/busy_s"]
COLUMNS += ["dynmo/stage1/busy_s", "dynmo/stage0/num_layers", "dynmo/stage1/num_layers"]


def _run(path: Path, decided_at: int) -> Path:
    path.mkdir(parents=True)
    with (path / "metrics.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for step in range(6):
            sizes = [3, 5] if step >= decided_at else ["", ""]
            writer.writerow([step, 1.0, 0.2, 0.1, 0.15, 0.1, *sizes])
    return path


def test_read_metrics_keeps_the_dynmo_columns_and_drops_empty_cells(tmp_path: Path) -> None:
    series = read_metrics(_run(tmp_path / "run", decided_at=4))
    assert "train_loss" not in series
    assert series["dynmo/stage0/num_layers"] == [(4, 3.0), (5, 3.0)]
    assert len(series["dynmo/step_time_s"]) == 6


def test_the_command_writes_the_three_figures(tmp_path: Path) -> None:
    static, dynmo = _run(tmp_path / "static", decided_at=99), _run(tmp_path / "dynmo", decided_at=2)
    written = main([f"static={static}", f"dynmo={dynmo}", "--out", str(tmp_path / "figures")])
    assert sorted(p.name for p in written) == ["placement.png", "stage_busy.png", "step_time.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_a_directory_without_metrics_csv_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no metrics\.csv under .*CSVLogger"):
        read_metrics(tmp_path)


def test_a_run_without_a_label_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="must be LABEL=RUN_DIR"):
        main([str(tmp_path)])
