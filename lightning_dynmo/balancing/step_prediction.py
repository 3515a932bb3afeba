"""The policy's step time of a placement under a schedule's own action lists, and the search it refines.

Read in this order: :class:`ScheduleOrder` (a schedule and the per-rank action lists it runs), then
:func:`predict_step` (costs + hardware + placement -> :class:`StepPrediction`, through
:class:`~lightning_dynmo.balancing.compiled_schedule.CompiledSchedule`, the step of
:func:`~lightning_dynmo.balancing.schedule_model.simulate_step` compiled once per action lists) and
:func:`step_at_least` (the same step, or a bound that shows it cannot beat a given one), then
:func:`per_action_s` and :func:`fit_per_op` (the runtime's own cost per action).

Why: the balancers minimise the heaviest stage (plus its sends). The step a schedule runs also has
a warm-up and a cool-down, first and last parts on particular ranks, several stages per rank under the
interleaved and V schedules, and a backward split into input and weight gradients under the zero-bubble
ones; two placements with the same heaviest stage can run at different speeds, and the placement with
the lightest heaviest stage need not be the fastest. :func:`refine` (re-exported from
:mod:`~lightning_dynmo.balancing.placement_search`) searches with this step as the cost.

Nothing here imports torch: the action lists come from the caller
(:func:`lightning_dynmo.pipeline.step.actions.schedule_actions` reads torch's schedules).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from lightning_dynmo.balancing.compiled_schedule import CompiledSchedule
from lightning_dynmo.balancing.hardware import StageCoster, StageRow, check_per_op
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.placement_search import SEARCH_BUDGET, Refinement, refine
from lightning_dynmo.balancing.problem import BalanceProblem
from lightning_dynmo.balancing.schedule_model import Action, StageTimes, simulate_step

__all__ = [
    "SEARCH_BUDGET",
    "ActionLists",
    "ActionTable",
    "Refinement",
    "ScheduleOrder",
    "StepPrediction",
    "StepPredictor",
    "fit_per_op",
    "per_action_s",
    "predict_step",
    "refine",
    "step_at_least",
]

#: ``(num_stages, num_microbatches)`` -> per pipeline rank, the actions it runs in one step.
ActionLists = Callable[[int, int], Sequence[Sequence[Action]]]


@dataclass(frozen=True)
class ActionTable:
    """Action lists computed ahead for some ``(num_stages, num_microbatches)`` shapes: an
    :data:`ActionLists` that pickles and needs no torch (a decision taken in a helper process,
    :mod:`~lightning_dynmo.balancing.background`). Built by :meth:`ScheduleOrder.tabled`."""

    name: str
    lists: Mapping[tuple[int, int], tuple[tuple[Action, ...], ...]]

    def __call__(self, num_stages: int, num_microbatches: int) -> Sequence[Sequence[Action]]:
        try:
            return self.lists[(num_stages, num_microbatches)]
        except KeyError:
            raise ValueError(
                f"the {self.name} action lists of {num_stages} stages and {num_microbatches} micro-batches "
                f"were not computed ahead (computed: {sorted(self.lists)}); pass that shape to "
                "ScheduleOrder.tabled()."
            ) from None


@dataclass(frozen=True)
class ScheduleOrder:
    """A pipelining schedule by name, with the action lists its ranks run.

    Attributes:
        name: The schedule's name, as the strategy's ``schedule`` (the micro-batch re-tune and the
            fallback simulator still take the name).
        actions: ``(num_stages, num_microbatches)`` -> per pipeline rank, its ``(stage, kind,
            micro_batch)`` actions in the order it runs them.
        weight_grad_share: Under schedules that split backward into input (``I``) and weight (``W``)
            gradients, the weight gradient's share of a stage's measured backward time (the profiler
            times the whole backward). 0.5: a linear layer's two gradient products cost the same.
    """

    name: str
    actions: ActionLists
    weight_grad_share: float = 0.5

    def __post_init__(self) -> None:
        share = self.weight_grad_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(
                f"weight_grad_share={share!r} must be a number in [0, 1]: the weight gradient's share of "
                "a stage's backward time."
            )
        if not callable(self.actions):
            raise ValueError(
                f"actions={self.actions!r} must be a callable (num_stages, num_microbatches) -> per-rank "
                "action lists, e.g. lightning_dynmo.pipeline.step.actions.schedule_actions bound to a name."
            )

    def tabled(self, shapes: Iterable[tuple[int, int]]) -> ScheduleOrder:
        """The same schedule with its action lists computed now for ``shapes`` (an :class:`ActionTable`).

        A shape the schedule refuses is left out; asking the table for it later raises ``ValueError``.
        """
        lists = {}
        for stages, microbatches in shapes:
            try:
                lists[(stages, microbatches)] = tuple(tuple(a) for a in self.actions(stages, microbatches))
            except ValueError:
                continue
        return dataclasses.replace(self, actions=ActionTable(self.name, lists))


@dataclass(frozen=True)
class StepPrediction:
    """A placement's simulated step.

    Attributes:
        step_s: The step time (the view's unit: seconds with ``by="time"``): the schedule's, plus the
            slowest stage's optimizer update
            (:attr:`~lightning_dynmo.balancing.hardware.StageCosts.update_s`).
        bubble_ratio: Idle share of all ranks over the schedule's part of the step.
        stage_loads: Per stage, forward + backward of one step (all micro-batches) on its worker.
    """

    step_s: float
    bubble_ratio: float
    stage_loads: tuple[float, ...]


def predict_step(
    problem: BalanceProblem,
    placement: Placement,
    order: ScheduleOrder,
    num_microbatches: int,
    stage_workers: Sequence[int] | None = None,
    per_op_s: float | None = None,
) -> StepPrediction:
    """Simulate one step of ``placement`` under ``order``'s action lists.

    Per stage and micro-batch: its layers' and pinned parts' forward and backward over
    ``num_microbatches``, times its worker's slowdown; under a split backward, ``I`` and ``W`` share the
    backward as measured (:attr:`~lightning_dynmo.balancing.costs.LayerCost.bwd_weight_time_s`), or by
    ``order.weight_grad_share`` where it was not, except on the first stage, whose whole backward torch
    runs in its ``W`` (its ``I`` costs only the action itself). A backward measured split costs
    :func:`~lightning_dynmo.balancing.hardware.whole_backward_ratio` times as much run whole on the
    first stage, and one measured whole costs its inverse split elsewhere (the ratio the problem's own
    records show; 1 where they cannot). A stage's activation send keeps it busy
    (it lengthens its forward, a synchronous transfer, as the balancers assume and as the profiler
    measures a link: a blocking send); stages on one rank exchange in memory and send nothing.

    Args:
        problem: Per-layer costs (whole steps), the view and the hardware.
        placement: The placement to predict.
        order: The schedule and its action lists.
        num_microbatches: Micro-batches per step.
        stage_workers: The worker of each stage, for the slowdowns (``None``: stage ``s`` on worker ``s``).
        per_op_s: Fixed seconds every action costs on top of its work (the runtime's own: launching it,
            its receives and sends, the schedule's bookkeeping), as measured on the machine; ``None``:
            the problem's :attr:`~lightning_dynmo.balancing.hardware.Hardware.per_op_s` (with
            ``by="time"``; 0 in the ``"params"`` view), a number replaces it.
    """
    predictor = StepPredictor(problem, order, num_microbatches, placement.num_stages, stage_workers, per_op_s)
    return predictor.predict(placement)


#: How far above ``time_s`` :func:`step_at_least`'s bound must reach before the simulation is skipped: more
#: than the rounding by which a sum of a rank's action times can exceed the step simulated from them.
_BOUND_MARGIN = 1e-9


def step_at_least(
    problem: BalanceProblem,
    placement: Placement,
    order: ScheduleOrder,
    num_microbatches: int,
    time_s: float,
    stage_workers: Sequence[int] | None = None,
    per_op_s: float | None = None,
) -> float:
    """:func:`predict_step`'s ``step_s``, or, when ``placement`` cannot be faster than ``time_s``, a number
    ``>= time_s`` found without simulating the schedule.

    A rank runs its actions one after another, so no step is shorter than the busiest rank's actions
    end to end (plus the update). When that alone reaches ``time_s``, it is returned: a search that only
    wants placements faster than its best so far (:func:`refine`'s ``at_least``) skips the simulation,
    most of a prediction's cost, for the many moves that load the busiest rank further.

    Args:
        time_s: The step to beat. Other arguments: as :func:`predict_step`.
    """
    predictor = StepPredictor(problem, order, num_microbatches, placement.num_stages, stage_workers, per_op_s)
    return predictor.at_least(placement, time_s)


class StepPredictor:
    """:func:`predict_step` and :func:`step_at_least` for many placements of one pipeline (a search's).

    Built once per problem, schedule, micro-batch count, stage count and workers. What the simulation
    needs of a stage (its costs, one micro-batch's action times, their duration slots) depends only on
    the stage and the run of layers it holds, so it is computed once per such run and reused by every
    placement that gives the stage the same run; a search's neighbouring placements share all but a few.
    The arithmetic is :func:`predict_step`'s (which builds one of these per call), so the numbers are too.

    Args:
        num_stages: The stages of every placement it will be asked about. Other arguments: as
            :func:`predict_step`.

    Raises:
        ValueError: as :func:`predict_step`, for bad ``per_op_s``, slowdowns, links or action lists.
    """

    def __init__(
        self,
        problem: BalanceProblem,
        order: ScheduleOrder,
        num_microbatches: int,
        num_stages: int,
        stage_workers: Sequence[int] | None = None,
        per_op_s: float | None = None,
    ) -> None:
        if per_op_s is None:
            per_op_s = problem.hardware.per_op_s if problem.by == "time" else 0.0
        check_per_op(per_op_s)
        self._coster = StageCoster.build(problem, num_stages, stage_workers)
        self._compiled = _compiled(order.actions(num_stages, num_microbatches), num_stages)
        self._order, self._num_microbatches, self._per_op_s = order, num_microbatches, per_op_s
        self._whole_to_split = problem.whole_to_split
        self._stages: dict[tuple[int, int, int], tuple[StageRow, list[float]]] = {}

    def predict(self, placement: Placement) -> StepPrediction:
        """:func:`predict_step` of ``placement``."""
        rows, durations = self._inputs(placement)
        step, busy = self._compiled.run(durations)
        ranks = len(busy)
        bubble = sum(step - b for b in busy) / (ranks * step) if step > 0 else 0.0
        step += max((row[5] for row in rows), default=0.0)  # the update: once, after the flush, all at once
        return StepPrediction(step, bubble, tuple(row[0] + row[1] for row in rows))

    def at_least(self, placement: Placement, time_s: float) -> float:
        """:func:`step_at_least` of ``placement`` against ``time_s``."""
        rows, durations = self._inputs(placement)
        update = max((row[5] for row in rows), default=0.0)
        bound = max(self._compiled.busy(durations), default=0.0) + update
        if bound >= time_s + abs(time_s) * _BOUND_MARGIN:
            return bound
        return self._compiled.end(durations) + update

    def _inputs(self, placement: Placement) -> tuple[list[StageRow], list[float]]:
        """Per stage its :class:`StageCoster` row, and the duration slots of all stages."""
        if placement.num_stages != self._coster.num_stages:
            raise ValueError(
                f"placement={placement} has {placement.num_stages} stages but this predictor was built for "
                f"{self._coster.num_stages}; build one per stage count."
            )
        b = placement.boundaries
        rows, durations = [], []
        for s in range(placement.num_stages):
            key = (s, b[s], b[s + 1])
            known = self._stages.get(key)
            if known is None:
                known = self._stages[key] = self._stage(*key)
            rows.append(known[0])
            durations += known[1]
        return rows, durations

    def _stage(self, stage: int, start: int, end: int) -> tuple[StageRow, list[float]]:
        """Stage ``stage`` holding layers ``start .. end - 1``: its costs and its duration slots."""
        row = self._coster.stage(stage, start, end)
        f, b, send, w, whole, _ = row
        rank_of, m, per_op_s = self._compiled.rank_of, self._num_microbatches, self._per_op_s
        sends = stage + 1 < len(rank_of) and rank_of[stage] != rank_of[stage + 1]
        fwd = f / m + (send if sends else 0.0) + per_op_s
        igrad, wgrad = _split_backward(
            stage, max(0.0, b - whole) / m, w / m, whole / m, self._order, self._whole_to_split
        )
        times = StageTimes(
            fwd, b / m + per_op_s, input_grad_s=igrad + per_op_s, weight_grad_s=wgrad + per_op_s
        )
        return row, self._compiled.stage_durations(stage, times)


#: Compiled action lists by the identity of the lists (kept alive beside them, so an id is never reused
#: while cached): a :class:`ScheduleOrder` built by ``schedule_order`` returns the same lists per shape.
_COMPILED: dict[int, tuple[Sequence[Sequence[Action]], CompiledSchedule]] = {}
_COMPILED_MAX = 32


def _compiled(actions: Sequence[Sequence[Action]], num_stages: int) -> CompiledSchedule:
    """``actions`` compiled once while the same lists come back (an order whose lists are rebuilt per
    call is compiled per call, which is correct and only slower)."""
    hit = _COMPILED.get(id(actions))
    if hit is not None and hit[0] is actions and hit[1].num_stages == num_stages:
        return hit[1]
    compiled = CompiledSchedule.build(actions, num_stages)
    if len(_COMPILED) >= _COMPILED_MAX:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[id(actions)] = (actions, compiled)
    return compiled


def _split_backward(
    stage: int, split: float, measured_w: float, whole: float, order: ScheduleOrder, whole_to_split: float
) -> tuple[float, float]:
    """The ``I`` and ``W`` parts of one micro-batch's backward on ``stage``, under a split-backward schedule.

    ``split`` is the backward of the stage's records measured split (``measured_w`` of it in weight
    passes, 0 where none was measured apart), ``whole`` that of the records measured whole (on a first
    stage). The first stage's input needs no gradient: torch's stage runs its whole backward in the
    ``W`` action (``backward_weight_one_chunk``), its ``I`` does nothing, and a backward measured split
    runs there ``whole_to_split`` times as long. On any other stage a backward measured whole runs
    ``1 / whole_to_split`` times as long, split by the schedule's share, as is a split one whose
    weight part was not measured apart.
    """
    if stage == 0:
        return 0.0, whole + whole_to_split * split
    share = order.weight_grad_share
    rewhole = whole / whole_to_split
    wgrad = (measured_w if measured_w > 0 else share * split) + share * rewhole
    return split + rewhole - wgrad, wgrad


def per_action_s(order: ScheduleOrder, num_stages: int, num_microbatches: int, overhead_s: float) -> float:
    """``overhead_s`` of a step spread over its schedule's actions: a ``per_op_s`` for :func:`predict_step`.

    ``overhead_s`` is what a step took beyond its layers' work (a step with no work, or a measured step
    minus its prediction without overhead); it is divided by the step of the same action lists with
    every action lasting 1 s (the actions on the step's longest chain, waits included).
    """
    actions = order.actions(num_stages, num_microbatches)
    unit = [StageTimes(1.0, 1.0, input_grad_s=1.0, weight_grad_s=1.0)] * num_stages
    return max(0.0, overhead_s) / simulate_step(actions, unit).step_time_s


def fit_per_op(
    problem: BalanceProblem,
    placement: Placement,
    order: ScheduleOrder,
    num_microbatches: int,
    measured_step_s: float,
    stage_workers: Sequence[int] | None = None,
    tolerance_s: float = 1e-9,
) -> float:
    """The ``per_op_s`` at which :func:`predict_step` of ``placement`` equals its measured step.

    What a step took beyond its layers' work, found where the runtime really ran it (the current
    placement, with its sleeps, its waits and the machine's load as they were), rather than on a step
    with no work, whose overhead differs (every rank busy at once, so the ranks queue for the cores).
    0 when the prediction without overhead already reaches the measured step. The step is
    non-decreasing in ``per_op_s``, so a bisection finds it to ``tolerance_s``.

    Raises:
        ValueError: if ``measured_step_s`` is not a finite positive number of seconds.
    """
    if isinstance(measured_step_s, bool) or not 0 < measured_step_s < math.inf:
        raise ValueError(f"measured_step_s={measured_step_s!r} must be a finite number of seconds > 0.")

    def step(per_op: float) -> float:
        return predict_step(problem, placement, order, num_microbatches, stage_workers, per_op).step_s

    if step(0.0) >= measured_step_s:
        return 0.0
    low, high = 0.0, per_action_s(order, placement.num_stages, num_microbatches, measured_step_s)
    while high - low > tolerance_s:  # step(high) >= measured: the actions' longest chain alone takes it
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) < measured_step_s else (low, middle)
    return (low + high) / 2
