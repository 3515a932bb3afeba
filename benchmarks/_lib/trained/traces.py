"""The trace file of one case: per step and per layer the statistic that sets the cost, and its spread.

Read :class:`Trace` (what one JSON file under ``benchmarks/results/traces/`` holds), then :func:`spread`
(min / median / max across layers, per row and over the whole run) and :func:`format_spread` (what the
recorder prints, so a uniform trace is seen at once).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["Spread", "Trace", "TraceRow", "format_spread", "hardware", "spread"]


@dataclass(frozen=True)
class TraceRow:
    """One step (or pruning stage) of a trace.

    Attributes:
        step: The optimizer step (or stage index) the values belong to.
        values: Per layer, in layer order, the statistic's value.
        extra: Optional per-row side facts (e.g. the loss, the sparsity reached).
    """

    step: int
    values: list[float]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trace:
    """One case's recording.

    Attributes:
        case: The case's name (``"pruning"``, ``"sparse_attention"``, ...).
        statistic: What :attr:`TraceRow.values` measure, in words.
        unit: Their unit.
        model: The model the trace comes from.
        recipe: How the trained state was reached and what was measured (learning rate, steps, shapes).
        command: The exact command that wrote the file.
        date: UTC date of the recording (``YYYY-MM-DD``).
        hardware: Where it ran.
        rows: Per step, per layer values.
        findings: Plain statements about the trace (e.g. where it comes out nearly uniform).
    """

    case: str
    statistic: str
    unit: str
    model: str
    recipe: str
    command: str
    date: str
    hardware: str
    rows: list[TraceRow] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)

    def add(self, row: TraceRow) -> None:
        """Append ``row`` and print one progress line (a recording takes minutes)."""
        self.rows.append(row)
        facts = " ".join(f"{k}={v}" for k, v in row.extra.items() if isinstance(v, (int, float)))
        print(
            f"[{self.case}] step {row.step}: mean {sum(row.values) / len(row.values):.4g} {facts}", flush=True
        )

    def to_json(self) -> str:
        """The file's text; floats rounded to 5 significant digits to keep it small."""
        data = asdict(self)
        for row in data["rows"]:
            row["values"] = [float(f"{v:.5g}") for v in row["values"]]
        return json.dumps(data, indent=1) + "\n"

    def write(self, folder: Path) -> Path:
        """Write ``<case>-<date>.json`` under ``folder``; returns the path."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.case}-{self.date}.json"
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, path: Path) -> Trace:
        """Load a file written by :meth:`write`."""
        data = json.loads(path.read_text())
        data["rows"] = [TraceRow(**row) for row in data["rows"]]
        return cls(**data)


@dataclass(frozen=True)
class Spread:
    """Min / median / max of a list of values, and max/min (``inf`` when min is 0)."""

    low: float
    median: float
    high: float

    @property
    def ratio(self) -> float:
        """``high / low``: 1.0 means uniform."""
        return self.high / self.low if self.low > 0 else float("inf")


def _spread(values: list[float]) -> Spread:
    return Spread(min(values), statistics.median(values), max(values))


def spread(trace: Trace) -> tuple[list[Spread], Spread]:
    """Per row, the spread across layers; and the spread across layers of each layer's mean over rows."""
    if not trace.rows:
        raise ValueError(f"Trace {trace.case!r} has no rows: nothing was recorded.")
    per_row = [_spread(row.values) for row in trace.rows]
    num_layers = len(trace.rows[0].values)
    means = [statistics.fmean(row.values[i] for row in trace.rows) for i in range(num_layers)]
    return per_row, _spread(means)


def format_spread(trace: Trace) -> str:
    """Lines to print: one per row (min / median / max across layers), then the whole run's."""
    per_row, overall = spread(trace)
    lines = [f"{trace.case}: {trace.statistic} [{trace.unit}], across {len(trace.rows[0].values)} layers"]
    for row, s in zip(trace.rows, per_row, strict=True):
        lines.append(f"  step {row.step:4d}: min {s.low:.4g}  median {s.median:.4g}  max {s.high:.4g}")
    lines.append(
        f"  per-layer mean over {len(trace.rows)} rows: min {overall.low:.4g}  median {overall.median:.4g}  "
        f"max {overall.high:.4g}  (max/min {overall.ratio:.3g})"
    )
    return "\n".join(lines)


def hardware() -> str:
    """The machine in words: CPU, cores visible, torch build."""
    return (
        f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores visible "
        f"({torch.get_num_threads()} torch threads), torch {torch.__version__}"
    )
