"""How much a rebalance could still gain, bounded from the measured per-stage busy times.

Moving layers between the same stages keeps their total work, so the busiest stage cannot get below the
mean load: no placement is faster than ``1 - mean / max`` of the loads (the *headroom*). When the
headroom is below the smallest gain a rebalance must promise (``min_gain``), profiling the layers and
running the balancer cannot lead anywhere, and an every-step callback may skip both for that step
(:class:`~lightning_dynmo.DynMoCallback`'s ``skip_balanced``).

One step's busy times are a noisy sample, so the bound reads a running mean of them
(:class:`StageLoadAverage`), restarted whenever the loads stop describing the pipeline (a new placement,
a dynamism event).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StageLoadAverage", "headroom"]


def headroom(loads: Sequence[float]) -> float:
    """``1 - mean / max`` of per-stage loads: the largest fraction of the busiest stage's time a rebalance
    of the same stages could save (0 for balanced or all-zero loads).

    Raises:
        ValueError: No loads, or a negative or non-finite one.
    """
    values = [float(x) for x in loads]
    if not values or any(not 0.0 <= x < float("inf") for x in values):
        raise ValueError(f"loads={list(loads)!r} must be one finite number >= 0 per stage.")
    peak = max(values)
    return 0.0 if peak == 0.0 else 1.0 - sum(values) / len(values) / peak


class StageLoadAverage:
    """Exponential moving average of per-stage busy times, restarted when the pipeline changes.

    Args:
        weight: Weight of the history in ``[0, 1)``; 0 keeps only the last step.

    Every rank must feed the same numbers (the all-gathered busy times) so that every rank reads the
    same :attr:`headroom` and takes the same decision.
    """

    def __init__(self, weight: float) -> None:
        if not 0.0 <= weight < 1.0:
            raise ValueError(f"weight={weight!r} must lie in [0, 1).")
        self.weight = weight
        self._loads: list[float] | None = None

    def update(self, loads: Sequence[float]) -> None:
        """Feed one step's per-stage busy seconds; a different stage count restarts the average."""
        values = [float(x) for x in loads]
        headroom(values)  # validates
        if self._loads is None or len(self._loads) != len(values):
            self._loads = values
            return
        w = self.weight
        self._loads = [w * old + (1.0 - w) * new for old, new in zip(self._loads, values, strict=True)]

    def restart(self) -> None:
        """Forget the history: the loads no longer describe the pipeline."""
        self._loads = None

    @property
    def loads(self) -> list[float] | None:
        """The averaged loads, or ``None`` before the first step since the last restart."""
        return None if self._loads is None else list(self._loads)

    @property
    def headroom(self) -> float | None:
        """:func:`headroom` of the averaged loads, or ``None`` when nothing was fed since the last restart."""
        return None if self._loads is None else headroom(self._loads)
