"""Recorded dynamism as costs: a statistic trace, a cost curve, and the per-step cost trace they make.

Read in this order: :class:`StatisticTrace` (per recorded step and per layer, the statistic that sets a
layer's cost: active tokens, density, active tiles, expert load), :class:`CostCurve` (statistic -> one
layer's forward and backward seconds per step: a measured table or fit, or the *proportional* fallback
``time = dense time x statistic share``, labelled so), then :class:`CostTrace` (per step: every layer's
cost plus the first part, embedding, and the last part, final norm + head + loss) and
:meth:`CostTrace.mean_costs`, the costs averaged over many steps (a balance decided on one profiler
window of one step moves from run to run; the average over the run does not).

A trace keeps the model's real layer count: there is no stretching of a short profile into runs of
copies (that destroys alternating patterns such as MoD's routed/dense layers). Pure Python.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.hardware import Hardware
from lightning_dynmo.balancing.problem import BalanceProblem

#: The label of the fallback cost curve, repeated in every output that used it.
PROPORTIONAL = "proportional"


def _check_number(value: object, name: str) -> float:
    """``value`` as a float, or a ``ValueError`` naming it unless it is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name}={value!r} must be a finite number >= 0.")
    return float(value)


@dataclass(frozen=True)
class StatisticTrace:
    """Per recorded step and per layer, the statistic that sets the layer's cost.

    Attributes:
        case: The dynamic case (``"mod"``, ``"pruning"``, ...).
        statistic: What the values measure, in words.
        unit: Their unit.
        steps: The recorded step of each row.
        values: Per row, per layer (in layer order), the statistic's value (>= 0).
        source: Where the trace comes from (model, command), for reports.
    """

    case: str
    statistic: str
    unit: str
    steps: tuple[int, ...]
    values: tuple[tuple[float, ...], ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"trace {self.case!r} has no rows; record at least one step.")
        if len(self.steps) != len(self.values):
            raise ValueError(
                f"trace {self.case!r} has {len(self.steps)} steps but {len(self.values)} rows; give one "
                "step per row."
            )
        widths = sorted({len(row) for row in self.values})
        if len(widths) != 1 or widths[0] == 0:
            raise ValueError(
                f"trace {self.case!r} rows have {widths} layers; every row needs one value per layer of "
                "the same model."
            )
        values = tuple(
            tuple(_check_number(v, f"{self.case} row {r} layer {i}") for i, v in enumerate(row))
            for r, row in enumerate(self.values)
        )
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "steps", tuple(int(s) for s in self.steps))

    @property
    def num_layers(self) -> int:
        """Layers of the model (values per row)."""
        return len(self.values[0])

    @property
    def num_rows(self) -> int:
        """Recorded steps."""
        return len(self.values)

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> StatisticTrace:
        """A trace file's JSON object: ``case``, ``statistic``, ``unit``, ``rows`` (``step``, ``values``).

        That is the format ``benchmarks/results/traces/*.json`` is written in; ``model`` and ``command``
        become :attr:`source`.
        """
        missing = sorted({"case", "statistic", "unit", "rows"} - set(data))
        if missing:
            raise ValueError(
                f"trace record lacks {missing}; a trace file holds case, statistic, unit and rows."
            )
        rows = list(data["rows"])
        source = "; ".join(str(data[k]) for k in ("model", "command") if data.get(k))
        return cls(
            case=str(data["case"]),
            statistic=str(data["statistic"]),
            unit=str(data["unit"]),
            steps=tuple(int(row["step"]) for row in rows),
            values=tuple(tuple(row["values"]) for row in rows),
            source=source,
        )

    def uniform(self, value: float) -> StatisticTrace:
        """The same shape with every value ``value``: the model without the dynamism (e.g. density 1.0)."""
        row = (float(value),) * self.num_layers
        return dataclasses.replace(self, values=(row,) * self.num_rows, case=f"{self.case} (no dynamism)")

    def layer_means(self) -> list[float]:
        """Per layer, its mean over the rows."""
        return [statistics.fmean(row[i] for row in self.values) for i in range(self.num_layers)]


