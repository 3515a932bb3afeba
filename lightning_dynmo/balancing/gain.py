"""What a rebalance gained, measured: step time right before it against step time right after it.

Read :class:`GainMeter` first, then :class:`MeasuredGain`.

"Before" must describe the model the rebalance acted on. Hook-free steps taken just before the
profiling window are the best measure (no profiler overhead), but only if the model did not change in
between: a dynamism event (the reason a window opens at the next step) makes them stale, and comparing
with them credits the rebalance with what the model change itself saved. So a cost change drops them,
and "before" is then the profiling window's own measured steps (the steps right before the rebalance;
their hook overhead is small next to the layers they time). "After" is the median of the steps that
follow, past a warm-up (the first steps on a rebuilt pipeline include shape inference).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

StepPhase = Literal["quiet", "warmup", "profiled"]
_PHASES = ("quiet", "warmup", "profiled")


@dataclass(frozen=True)
class MeasuredGain:
    """Median step seconds before and after one rebalance.

    Attributes:
        before_s: Median step time right before the rebalance.
        after_s: Median step time after it (warm-up steps excluded).
    """

    before_s: float
    after_s: float

    @property
    def gain(self) -> float:
        """``1 - after / before``: the fraction of step time the rebalance saved (negative: it cost)."""
        return 1.0 - self.after_s / self.before_s if self.before_s > 0 else 0.0


class GainMeter:
    """Follows step times around rebalances; fed the same numbers on every rank, it agrees everywhere.

    Per step, call :meth:`observe` with the step's time and its phase: ``"quiet"`` (no profiling hooks),
    ``"warmup"`` (a profiling window's warm-up step) or ``"profiled"`` (a measured window step). Call
    :meth:`window_opened` when a profiling window opens, :meth:`cost_changed` after observing a step in
    which the model's cost changed (a dynamism event), and :meth:`rebalanced` when a new placement is
    applied; :meth:`observe` then returns the :class:`MeasuredGain` once enough steps have run on it.

    Args:
        warmup_steps: Steps after a rebalance that are not counted (pipeline rebuild, shape inference).
        measure_steps: Steps measured after a rebalance (their median is "after"), >= 1.
        history: Most hook-free steps kept as "before", >= 1.
    """

    def __init__(self, *, warmup_steps: int, measure_steps: int, history: int) -> None:
        for name, value, low in (("warmup_steps", warmup_steps, 0), ("measure_steps", measure_steps, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}.")
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"history={history!r} must be an integer >= 1.")
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self._quiet: deque[float] = deque(maxlen=history)
        self._window: list[float] = []
        self._before_s: float | None = None
        self._after: list[float] = []

    @property
    def measuring(self) -> bool:
        """Whether a rebalance is being followed (its "after" steps are being collected)."""
        return self._before_s is not None

    def observe(self, step_s: float, phase: StepPhase) -> MeasuredGain | None:
        """Record one step; returns the gain of the last rebalance once its "after" steps are in."""
        if phase not in _PHASES:
            raise ValueError(f"phase={phase!r} must be one of {_PHASES}.")
        if self._before_s is not None:
            self._after.append(step_s)
            if len(self._after) < self.warmup_steps + self.measure_steps:
                return None
            measured = MeasuredGain(self._before_s, statistics.median(self._after[self.warmup_steps :]))
            self._before_s, self._after = None, []
            return measured
        if phase == "quiet":
            self._quiet.append(step_s)
        elif phase == "profiled":
            self._window.append(step_s)
        return None

    def quiet_step_s(self) -> float | None:
        """Median seconds of the hook-free steps since the last cost change or rebalance (``None``: none).

        The step of the placement now running as it runs without a profiler, on the model as it is; a
        window's steps (its hooks, a model that just changed) and a followed rebalance's steps do not
        count. Fed the same numbers on every rank, it agrees everywhere.
        """
        return statistics.median(self._quiet) if self._quiet else None

    def window_opened(self) -> None:
        """A profiling window starts: its steps replace the previous window's."""
        self._window.clear()

    def cost_changed(self) -> None:
        """The model's cost changed in the step just observed: earlier steps no longer describe it."""
        self._quiet.clear()
        self._window.clear()

    def rebalanced(self) -> bool:
        """A new placement was applied; returns whether there is a "before" to measure the gain against."""
        steps = list(self._quiet) or self._window
        self._quiet.clear()
        self._window = []
        self._after = []
        self._before_s = statistics.median(steps) if steps else None
        if self._before_s is not None and self._before_s <= 0:
            self._before_s = None
        return self._before_s is not None
