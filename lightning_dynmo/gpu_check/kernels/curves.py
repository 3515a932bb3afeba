"""The cost curves of a kernel check's JSON, for the projection and the replay to read.

:func:`read_cost_curves` turns ``kernels.json`` (written by ``python -m lightning_dynmo.gpu_check.kernels``)
into one :class:`CostCurve` per case: a block's forward + backward milliseconds at measured values of
the case's statistic (active tiles, processed or active tokens, trainable share). :meth:`CostCurve.ms_at`
interpolates linearly between measured points and refuses to extrapolate, so a projection never
invents a cost outside what was measured.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CostCurve", "read_cost_curves"]


@dataclass(frozen=True)
class CostCurve:
    """One case's block cost against its statistic, measured on one device.

    Attributes:
        case: The curve's name in the JSON (``"mod"``, ``"early_exit"``, ``"sparse_attention"``, ...).
        statistic: What the points are measured against (e.g. ``"processed_fraction"``).
        points: ``(statistic value, median milliseconds)``, ascending in the statistic.
        device: The device's name as the JSON records it.
    """

    case: str
    statistic: str
    points: tuple[tuple[float, float], ...]
    device: str

    def ms_at(self, value: float) -> float:
        """The block's milliseconds at ``value``, interpolated linearly between measured points.

        Raises:
            ValueError: ``value`` outside the measured range (no extrapolation).
        """
        xs = [x for x, _ in self.points]
        if not xs or not xs[0] <= value <= xs[-1]:
            raise ValueError(
                f"CostCurve({self.case!r}).ms_at({value}): {self.statistic} was measured on "
                f"[{xs[0] if xs else '-'}, {xs[-1] if xs else '-'}] only; measure the value or clamp it."
            )
        right = bisect.bisect_left(xs, value)
        if xs[right] == value:
            return self.points[right][1]
        (x0, y0), (x1, y1) = self.points[right - 1], self.points[right]
        return y0 + (y1 - y0) * (value - x0) / (x1 - x0)


def read_cost_curves(path: Path | str) -> dict[str, CostCurve]:
    """The cost curves of ``path`` (a ``kernels.json``), by case.

    Raises:
        ValueError: the JSON has no successful ``cost_curves`` part.
    """
    report = json.loads(Path(path).read_text())
    part = report.get("parts", {}).get("cost_curves", {})
    if not part.get("ok"):
        raise ValueError(
            f"{path} has no measured cost curves (cost_curves part: "
            f"{part.get('error') or part.get('skipped') or 'missing'}); rerun the kernel check on a GPU."
        )
    devices = report.get("device", {}).get("devices") or [{"name": "cpu"}]
    device = str(devices[0]["name"])
    curves = {}
    for case, curve in part["result"].items():
        if "statistic" in curve:
            curves[case] = _curve(case, curve, device)
    return curves


def _curve(case: str, curve: dict[str, Any], device: str) -> CostCurve:
    statistic = curve["statistic"]
    points = sorted((float(p[statistic]), float(p["median_ms"])) for p in curve["points"])
    return CostCurve(case, statistic, tuple(points), device)