@dataclass(frozen=True)
class CostCurve:
    """Statistic -> one layer's forward and backward seconds per step, piecewise linear through points.

    Between points the curve interpolates; beyond the ends it extends its nearest segment (clamped at
    0 s), so a proportional curve stays proportional above the dense statistic (an expert above its
    average load). One point: a constant.

    Attributes:
        points: ``(statistic, fwd_s, bwd_s)`` triples, strictly increasing in statistic.
        label: How the curve was made (``"measured table"``, ``"linear fit, error 3%"``,
            :data:`PROPORTIONAL`); every report that uses it shows it.
    """

    points: tuple[tuple[float, float, float], ...]
    label: str

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("CostCurve needs at least one (statistic, fwd_s, bwd_s) point.")
        points = tuple(
            tuple(_check_number(v, f"points[{i}][{j}]") for j, v in enumerate(p))
            for i, p in enumerate(self.points)
        )
        if any(len(p) != 3 for p in points):
            raise ValueError(f"points={self.points!r} must be (statistic, fwd_s, bwd_s) triples.")
        xs = [p[0] for p in points]
        if any(b <= a for a, b in itertools.pairwise(xs)):
            raise ValueError(f"statistics {xs} must be strictly increasing; sort the points, one per value.")
        object.__setattr__(self, "points", points)

    @classmethod
    def proportional(cls, dense_fwd_s: float, dense_bwd_s: float, dense_statistic: float = 1.0) -> CostCurve:
        """The fallback: ``time = dense time x statistic / dense_statistic`` (labelled ``"proportional"``)."""
        if not _check_number(dense_statistic, "dense_statistic") > 0:
            raise ValueError("dense_statistic=0 must be > 0: the statistic of a layer without the dynamism.")
        return cls(((0.0, 0.0, 0.0), (dense_statistic, dense_fwd_s, dense_bwd_s)), PROPORTIONAL)

    @property
    def is_proportional(self) -> bool:
        """Whether this is the proportional fallback (not a measured curve)."""
        return self.label == PROPORTIONAL

    def at(self, value: float) -> tuple[float, float]:
        """Forward and backward seconds of a layer whose statistic is ``value``."""
        pts = self.points
        if len(pts) == 1:
            return pts[0][1], pts[0][2]
        i = min(max(bisect.bisect_right([p[0] for p in pts], value) - 1, 0), len(pts) - 2)
        (x0, f0, b0), (x1, f1, b1) = pts[i], pts[i + 1]
        t = (value - x0) / (x1 - x0)
        return max(0.0, f0 + t * (f1 - f0)), max(0.0, b0 + t * (b1 - b0))


@dataclass(frozen=True)
class StepCosts:
    """One step's costs (or an average of steps): every layer, the first part and the last part.

    Attributes:
        layers: Per layer, its cost for one whole step (all micro-batches).
        first: The first-stage part (embedding).
        last: The last-stage part (final norm, head and loss).
    """

    layers: tuple[LayerCost, ...]
    first: LayerCost
    last: LayerCost

    def problem(self, by: str = "time") -> BalanceProblem:
        """The balancing problem: these layers, the parts pinned to the first and last stage."""
        return BalanceProblem(self.layers, by=by, hardware=Hardware(self.first, self.last))

    @property
    def total_s(self) -> float:
        """Forward plus backward seconds of the whole step's work (layers and parts)."""
        return sum(c.time_s for c in self.layers) + self.first.time_s + self.last.time_s


