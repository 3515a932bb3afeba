"""Re-packing: consolidate the layers onto fewer stages so the rest can be released (paper 3.4, Alg. 4).

Read :func:`repack` first, then :class:`RepackResult`.

Differences from the paper's first-fit (Algorithm 4), and why:

* Kept stages are always the *lowest* current stage indices ``0..k-1`` and the released ones the
  highest ``k..S-1``, so rank 0 (which usually holds the embedding and logs) stays active and the
  kept stages keep their memory capacities (the first ``k`` of ``Hardware.memory_capacity_bytes``).
* Instead of merging neighbours first-fit, each candidate stage count ``k`` is solved exactly with
  :func:`partition` under the kept stages' memory caps, so the re-packed placement is the best balanced
  one, not merely the first that fits, and no layer is ever left on a stage it does not fit.
* The predicted step time is the *bottleneck* (the heaviest stage's load): in the steady state of a
  pipeline every micro-batch waits for the slowest stage. Fewer stages also shrink the fill/drain
  bubble, so this prediction is conservative for re-packing.
* Schedules with several stages per worker (interleaved, V) can only run some stage counts (a multiple
  of the stages per worker, a micro-batch count the schedule accepts): given ``layouts`` (each runnable
  count -> the worker of each stage), only those counts are proposed, each balanced per worker with
  :func:`~lightning_dynmo.balancing.partition_workers`, and the bottleneck is the heaviest *worker*.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_dynmo.balancing._checks import check_fraction, check_placement
from lightning_dynmo.balancing.partition import PartitionResult, solve_partition
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem, takes_problem
from lightning_dynmo.balancing.stage_model import StageModel
from lightning_dynmo.balancing.workers import partition_workers, worker_loads


@dataclass(frozen=True)
class RepackResult:
    """What :func:`repack` decided.

    Attributes:
        placement: The re-packed placement over ``num_stages`` stages (or ``current`` unchanged when no
            smaller pipeline meets ``max_slowdown``).
        released_stages: Current stage indices no longer used: ``num_stages .. current.num_stages - 1``.
        bottleneck: Heaviest stage load of ``placement`` (heaviest worker load, given ``layouts``).
        previous_bottleneck: Heaviest stage (worker) load of ``current``.
    """

    placement: Placement
    released_stages: tuple[int, ...]
    bottleneck: float
    previous_bottleneck: float

    @property
    def num_stages(self) -> int:
        """Stages kept."""
        return self.placement.num_stages

    @property
    def predicted_slowdown(self) -> float:
        """``bottleneck / previous_bottleneck - 1`` (0 when both are 0)."""
        if self.previous_bottleneck == 0:
            return 0.0
        return self.bottleneck / self.previous_bottleneck - 1.0


@takes_problem
def repack(
    problem: BalanceProblem,
    current: Placement | str,
    *,
    target_num_stages: int | None = None,
    max_slowdown: float = 0.05,
    layouts: Mapping[int, Sequence[int]] | None = None,
) -> RepackResult:
    """Move all layers onto the first ``k`` current stages and release the others.

    How ``k`` is chosen and balanced, and why, is described once, in this module's docstring.

    Args:
        problem: The costs, their view (both the bottleneck and the balance use it) and the hardware of
            the *current* stages: kept stage ``s`` keeps its memory cap, its worker's slowdown and its
            link (``memory_capacity_bytes``: one for every stage or one per current stage; ``None`` is
            unlimited). The last-stage extra moves to the last *kept* stage. Per-link ``comm_time_s``
            rows do not go with ``layouts``, unless the same on every link.
        current: The placement in use (or its string form).
        target_num_stages: Reach exactly this many stages (``1 .. current.num_stages``) or raise.
            Without it, choose the fewest stages whose bottleneck stays within ``max_slowdown``.
        max_slowdown: Allowed relative growth of the bottleneck when no target is given (>= 0).
        layouts: For schedules with several stages per worker: every stage count the schedule can run
            (the current one included) -> the worker of each stage. Only these counts are proposed, and
            loads are per worker. ``None``: one stage per worker, any count from 1 up.

    Returns:
        A :class:`RepackResult`; with no target and no smaller pipeline within ``max_slowdown`` it
        keeps ``current`` and releases nothing.

    Raises:
        ValueError: on bad input, or if ``target_num_stages`` stages cannot hold the layers' memory
            (the message says which stage overflows and by how much).
        TypeError: when called in the old shape (loose costs, or a keyword that moved into the problem).
    """
    placement = check_placement(current, problem.num_layers)
    slowdown = check_fraction(max_slowdown, "max_slowdown")
    stages = placement.num_stages
    model = StageModel.build(problem, stages)
    now = _Current(problem, model.caps, problem.links(stages), model.slowdown)
    if layouts is not None:
        if now.comm is not None and any(row != now.comm[0] for row in now.comm):
            raise ValueError(
                "comm_time_s gives one row per link, but with layouts (several stages per worker) the "
                "links of the re-packed pipeline are not the current ones; give one number per layer."
            )
        return _repack_workers(now, placement, target_num_stages, slowdown, layouts)
    previous = max(model.loads(placement))
    if target_num_stages is not None:
        if (
            not isinstance(target_num_stages, int)
            or isinstance(target_num_stages, bool)
            or not (1 <= target_num_stages <= stages)
        ):
            raise ValueError(
                f"target_num_stages={target_num_stages!r} must be an integer in 1..{stages} (the current "
                "number of stages); re-packing only removes stages."
            )
        try:
            solved = now.solve(target_num_stages)
        except ValueError as err:
            raise ValueError(
                f"target_num_stages={target_num_stages} cannot be reached: the layers do not fit in memory "
                f"on the first {target_num_stages} stages. {err}"
            ) from None
        return _result(solved, stages, previous)
    best = _fewest_within(now, previous * (1.0 + slowdown), stages - 1)
    if best is None:
        return RepackResult(placement, (), previous, previous)
    return _result(best, stages, previous)


@dataclass(frozen=True)
class _Current:
    """The problem with its caps, links and slowdowns validated per current stage (kept ones keep theirs)."""

    problem: BalanceProblem
    caps: tuple[float, ...]
    comm: list[list[float]] | None  # one row per current link
    slowdown: tuple[float, ...]  # one per current stage

    def solve(self, k: int) -> PartitionResult:
        """The exact partition onto the first ``k`` stages (their caps, workers and links)."""
        links = self.comm[: k - 1] if self.comm is not None and k > 1 else None
        kept = self.problem.with_hardware(
            memory_capacity_bytes=list(self.caps[:k]),
            comm_time_s=links,
            worker_slowdown=list(self.slowdown[:k]),
        )
        return solve_partition(kept, k)

    @property
    def monotone(self) -> bool:
        """Whether a pipeline of more stages is never worse (one capacity, equal workers, free links)."""
        return len(set(self.caps)) <= 1 and len(set(self.slowdown)) <= 1 and not self.comm


def _fewest_within(problem: _Current, limit: float, most: int) -> PartitionResult | None:
    """The optimal partition with the fewest stages in ``1..most`` whose bottleneck is <= ``limit``.

    With one capacity for all stages, equal workers and free links, feasibility is monotone in the stage
    count (a stage of two or more layers can always be split without raising any load or memory), so a
    binary search needs only O(log S) exact partitions. Otherwise adding a stage shifts which capacity,
    worker or link applies where, so we scan the counts upwards instead.
    """
    if not problem.monotone:
        for k in range(1, most + 1):
            solved = _try(problem, k)
            if solved is not None and solved.bottleneck <= limit:
                return solved
        return None
    lo, hi = 1, most
    best: PartitionResult | None = None
    while lo <= hi:
        k = (lo + hi) // 2
        solved = _try(problem, k)
        if solved is not None and solved.bottleneck <= limit:
            best, hi = solved, k - 1
        else:
            lo = k + 1
    return best


def _try(problem: _Current, k: int) -> PartitionResult | None:
    try:
        return problem.solve(k)
    except ValueError:
        return None  # the first k stages cannot hold the layers' memory


def _result(solved: PartitionResult, stages: int, previous: float) -> RepackResult:
    kept = solved.placement.num_stages
    return RepackResult(solved.placement, tuple(range(kept, stages)), solved.bottleneck, previous)


def _repack_workers(
    now: _Current,
    current: Placement,
    target: int | None,
    slowdown: float,
    layouts: Mapping[int, Sequence[int]],
) -> RepackResult:
    """:func:`repack` over the stage counts in ``layouts``, balancing and comparing workers."""
    problem, caps = now.problem, now.caps
    stages = current.num_stages
    workers_now = list(layouts.get(stages, range(stages)))
    # A kept worker keeps its memory (the smallest capacity among its current stages) and its speed.
    worker_caps: dict[int, float] = {}
    worker_slowdown: dict[int, float] = {}
    for stage, worker in enumerate(workers_now):
        worker_caps[worker] = min(worker_caps.get(worker, math.inf), caps[stage])
        worker_slowdown[worker] = max(worker_slowdown.get(worker, 0.0), now.slowdown[stage])
    per_worker = problem.with_hardware(worker_slowdown=worker_slowdown)
    previous = max(worker_loads(per_worker, current, workers_now).values())
    counts = sorted(k for k in layouts if k < stages)
    if target is not None:
        if target not in (*counts, stages):
            raise ValueError(
                f"target_num_stages={target!r} is not a pipeline this schedule can run; the stage counts it "
                f"can re-pack onto are {counts} (a multiple of its stages per rank, with a micro-batch count "
                "it accepts). Pick one of them, or None for an automatic choice."
            )
        counts = [target]
    for k in counts:
        workers = list(layouts[k])
        kept = {w: worker_caps[w] for w in set(workers)}
        kept_problem = problem.with_hardware(
            memory_capacity_bytes=kept, worker_slowdown={w: worker_slowdown[w] for w in kept}
        )
        try:
            solved = partition_workers(kept_problem, workers)
        except ValueError as err:
            if target is None:
                continue  # these workers cannot hold the layers' memory: try more of them
            raise ValueError(f"target_num_stages={target} cannot be reached: {err}") from None
        if target is not None or solved.bottleneck <= previous * (1.0 + slowdown):
            return RepackResult(solved.placement, tuple(range(k, stages)), solved.bottleneck, previous)
    return RepackResult(current, (), previous, previous)
