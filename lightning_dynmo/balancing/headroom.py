"""How much a rebalance could still gain, bounded from the measured per-stage busy times.

Moving layers between the same stages keeps their total work, so the busiest stage cannot get below the
mean load: no placement is faster than ``1 - mean / max`` of the loads (the *headroom*). When the
headroom is below the smallest gain a rebalance must promise (``min_gain``), profiling the layers and
running the balancer cannot lead anywhere, and an every-step callback may skip both for that step
(:class:`~lightning_dynmo.DynMoCallback`'s ``skip_balanced``).

When the busiest stage is the first or the last and holds one layer, no placement of whole layers helps
at all, whatever the headroom (:func:`pinned_bottleneck`).

One step's busy times are a noisy sample, so the bound reads a running mean of them
(:class:`StageLoadAverage`), restarted whenever the loads stop describing the pipeline (a new placement,
a dynamism event).

The headroom is a bound for a continuum of work; layers are discrete, so a pipeline can keep some
headroom that no placement of whole layers recovers. Once a decision on the profiled layers kept the
placement, the same decision follows as long as the stages' shares of the load stay where they were:
:attr:`StageLoadAverage.drift` measures how far they moved since that decision (:func:`share_drift`).
A decision that moved layers predicted how the new placement shares the load out; while the measured
shares stay that close to the prediction (:meth:`StageLoadAverage.restart` with ``expected``), a decision
on them would find the placement it just chose, and the same rule holds.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StageLoadAverage", "headroom", "pinned_bottleneck", "share_drift"]


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


def pinned_bottleneck(loads: Sequence[float], sizes: Sequence[int]) -> int | None:
    """The first or last stage when it is the busiest and holds a single layer, else ``None``.

    Every contiguous placement over the same stages keeps the first layer (and the embedding) on the
    first stage and the last layer (and the head and loss) on the last: such a stage already holds the
    least it can, on the same worker, so no placement of whole layers lightens the busiest stage. This
    holds whatever the workers' speeds, unlike :func:`headroom`'s mean, and whatever the other stages hold.
    A 49k-vocabulary head does this to a deep pipeline: its stage is the step, and only fewer stages
    (a re-pack) change anything.

    Args:
        loads: Per-stage busy seconds, one per pipeline position.
        sizes: Layers per stage; another count than ``loads`` (several stages per rank) gives ``None``.
    """
    headroom(loads)  # validates
    if len(sizes) != len(loads) or len(loads) < 2:
        return None
    busiest = max(range(len(loads)), key=lambda s: float(loads[s]))
    return busiest if busiest in (0, len(loads) - 1) and sizes[busiest] == 1 else None


def share_drift(before: Sequence[float], after: Sequence[float]) -> float:
    """How far the stages' shares of the total load moved, relative to the busiest stage's share before.

    ``max_s |after_s / sum(after) - before_s / sum(before)| / max_s (before_s / sum(before))``: 0 when
    every stage keeps its share, whatever the total (a slower or faster step that scales every stage
    alike does not count). All-zero loads count as equal shares.

    Raises:
        ValueError: Loads of different stage counts, or a load that :func:`headroom` refuses.
    """
    headroom(before), headroom(after)  # validates both
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} stages and after {len(after)}: compare one pipeline.")

    def shares(loads: Sequence[float]) -> list[float]:
        total = float(sum(loads))
        return [1.0 / len(loads)] * len(loads) if total == 0.0 else [float(x) / total for x in loads]

    old, new = shares(before), shares(after)
    return max(abs(a - b) for a, b in zip(new, old, strict=True)) / max(old)


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
        self._marked: list[float] | None = None

    def update(self, loads: Sequence[float]) -> None:
        """Feed one step's per-stage busy seconds; a different stage count restarts the average."""
        values = [float(x) for x in loads]
        headroom(values)  # validates
        if self._loads is None or len(self._loads) != len(values):
            if self._loads is not None:
                self._marked = None  # another pipeline: the mark described the old one
            self._loads = values
            return
        w = self.weight
        self._loads = [w * old + (1.0 - w) * new for old, new in zip(self._loads, values, strict=True)]

    def restart(self, expected: Sequence[float] | None = None) -> None:
        """Forget the history: the loads no longer describe the pipeline.

        Args:
            expected: The loads predicted for the pipeline from now on (a decision that moved layers: its
                prediction of the new placement), marked in place of measured ones; ``None``: no mark.
        """
        self._loads = None
        self._marked = None
        if expected is not None:
            values = [float(x) for x in expected]
            headroom(values)  # validates
            self._marked = values

    def stale(self) -> None:
        """Forget the averaged loads but keep the mark: the model changed (a dynamism event), so the loads
        are measured afresh, and :attr:`drift` then says whether the change moved the stages' shares away
        from where the last decision left them."""
        self._loads = None

    def mark(self) -> None:
        """Remember the averaged loads as they are now (a decision on them kept the placement)."""
        self._marked = self.loads

    @property
    def marked(self) -> bool:
        """Whether a decision left a mark that :attr:`drift` compares with (cleared by :meth:`restart`)."""
        return self._marked is not None

    @property
    def loads(self) -> list[float] | None:
        """The averaged loads, or ``None`` before the first step since the last restart."""
        return None if self._loads is None else list(self._loads)

    @property
    def headroom(self) -> float | None:
        """:func:`headroom` of the averaged loads, or ``None`` when nothing was fed since the last restart."""
        return None if self._loads is None else headroom(self._loads)

    @property
    def drift(self) -> float | None:
        """:func:`share_drift` from the marked loads to the averaged ones; ``None`` without both (a restart
        or another stage count clears the mark) or when their stage counts differ."""
        if self._marked is None or self._loads is None or len(self._marked) != len(self._loads):
            return None
        return share_drift(self._marked, self._loads)