@dataclass(frozen=True)
class CostTrace:
    """Per recorded step: every layer's cost and the parts', from a statistic trace and a cost curve.

    Attributes:
        case: The case the statistics come from.
        curve_label: The cost curve's label (:data:`PROPORTIONAL` for the fallback).
        steps: The recorded step of each row.
        rows: Per row, its :class:`StepCosts`.
    """

    case: str
    curve_label: str
    steps: tuple[int, ...]
    rows: tuple[StepCosts, ...]

    @classmethod
    def build(
        cls,
        statistics_trace: StatisticTrace,
        curve: CostCurve,
        first: LayerCost | None = None,
        last: LayerCost | None = None,
        num_params: Sequence[int] | None = None,
    ) -> CostTrace:
        """Cost every layer of every row through ``curve``; the parts cost the same every step.

        Args:
            statistics_trace: The recorded statistics.
            curve: Statistic -> a layer's seconds.
            first: The embedding's cost per step (``None``: free).
            last: The final norm, head and loss's cost per step (``None``: free).
            num_params: Parameters per layer (for the static parameter split); ``None``: all alike.
        """
        layers = statistics_trace.num_layers
        params = list(num_params) if num_params is not None else [1] * layers
        if len(params) != layers:
            raise ValueError(f"num_params has {len(params)} entries for {layers} layers; give one per layer.")
        rows = []
        for values in statistics_trace.values:
            timed = (curve.at(v) for v in values)
            costs = tuple(
                LayerCost(fwd_time_s=f, bwd_time_s=b, num_params=n)
                for (f, b), n in zip(timed, params, strict=True)
            )
            rows.append(StepCosts(costs, first or LayerCost(), last or LayerCost()))
        return cls(statistics_trace.case, curve.label, statistics_trace.steps, tuple(rows))

    @property
    def num_layers(self) -> int:
        """Layers of the model."""
        return len(self.rows[0].layers)

    @property
    def num_rows(self) -> int:
        """Recorded steps."""
        return len(self.rows)

    def mean_costs(self, window: range | None = None) -> StepCosts:
        """The costs averaged over the rows of ``window`` (``None``: every row): what a balance should see.

        Raises:
            ValueError: for a window with no row of this trace.
        """
        picked = [
            self.rows[r]
            for r in (window if window is not None else range(self.num_rows))
            if 0 <= r < self.num_rows
        ]
        if not picked:
            raise ValueError(
                f"window={window!r} holds no row of the {self.num_rows} rows of trace {self.case!r}."
            )
        layers = tuple(_mean([row.layers[i] for row in picked]) for i in range(self.num_layers))
        return StepCosts(layers, _mean([r.first for r in picked]), _mean([r.last for r in picked]))

    def scaled(self, factor: float) -> CostTrace:
        """Every time multiplied by ``factor`` (e.g. real seconds -> the emulated pipeline's seconds)."""
        _check_number(factor, "factor")

        def scale(c: LayerCost) -> LayerCost:
            return dataclasses.replace(
                c,
                fwd_time_s=c.fwd_time_s * factor,
                bwd_time_s=c.bwd_time_s * factor,
                bwd_weight_time_s=c.bwd_weight_time_s * factor,
                update_time_s=c.update_time_s * factor,
            )

        rows = tuple(
            StepCosts(tuple(scale(c) for c in r.layers), scale(r.first), scale(r.last)) for r in self.rows
        )
        return dataclasses.replace(self, rows=rows)


def _mean(costs: Sequence[LayerCost]) -> LayerCost:
    """The field-wise mean of ``costs`` (sizes rounded to whole numbers)."""
    return LayerCost(
        fwd_time_s=statistics.fmean(c.fwd_time_s for c in costs),
        bwd_time_s=statistics.fmean(c.bwd_time_s for c in costs),
        bwd_weight_time_s=statistics.fmean(c.bwd_weight_time_s for c in costs),
        update_time_s=statistics.fmean(c.update_time_s for c in costs),
        num_params=round(statistics.fmean(c.num_params for c in costs)),
        memory_bytes=round(statistics.fmean(c.memory_bytes for c in costs)),
        activation_bytes=round(statistics.fmean(c.activation_bytes for c in costs)),
    )
