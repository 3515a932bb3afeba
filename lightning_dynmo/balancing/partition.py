"""Exact min-max contiguous partition of layers over pipeline stages.

Read in this order: :func:`partition` (the entry point most code wants), :func:`solve_partition` (the
same search, returning the optimal bottleneck and per-stage loads too), then ``_search`` (the exact
search) and ``_memory_error`` (what we say when nothing fits).

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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_dynmo.balancing import feasibility
from lightning_dynmo.balancing._checks import (
    CommTime,
    MemoryCapacity,
    check_extras,
    check_num_stages,
    comm_rows,
    memory_caps,
)
from lightning_dynmo.balancing._checks import stage_slowdown as check_slowdown
from lightning_dynmo.balancing.costs import LayerCost, check_costs, check_view
from lightning_dynmo.balancing.placement import Placement
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


def partition(
    costs: Sequence[LayerCost],
    num_stages: int,
    by: str = "time",
    memory_capacity_bytes: MemoryCapacity = None,
    first_stage_extra: LayerCost | None = None,
    last_stage_extra: LayerCost | None = None,
    comm_time_s: CommTime = None,
    stage_slowdown: Sequence[float] | None = None,
) -> Placement:
    """The placement over ``num_stages`` stages whose heaviest stage is as light as possible.

    Args:
        costs: One record per layer, in layer order, measured on (or scaled to) the reference worker.
        num_stages: Number of stages, ``1 <= num_stages <= len(costs)``; every stage gets >= 1 layer.
        by: ``"time"`` (forward + backward seconds) or ``"params"`` (parameter count).
        memory_capacity_bytes: ``None`` (unlimited), one capacity for every stage, or one per stage.
            A stage's memory (its layers' ``memory_bytes`` plus any extra it holds) must fit.
        first_stage_extra: Fixed cost pinned to stage 0, e.g. the embedding. Its weight under ``by``
            adds to stage 0's load and its ``memory_bytes`` to stage 0's memory.
        last_stage_extra: Same for the last stage (final norm, head, loss).
        comm_time_s: Activation send time, only with ``by="time"``: one number (every layer, every
            link), one number per layer (entry ``i`` is the time to send layer ``i``'s output to the
            next stage, on every link), or one row per link (row ``s``: stage ``s`` -> ``s + 1``) of
            one number per layer, when links differ. It is paid only where a stage ends (not by the
            last stage), and it is added to the *sending* stage's load, which is busy until the send
            completes.
        stage_slowdown: Per stage, how many times longer its worker takes than the reference worker
            the costs are expressed in (1.0 = the reference, 2.0 = half as fast); it scales the
            stage's layers and extras. ``None``: every worker is the reference.

    Returns:
        The optimal placement. When several placements are optimal, which one is returned is
        deterministic (same input, same answer on every rank) but not otherwise specified.

    Raises:
        ValueError: on bad input, or if no placement fits memory (the message gives the smallest
            possible overflow in bytes and the stage that overflows).
    """
    return solve_partition(
        costs,
        num_stages,
        by,
        memory_capacity_bytes,
        first_stage_extra,
        last_stage_extra,
        comm_time_s,
        stage_slowdown,
    ).placement


def solve_partition(
    costs: Sequence[LayerCost],
    num_stages: int,
    by: str = "time",
    memory_capacity_bytes: MemoryCapacity = None,
    first_stage_extra: LayerCost | None = None,
    last_stage_extra: LayerCost | None = None,
    comm_time_s: CommTime = None,
    stage_slowdown: Sequence[float] | None = None,
) -> PartitionResult:
    """Like :func:`partition`, but also return the optimal bottleneck, stage loads and memory."""
    model = build_model(
        costs,
        num_stages,
        by,
        memory_capacity_bytes,
        first_stage_extra,
        last_stage_extra,
        comm_time_s,
        stage_slowdown,
    )
    placement = _search(model)
    loads = model.loads(placement)
    return PartitionResult(placement, max(loads), loads, model.memories(placement))


def build_model(
    costs: Sequence[LayerCost],
    num_stages: int,
    by: str = "time",
    memory_capacity_bytes: MemoryCapacity = None,
    first_stage_extra: LayerCost | None = None,
    last_stage_extra: LayerCost | None = None,
    comm_time_s: CommTime = None,
    stage_slowdown: Sequence[float] | None = None,
) -> StageModel:
    """Validate the arguments of :func:`partition` and build its :class:`StageModel`."""
    check_costs(costs)
    check_view(by)
    check_num_stages(num_stages, len(costs))
    caps = memory_caps(memory_capacity_bytes, num_stages)
    check_extras(first_stage_extra, last_stage_extra)
    comm = comm_rows(comm_time_s, len(costs), num_stages, by)
    slowdown = check_slowdown(stage_slowdown, num_stages)
    return StageModel.build(costs, num_stages, by, caps, first_stage_extra, last_stage_extra, comm, slowdown)


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
