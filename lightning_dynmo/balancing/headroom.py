"""How much a rebalance could still gain, bounded from the measured per-stage busy times.

Moving layers between the same stages keeps their total work, so the busiest stage cannot get below the
mean load: no placement is faster than ``1 - mean / max`` of the loads (the *headroom*). When the
headroom is below the smallest gain a rebalance must promise (``min_gain``), profiling the layers and
running the balancer cannot lead anywhere, and an every-step callback may skip both for that step
(:class:`~lightning_dynmo.DynMoCallback`'s ``skip_balanced``).

A worker that runs only end stages (the first, the last, or both in a V) holding one layer each cannot
be lightened by any placement of whole layers (:func:`pinned_workers`): when it is the busiest, nothing
helps, whatever the headroom (:func:`pinned_bottleneck`); when it is within ``min_gain`` of the busiest,
no placement gains ``min_gain`` (:func:`pinned_headroom`).

One step's busy times are a noisy sample, so the bound reads a running mean of them
(:class:`StageLoadAverage`, bias-corrected: :class:`~lightning_dynmo.balancing.averaging.HistoryWeight`),
restarted whenever the loads stop describing the pipeline (a new placement,
a dynamism event).

The headroom is a bound for a continuum of work; layers are discrete, so a pipeline can keep some
headroom that no placement of whole layers recovers. Once a decision on the profiled layers kept the
placement, the same decision follows as long as the stages' shares of the load stay where they were:
:attr:`StageLoadAverage.drift` measures how far they moved since that decision (:func:`share_drift`).
A decision that moved layers predicted how the new placement shares the load out; while the measured
shares stay that close to the prediction (:meth:`StageLoadAverage.restart` with ``expected``), a decision
on them would find the placement it just chose, and the same rule holds. The prediction carries the
step model's own error, so once the move's measured gain confirms it, the callback marks the shares the
move achieved instead (:meth:`StageLoadAverage.mark`).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_dynmo.balancing.averaging import HistoryWeight

__all__ = [
    "StageLoadAverage",
    "headroom",
    "pinned_bottleneck",
    "pinned_headroom",
    "pinned_workers",
    "share_drift",
]


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


def pinned_workers(sizes: Sequence[int], stage_workers: Sequence[int] | None = None) -> tuple[int, ...]:
    """The workers no placement of whole layers over the same stages can lighten: those that run only end
    stages (the first, the last) each holding one layer.

    Every contiguous placement over the same stages keeps the first layer (and the embedding) on the
    first stage and the last layer (and the head and loss) on the last: such a stage already holds the
    least it can, on the same worker. One stage a rank, that is the first or the last rank; two stages a
    rank in a V (``ZBVZeroBubble``), the first rank runs both end stages; interleaved, no rank runs only
    end stages.

    Args:
        sizes: Layers per stage.
        stage_workers: The worker of every stage; ``None``: stage ``s`` on worker ``s``.

    Raises:
        ValueError: ``stage_workers`` not one worker per stage.
    """
    workers = range(len(sizes)) if stage_workers is None else stage_workers
    if len(workers) != len(sizes) or any(w < 0 for w in workers):
        raise ValueError(
            f"stage_workers={list(workers)!r} must name one worker >= 0 for each of the {len(sizes)} stages."
        )
    ends = (0, len(sizes) - 1)
    runs: dict[int, list[int]] = {}
    for stage, worker in enumerate(workers):
        runs.setdefault(worker, []).append(stage)
    return tuple(sorted(w for w, stages in runs.items() if all(s in ends and sizes[s] == 1 for s in stages)))


def _mapped(loads: Sequence[float], sizes: Sequence[int], stage_workers: Sequence[int] | None) -> bool:
    """Whether ``loads`` are one per worker of ``stage_workers`` (validated), so pinned workers apply."""
    headroom(loads)  # validates
    if stage_workers is None:
        return len(sizes) == len(loads)  # else several stages a rank, and no map from loads to stages
    if len(stage_workers) != len(sizes) or any(not 0 <= w < len(loads) for w in stage_workers):
        raise ValueError(
            f"stage_workers={list(stage_workers)!r} must name one worker in [0, {len(loads)}) for each of "
            f"the {len(sizes)} stages."
        )
    return True


def pinned_bottleneck(
    loads: Sequence[float], sizes: Sequence[int], stage_workers: Sequence[int] | None = None
) -> int | None:
    """The busiest worker when it is pinned (:func:`pinned_workers`), else ``None``.

    No placement of whole layers lightens it, whatever the workers' speeds (unlike :func:`headroom`'s
    mean) and whatever the other stages hold. A 49k-vocabulary head does this to a deep pipeline: its
    stage is the step, and only fewer stages (a re-pack) change anything.

    Args:
        loads: Busy seconds of each worker (pipeline rank).
        sizes: Layers per stage.
        stage_workers: The worker of every stage; ``None``: stage ``s`` on worker ``s`` (then another
            count of ``loads`` than of ``sizes`` gives ``None``: the loads cannot be mapped to stages).

    Raises:
        ValueError: ``stage_workers`` not one worker in ``range(len(loads))`` per stage, or a load that
            :func:`headroom` refuses.
    """
    if not _mapped(loads, sizes, stage_workers) or len(loads) < 2:
        return None
    busiest = max(range(len(loads)), key=lambda w: float(loads[w]))
    return busiest if busiest in pinned_workers(sizes, stage_workers) else None


def pinned_headroom(
    loads: Sequence[float], sizes: Sequence[int], stage_workers: Sequence[int] | None = None
) -> float:
    """:func:`headroom` with the pinned workers' loads as a floor: ``1 - max(mean, pinned) / max``.

    No placement brings the busiest worker below the mean load, nor below the load of a worker it cannot
    lighten (:func:`pinned_workers`). 0 when a pinned worker is the busiest (:func:`pinned_bottleneck`);
    the plain headroom when no worker is pinned or the loads cannot be mapped to stages.

    Args:
        loads: Busy seconds of each worker (pipeline rank).
        sizes: Layers per stage.
        stage_workers: The worker of every stage; ``None``: stage ``s`` on worker ``s``.

    Raises:
        ValueError: as :func:`pinned_bottleneck`.
    """
    room = headroom(loads)
    if not _mapped(loads, sizes, stage_workers) or len(loads) < 2:
        return room
    floor = max((float(loads[w]) for w in pinned_workers(sizes, stage_workers)), default=0.0)
    peak = max(float(x) for x in loads)
    return room if peak == 0.0 else min(room, 1.0 - floor / peak)


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

    Bias-corrected (:class:`~lightning_dynmo.balancing.averaging.HistoryWeight`): the first step after a
    restart weighs no more than the steps after it.

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
        self._history = HistoryWeight(weight)  # one sample a step

    def update(self, loads: Sequence[float]) -> None:
        """Feed one step's per-stage busy seconds; a different stage count restarts the average."""
        values = [float(x) for x in loads]
        headroom(values)  # validates
        if self._loads is None or len(self._loads) != len(values):
            if self._loads is not None:
                self._marked = None  # another pipeline: the mark described the old one
            self._history.restart()
            self._history.next()
            self._loads = values
            return
        w = self._history.next()
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
