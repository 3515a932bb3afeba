"""Exact min-max contiguous partition of layers over pipeline stages.

Read in this order: :func:`partition` (the entry point most code wants, given a
:class:`~lightning_dynmo.balancing.problem.BalanceProblem`), :func:`solve_partition` (the same search,
returning the optimal bottleneck and per-stage loads too), then ``_search`` (the exact search) and
``_memory_error`` (what we say when nothing fits).

The search: the optimal bottleneck is one of the loads a stage can have. We keep a lower bound ``lo``
(never above the optimum) and an achieved bottleneck ``hi`` (a real placement's heaviest stage), probe
the midpoint, and snap: a feasible probe returns a placement whose heaviest stage becomes the new ``hi``;
an infeasible one lifts ``lo`` to the smallest achievable load above the midpoint
(:func:`feasibility.next_candidate`). The two meet on the optimum in a few dozen probes, with no
epsilon: the answer is an achieved placement and nothing cheaper exists.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import numpy as np

from lightning_dynmo.balancing import feasibility
from lightning_dynmo.balancing._checks import check_num_stages
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem, takes_problem
from lightning_dynmo.balancing.stage_model import StageModel

log = logging.getLogger(__name__)

_MAX_PROBES = 400  # the search needs ~2 log2(n) probes; this only guards against a rounding loop


@dataclass(frozen=True)
class PartitionResult:
    """An optimal placement and what it costs.

    Attributes:
        placement: The placement minimising the heaviest stage.
        bottleneck: The heaviest stage's load (the optimum), extras and communication included.
        stage_loads: Every stage's load under the same model.
        stage_memory_bytes: Every stage's memory, extras included.
    """

    placement: Placement
    bottleneck: float
    stage_loads: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]


@takes_problem
def partition(problem: BalanceProblem, num_stages: int) -> Placement:
    """The placement over ``num_stages`` stages whose heaviest stage is as light as possible.

    What a stage's load and memory are (layers, pinned parts, worker slowdown, the send paid by the
    sending stage) is defined once, in :mod:`~lightning_dynmo.balancing.stage_model`.

    Args:
        problem: The costs, their view and the hardware. Stage ``s`` runs on worker ``s``:
            ``hardware.worker_slowdown`` and per-link ``comm_time_s`` rows, when given, have exactly one
            entry per stage and per link, and every stage's memory must fit its cap.
        num_stages: Number of stages, ``1 <= num_stages <= len(costs)``; every stage gets >= 1 layer.

    Returns:
        The optimal placement. When several placements are optimal, which one is returned is
        deterministic (same input, same answer on every rank) but not otherwise specified.

    Raises:
        ValueError: on bad input, or if no placement fits memory (the message gives the smallest
            possible overflow in bytes and the stage that overflows).
        TypeError: when called in the old shape (loose costs, or a keyword that moved into the problem).
    """
    return solve_partition(problem, num_stages).placement


@takes_problem
def solve_partition(problem: BalanceProblem, num_stages: int) -> PartitionResult:
    """Like :func:`partition`, but also return the optimal bottleneck, stage loads and memory."""
    check_num_stages(num_stages, problem.num_layers)
    model = StageModel.build(problem, num_stages)
    placement = _search(model)
    loads = model.loads(placement)
    return PartitionResult(placement, max(loads), loads, model.memories(placement))


def _search(model: StageModel) -> Placement:
    """The exact min-max search described in the module docstring."""
    bounds = feasibility.probe(model, math.inf)
    if bounds is None:
        raise _memory_error(model)
    best = Placement(bounds)
    hi = max(model.loads(best))
    lo = min(_lower_bound(model), hi)
    for _ in range(_MAX_PROBES):
        if lo >= hi:
            return best
        mid = lo + (hi - lo) / 2
        if not lo < mid < hi:
            mid = lo
        bounds = feasibility.probe(model, mid)
        if bounds is None:
            lo = feasibility.next_candidate(model, mid)
        else:
            best = Placement(bounds)
            hi = max(model.loads(best))
    log.warning("partition search stopped after %d probes; returning the best placement found", _MAX_PROBES)
    return best


def _lower_bound(model: StageModel) -> float:
    """A bottleneck no placement can beat: the work spread at every worker's speed, or the largest layer.

    Stage ``s`` can take at most ``(B - extra_s) / slowdown_s`` of the reference work under a bottleneck
    ``B`` (links only add), so ``B >= (W + sum(extra_s / slowdown_s)) / sum(1 / slowdown_s)``; and the
    largest layer costs at least its weight on the fastest worker.
    """
    largest = float(np.max(np.diff(model.prefix_load)))
    total = float(model.prefix_load[-1])
    if all(f == 1.0 for f in model.slowdown):
        return max((total + sum(model.extra_load)) / model.num_stages, largest)
    spread = (total + sum(e / f for e, f in zip(model.extra_load, model.slowdown, strict=True))) / sum(
        1.0 / f for f in model.slowdown
    )
    # A rounding hair above the optimum would make the search miss it: stay safely below.
    return max(spread, largest * min(model.slowdown)) * (1.0 - 1e-9)


def _memory_error(model: StageModel) -> ValueError:
    """Find the placement with the smallest worst-stage overflow and describe it."""

    def relaxed(allowance: float) -> tuple[int, ...] | None:
        caps = tuple(c + allowance for c in model.caps)
        return feasibility.probe(dataclasses.replace(model, caps=caps), math.inf)

    # Bisect the allowance added to every capacity: infeasible at lo, feasible at hi.
    lo, hi = 0.0, float(model.prefix_memory[-1]) + sum(model.extra_memory)
    best = relaxed(hi)
    assert best is not None, "any placement fits when every stage may hold all the memory"
    while hi - lo > max(1.0, 1e-9 * hi):
        mid = lo + (hi - lo) / 2
        found = relaxed(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    placement = Placement(best)
    over, stage = model.overflow(placement)
    return ValueError(
        f"memory_capacity_bytes={_caps_text(model.caps)} cannot be met with {model.num_stages} stages: the "
        f"best placement {placement} still overflows stage {stage} by {over:.0f} bytes "
        f"(needs {model.memories(placement)[stage]:.0f}, has {model.caps[stage]:.0f}). Raise the capacity, "
        "use more stages, or shrink the layers' memory."
    )


def _caps_text(caps: tuple[float, ...]) -> str:
    return f"{caps[0]:.0f}" if len(set(caps)) == 1 else "[" + ", ".join(f"{c:.0f}" for c in caps) + "]"
