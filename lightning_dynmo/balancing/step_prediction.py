"""The policy's step time of a placement under a schedule's own action lists, and the search it refines.

Read in this order: :class:`ScheduleOrder` (a schedule and the per-rank action lists it runs), then
:func:`predict_step` (costs + hardware + placement -> :class:`StepPrediction`, through
:func:`~lightning_dynmo.balancing.schedule_model.simulate_step`), then :func:`refine` (the best
contiguous placement under that model, from the balancer's proposal).

Why: the balancers minimise the heaviest stage (plus its sends). The step a schedule runs also has
a warm-up and a cool-down, first and last parts on particular ranks, several stages per rank under the
interleaved and V schedules, and a backward split into input and weight gradients under the zero-bubble
ones; two placements with the same heaviest stage can run at different speeds, and the placement with
the lightest heaviest stage need not be the fastest. :func:`refine` searches with the step itself as the
cost:

- **exact** when the stage count leaves at most ``budget`` contiguous placements (every placement is
  simulated: 8 layers on 2 stages are 7, 16 on 4 are 455);
- otherwise a **local search** from the balancer's proposal: move one boundary by one layer while that
  shortens the predicted step, at most ``budget`` simulations. Its guarantee is one-sided: the result
  is never predicted slower than the proposal (the balancer's own optimum), and it is a local optimum
  of single-boundary moves when the budget is not exhausted.

Placements that break a memory cap are never chosen. Nothing here imports torch: the action lists come
from the caller (:func:`lightning_dynmo.pipeline.step.actions.schedule_actions` reads torch's schedules).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_dynmo.balancing.hardware import check_per_op, stage_times
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem
from lightning_dynmo.balancing.schedule_model import Action, StageTimes, simulate_step
from lightning_dynmo.balancing.stage_model import StageModel

#: ``(num_stages, num_microbatches)`` -> per pipeline rank, the actions it runs in one step.
ActionLists = Callable[[int, int], Sequence[Sequence[Action]]]

#: Simulations :func:`refine` may run: exact up to this many contiguous placements, a bounded local
#: search beyond (a 2-stage, 8-micro-batch step simulates in well under a millisecond).
SEARCH_BUDGET = 2048


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
    if per_op_s is None:
        per_op_s = problem.hardware.per_op_s if problem.by == "time" else 0.0
    check_per_op(per_op_s)
    times = stage_times(problem, placement, stage_workers)
    actions = order.actions(placement.num_stages, num_microbatches)
    rank_of = {stage: rank for rank, acts in enumerate(actions) for stage, _, _ in acts}
    per_stage = []
    for s, (f, b, send, w, whole) in enumerate(
        zip(times.fwd_s, times.bwd_s, times.send_s, times.wgrad_s, times.whole_bwd_s, strict=True)
    ):
        sends = s + 1 < placement.num_stages and rank_of.get(s) != rank_of.get(s + 1)
        m = num_microbatches
        fwd = f / m + (send if sends else 0.0) + per_op_s
        igrad, wgrad = _split_backward(
            s, max(0.0, b - whole) / m, w / m, whole / m, order, problem.whole_to_split
        )
        per_stage.append(
            StageTimes(
                fwd,
                b / m + per_op_s,
                input_grad_s=igrad + per_op_s,
                weight_grad_s=wgrad + per_op_s,
            )
        )
    sim = simulate_step(actions, per_stage)
    ranks, step = len(sim.rank_busy_s), sim.step_time_s
    bubble = sum(sim.rank_idle_s) / (ranks * step) if step > 0 else 0.0
    step += max(times.update_s, default=0.0)  # the update: once, after the flush, every stage at once
    loads = tuple(f + b for f, b in zip(times.fwd_s, times.bwd_s, strict=True))
    return StepPrediction(step, bubble, loads)


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


@dataclass(frozen=True)
class Refinement:
    """What :func:`refine` found.

    Attributes:
        placement: The placement predicted fastest (the proposal on a tie).
        step_s: Its predicted step.
        proposal_step_s: The proposal's predicted step.
        exact: Whether every contiguous placement was simulated.
        simulations: How many steps were simulated.
    """

    placement: Placement
    step_s: float
    proposal_step_s: float
    exact: bool
    simulations: int

    def describe(self) -> str:
        """One phrase for the decision's reason."""
        how = "exact search" if self.exact else "local search"
        return f"{how} by the schedule's step ({self.simulations} simulated)"


def refine(
    problem: BalanceProblem,
    proposal: Placement,
    step_of: Callable[[Placement], float],
    budget: int = SEARCH_BUDGET,
) -> Refinement:
    """The contiguous placement of ``proposal``'s stage count predicted fastest by ``step_of``.

    Args:
        problem: The costs and hardware (its memory caps bound the candidates).
        proposal: The balancer's placement; the search never returns one predicted slower.
        step_of: A placement's predicted step (e.g. :func:`predict_step`'s ``step_s``).
        budget: The most simulations: exact search when there are at most this many placements.

    Raises:
        ValueError: for a budget below 1.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget={budget!r} must be an integer >= 1 (simulations the search may run).")
    stages, layers = proposal.num_stages, proposal.num_layers
    # Only its memory is read: links and worker speeds are the step's business (and may not fit a view).
    model = StageModel.build(problem.with_hardware(comm_time_s=None, worker_slowdown=None), stages)

    def fits(placement: Placement) -> bool:
        return model.overflow(placement)[0] <= 0

    start = step_of(proposal)
    count = math.comb(layers - 1, stages - 1)
    if count <= budget:
        best, best_s, runs = proposal, start, 1
        for cuts in itertools.combinations(range(1, layers), stages - 1):
            candidate = Placement((0, *cuts, layers))
            if candidate == proposal or not fits(candidate):
                continue
            runs += 1
            step = step_of(candidate)
            if step < best_s:
                best, best_s = candidate, step
        return Refinement(best, best_s, start, exact=True, simulations=runs)
    best, best_s, runs = proposal, start, 1
    improved = True
    while improved and runs < budget:
        improved = False
        for candidate in _neighbours(best):
            if runs >= budget:
                break
            if not fits(candidate):
                continue
            runs += 1
            step = step_of(candidate)
            if step < best_s:
                best, best_s, improved = candidate, step, True
    return Refinement(best, best_s, start, exact=False, simulations=runs)


def _neighbours(placement: Placement) -> list[Placement]:
    """Every placement one boundary of ``placement`` away by one layer, no stage left empty."""
    bounds = placement.boundaries
    out = []
    for i in range(1, len(bounds) - 1):
        for delta in (-1, 1):
            moved = bounds[i] + delta
            if bounds[i - 1] < moved < bounds[i + 1]:
                out.append(Placement((*bounds[:i], moved, *bounds[i + 1 :])))
    return out
