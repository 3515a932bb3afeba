"""Figures of DynMo's logged ``dynmo/*`` metrics, read from runs' CSV logs (``metrics.csv``), as PNG files.

    python -m lightning_dynmo.plots static=<run_dir> dynmo=<run_dir> --out docs/figures/

A run directory is one that holds a ``metrics.csv`` (Lightning's ``CSVLogger``; the app's
``<run>/csv``), or the file itself. Each run needs ``DynMoCallback`` (with ``balancer="static"`` it only
measures) and ``Trainer(log_every_n_steps=1)`` for a point per step. Three figures: the placement
(``dynmo/stage{s}/num_layers``), each stage's busy time per step (``dynmo/stage{s}/busy_s``), and the step
time with the measured imbalance (``dynmo/step_time_s``, ``dynmo/imbalance``).
"""

from __future__ import annotations

import argparse
import csv
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

Series = dict[str, list[tuple[int, float]]]

FIGURES = ("placement", "stage_busy", "step_time")


def read_metrics(run: Path) -> Series:
    """Every ``dynmo/*`` column of a run's ``metrics.csv`` as ``(step, value)`` points, empty cells left out.

    Raises:
        FileNotFoundError: ``run`` is neither a ``metrics.csv`` nor a directory holding one.
    """
    path = run if run.is_file() else next(iter(sorted(run.rglob("metrics.csv"))), None)
    if path is None:
        raise FileNotFoundError(
            f"no metrics.csv under {run}: pass the directory of the run's CSVLogger "
            "(Trainer(logger=CSVLogger(...)))."
        )
    series: Series = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            for name, cell in row.items():
                if name.startswith("dynmo/") and cell not in ("", None):
                    series.setdefault(name, []).append((int(row["step"]), float(cell)))
    return series


def plot_runs(runs: Mapping[str, Path], out: Path | None = None) -> list[Figure]:
    """The three figures for ``runs`` (label -> run directory); with ``out``, also ``out/<figure>.png``."""
    metrics = {label: read_metrics(Path(path)) for label, path in runs.items()}
    figures = [_placement(metrics), _stage_busy(metrics), _step_time(metrics)]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name, figure in zip(FIGURES, figures, strict=True):
            figure.savefig(out / f"{name}.png", dpi=80)
    return figures


def _stages(series: Series, metric: str) -> list[str]:
    pattern = re.compile(rf"dynmo/stage(\d+)/{metric}")
    found = [(int(m.group(1)), name) for name in series if (m := pattern.fullmatch(name))]
    return [name for _, name in sorted(found)]


def _placement(metrics: Mapping[str, Series]) -> Figure:
    figure, ax = plt.subplots(figsize=(6, 3))
    for label, series in metrics.items():
        for s, name in enumerate(_stages(series, "num_layers")):
            steps, values = zip(*series[name], strict=True)
            ax.step(steps, values, where="post", label=f"{label}: stage {s}")
    ax.set(xlabel="step", ylabel="blocks", title="Placement after each decision (dynmo/stage*/num_layers)")
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _stage_busy(metrics: Mapping[str, Series]) -> Figure:
    figure, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3), sharey=True, squeeze=False)
    for ax, (label, series) in zip(axes[0], metrics.items(), strict=True):
        for s, name in enumerate(_stages(series, "busy_s")):
            steps, values = zip(*series[name], strict=True)
            ax.plot(steps, [1e3 * v for v in values], marker=".", label=f"stage {s}")
        ax.set(xlabel="step", title=f"{label}: busy time per stage")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("ms per step")
    figure.tight_layout()
    return figure


def _step_time(metrics: Mapping[str, Series]) -> Figure:
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3))
    for label, series in metrics.items():
        for ax, name, scale in ((left, "dynmo/step_time_s", 1e3), (right, "dynmo/imbalance", 1.0)):
            if name in series:
                steps, values = zip(*series[name], strict=True)
                ax.plot(steps, [scale * v for v in values], marker=".", label=label)
    left.set(xlabel="step", ylabel="ms", title="Step time (dynmo/step_time_s)")
    right.set(xlabel="step", ylabel="(max - min) / mean", title="Measured imbalance (dynmo/imbalance)")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    figure.tight_layout()
    return figure


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """The command line: ``LABEL=RUN_DIR ... --out DIR``; returns the PNG files written."""
    parser = argparse.ArgumentParser(prog="python -m lightning_dynmo.plots", description=__doc__)
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR (a directory holding metrics.csv)")
    parser.add_argument("--out", type=Path, default=Path("docs/figures"), help="where the PNG files go")
    args = parser.parse_args(argv)
    runs = dict(_label(text) for text in args.runs)
    plot_runs(runs, args.out)
    return [args.out / f"{name}.png" for name in FIGURES]


def _label(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"run {text!r} must be LABEL=RUN_DIR, e.g. dynmo=outputs/2026-11-25/10-00-00/csv")
    return label, Path(path)


if __name__ == "__main__":
    main()
