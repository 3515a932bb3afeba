"""The contiguous placement a schedule's step predicts fastest, searched from the balancer's proposal.

Read in this order: :func:`refine` (the entry point and its :class:`Refinement`), then the local search
(:func:`_descend`, its moves :func:`_transfers`, its starting points :func:`_profiles`).

Why: the balancers minimise the heaviest stage (or worker). The step a schedule runs also has a warm-up and
a cool-down, pinned parts on particular ranks, several stages per rank under the interleaved and V
schedules, and a backward split in two under the zero-bubble ones; the placement with the lightest
heaviest stage need not be the fastest, and many placements share that heaviest stage. So the search
scores placements by the predicted step itself (``step_of``):

- **exact** when the stage count leaves at most ``budget`` contiguous placements (every one scored);
- otherwise a **local search**. Starting points: the proposal, and the fastest of the exact min-max
  placements whose stage loads grow or shrink geometrically along the pipeline, the last up to 4x the
  first or a quarter of it (:func:`_profiles`: a schedule's fill and drain can favour lighter first or
  last stages). From each,
  the first move that shortens the predicted step is taken, until none does: a move passes one or two
  layers from one stage to another, every stage in between handing on as many (so their layer counts
  stay), between neighbouring stages, between stages on one worker (the two halves of a V), and between
  any two stages when there are at most :data:`ALL_PAIRS_MAX_STAGES`. Beyond that many stages, once
  both descents have ended, the better one goes on: where none of those moves helps, one layer passed
  between any two stages is tried, and the first that helps restarts its descent. The wider moves come
  last, so the search never ends above where the narrower ones alone would. Evaluated placements are cached;
  the search stops at ``budget`` simulations.

Its guarantee is one-sided: the result is never predicted slower than the proposal (which is scored
first), and it is a local optimum of those moves when the budget is not exhausted. Placements that break a
memory cap are never chosen. Where the caller can tell cheaply that a candidate cannot beat the step to
beat (``at_least``: the busiest rank's own work already reaches it), that candidate is not simulated; the
search takes the same path and returns the same placement. Nothing here imports torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from lightning_dynmo.balancing.costs import layer_weights
from lightning_dynmo.balancing.partition import partition
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem
from lightning_dynmo.balancing.stage_model import StageModel

#: Simulations :func:`refine` may run: exact up to this many contiguous placements, a bounded local
#: search beyond.
SEARCH_BUDGET = 2048

#: Up to this many stages the local search also passes layers between any two stages (2 x S x (S - 1)
#: moves: 112 at 8 stages); beyond, between neighbours and stages that share a worker, and one layer
#: between any two only where those moves find nothing (:meth:`_Pairs.wide`).
ALL_PAIRS_MAX_STAGES = 8

#: The seeds' last-stage load over their first's (1: equal loads); loads grow geometrically in between.
PROFILE_RATIOS: tuple[float, ...] = (1 / 4, 1 / 3, 1 / 2, 2 / 3, 1.0, 3 / 2, 2.0, 3.0, 4.0)


@dataclass(frozen=True)
class Refinement:
    """What :func:`refine` found.

    Attributes:
        placement: The placement predicted fastest (the proposal on a tie).
        step_s: Its predicted step.
        proposal_step_s: The proposal's predicted step.
        exact: Whether every contiguous placement was simulated.
        simulations: How many placements were scored (simulated, or bounded by ``at_least``: see
            :func:`refine`).
    """

    placement: Placement
    step_s: float
    proposal_step_s: float
    exact: bool
    simulations: int

    def describe(self) -> str:
        """One phrase for the decision's reason."""
        how = "exact search" if self.exact else "local search"
        return f"{how} by the schedule's step ({self.simulations} placements scored)"


def refine(
    problem: BalanceProblem,
    proposal: Placement,
    step_of: Callable[[Placement], float],
    budget: int = SEARCH_BUDGET,
    stage_workers: Sequence[int] | None = None,
    at_least: Callable[[Placement, float], float] | None = None,
) -> Refinement:
    """The contiguous placement of ``proposal``'s stage count predicted fastest by ``step_of``.

    Args:
        problem: The costs and hardware (its memory caps bound the candidates; its worker slowdowns
            scale the seeds' stage loads).
        proposal: The balancer's placement; the search never returns one predicted slower.
        step_of: A placement's predicted step (e.g. :func:`~lightning_dynmo.balancing.step_prediction.
            predict_step`'s ``step_s``).
        budget: The most simulations: exact search when there are at most this many placements.
        stage_workers: The worker of each stage when workers run several (``None``: stage ``s`` on
            worker ``s``); the local search then also passes layers between a worker's stages.
        at_least: ``at_least(placement, time)``: ``step_of(placement)`` when it may be below ``time``,
            else any number ``>= time`` (e.g. :func:`~lightning_dynmo.balancing.step_prediction.
            step_at_least`, which skips the simulation then). Where a candidate only matters if it beats
            the best so far, the search asks this instead: the same result, sooner. ``None``:
            ``step_of`` for every candidate.

    Raises:
        ValueError: for a budget below 1, or ``stage_workers`` not one worker per stage.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget={budget!r} must be an integer >= 1 (simulations the search may run).")
    stages, layers = proposal.num_stages, proposal.num_layers
    if stage_workers is not None and len(stage_workers) != stages:
        raise ValueError(
            f"stage_workers has {len(stage_workers)} entries but proposal={proposal} has {stages} stages; "
            "give the worker of every stage."
        )
    # Only its memory is read: links and worker speeds are the step's business (and may not fit a view).
    model = StageModel.build(problem.with_hardware(comm_time_s=None, worker_slowdown=None), stages)

    def fits(placement: Placement) -> bool:
        return model.overflow(placement)[0] <= 0

    def beats(placement: Placement, time_s: float) -> float:
        """``placement``'s step if it is below ``time_s``, else a number ``>= time_s``."""
        return step_of(placement) if at_least is None else at_least(placement, time_s)

    start = step_of(proposal)
    if math.comb(layers - 1, stages - 1) <= budget:
        best, best_s, runs = proposal, start, 1
        for cuts in itertools.combinations(range(1, layers), stages - 1):
            candidate = Placement((0, *cuts, layers))
            if candidate == proposal or not fits(candidate):
                continue
            runs += 1
            step = beats(candidate, best_s)
            if step < best_s:
                best, best_s = candidate, step
        return Refinement(best, best_s, start, exact=True, simulations=runs)
    seen: dict[Placement, float] = {proposal: start}
    bounded: set[Placement] = set()  # what seen holds for these is a bound, not their step

    def score(placement: Placement, to_beat: float | None = None) -> float | None:
        """The predicted step (cached), or with ``to_beat`` a number ``>= to_beat`` when it is no
        shorter; ``None`` over a memory cap or past the budget."""
        known = seen.get(placement)
        if known is not None and (placement not in bounded or (to_beat is not None and known >= to_beat)):
            return known
        if known is None and (len(seen) >= budget or not fits(placement)):
            return None
        value = step_of(placement) if to_beat is None else beats(placement, to_beat)
        if to_beat is not None and value >= to_beat:
            bounded.add(placement)  # perhaps only a bound: asked again against a longer step, recompute
        else:
            bounded.discard(placement)
        seen[placement] = value
        return value

    # The per-stage min-max partition (under a V schedule it can beat the per-worker proposal's step).
    plain = problem.with_hardware(
        comm_time_s=None,
        worker_slowdown=problem.hardware.stage_slowdown(stages, stage_workers),
        memory_capacity_bytes=None,
    )
    seeds = [partition(plain, stages), *_profiles(problem, stages, stage_workers)]
    seeds = [p for p in dict.fromkeys(seeds) if p != proposal]
    scored = [(s, p) for p in seeds for s in [score(p)] if s is not None]
    pairs = _Pairs.build(problem, stages, stage_workers)
    found = [_descend(proposal, start, score, pairs)]
    if scored:
        seed_s, seed = min(scored, key=lambda x: x[0])
        found.append(_descend(seed, seed_s, score, pairs))
    best, best_s = min(found, key=lambda x: x[1])  # the proposal's descent first: it wins a tie
    # Wider moves from the better local optimum once both descents ended: what they spend of the budget
    # cannot cut the narrower descents short, so the search never ends above where those alone would.
    best, best_s = _descend(best, best_s, score, pairs, widen=True)
    return Refinement(best, best_s, start, exact=False, simulations=len(seen))


def _descend(
    placement: Placement,
    step_s: float,
    score: Callable[[Placement, float], float | None],
    pairs: _Pairs,
    widen: bool = False,
) -> tuple[Placement, float]:
    """Take the first move that shortens the step until none does (or ``score`` runs out of budget).

    The moves are the pairs :meth:`_Pairs.of` names. With ``widen``, beyond
    :data:`ALL_PAIRS_MAX_STAGES` stages, where none of them helps, one layer passed between any two
    stages (:meth:`_Pairs.wide`) is tried, and the first such move that shortens the step restarts the
    descent: the result is then a local optimum of both kinds of move.
    """
    while True:
        narrow = _transfers(placement, pairs.of(placement))
        while (shorter := _first_shorter(narrow, step_s, score)) is not None:
            placement, step_s = shorter
            narrow = _transfers(placement, pairs.of(placement))
        if pairs.every or not widen:
            return placement, step_s
        wider = _first_shorter(_transfers(placement, pairs.wide(placement), counts=(1,)), step_s, score)
        if wider is None:
            return placement, step_s
        placement, step_s = wider


def _first_shorter(
    candidates: Iterator[Placement], step_s: float, score: Callable[[Placement, float], float | None]
) -> tuple[Placement, float] | None:
    """The first candidate predicted shorter than ``step_s``, with its step; ``None`` if none is."""
    for candidate in candidates:
        step = score(candidate, step_s)
        if step is not None and step < step_s:
            return candidate, step
    return None


@dataclass(frozen=True)
class _Pairs:
    """The (from, to) stage pairs a move may pass layers between: every pair up to
    :data:`ALL_PAIRS_MAX_STAGES` stages; beyond, neighbours, stages on one worker, and the heaviest stage
    to any other and any to the lightest (by the balancers' loads: weights, pinned parts, slowdowns)."""

    every: bool
    near: tuple[tuple[int, int], ...]
    prefix: tuple[float, ...]  # running layer weight
    extra: tuple[float, ...]  # per stage, its pinned parts' weight
    slowdown: tuple[float, ...]

    @classmethod
    def build(cls, problem: BalanceProblem, stages: int, stage_workers: Sequence[int] | None) -> _Pairs:
        hw = problem.hardware
        extra = [0.0] * stages
        for stage, part in ((0, hw.first_stage_extra), (stages - 1, hw.last_stage_extra)):
            extra[stage] += layer_weights([part], problem.by)[0] if part is not None else 0.0
        near = {(a, a + 1) for a in range(stages - 1)}
        if stage_workers is not None:
            shared = itertools.combinations(range(stages), 2)
            near |= {(a, b) for a, b in shared if stage_workers[a] == stage_workers[b]}
        return cls(
            every=stages <= ALL_PAIRS_MAX_STAGES,
            near=tuple(sorted(near | {(b, a) for a, b in near})),
            prefix=tuple(itertools.accumulate(problem.weights(), initial=0.0)),
            extra=tuple(extra),
            slowdown=tuple(hw.stage_slowdown(stages, stage_workers) or [1.0] * stages),
        )

    def of(self, placement: Placement) -> list[tuple[int, int]]:
        """The pairs to try from ``placement``."""
        stages = placement.num_stages
        if self.every:
            return [(a, b) for a in range(stages) for b in range(stages) if a != b]
        bounds = placement.boundaries
        loads = [
            self.slowdown[s] * (self.prefix[bounds[s + 1]] - self.prefix[bounds[s]] + self.extra[s])
            for s in range(stages)
        ]
        heavy, light = loads.index(max(loads)), loads.index(min(loads))
        far = {(heavy, b) for b in range(stages)} | {(a, light) for a in range(stages)}
        return [*self.near, *sorted(p for p in far - set(self.near) if p[0] != p[1])]

    def wide(self, placement: Placement) -> list[tuple[int, int]]:
        """The pairs :meth:`of` leaves out: with them, every pair of distinct stages."""
        stages = placement.num_stages
        named = set(self.of(placement))
        return [(a, b) for a in range(stages) for b in range(stages) if a != b and (a, b) not in named]


def _transfers(
    placement: Placement, pairs: Sequence[tuple[int, int]], counts: Sequence[int] = (1, 2)
) -> Iterator[Placement]:
    """``placement`` with ``counts`` layers (one or two) passed from stage ``a`` to ``b`` for each pair,
    stages between handing on as many; none that empties a stage."""
    bounds = placement.boundaries
    for count in counts:
        for a, b in pairs:
            step = -count if a < b else count
            moved = list(bounds)
            for i in range(min(a, b) + 1, max(a, b) + 1):
                moved[i] += step
            if all(x < y for x, y in itertools.pairwise(moved)):
                yield Placement(tuple(moved))


def _profiles(problem: BalanceProblem, stages: int, stage_workers: Sequence[int] | None) -> list[Placement]:
    """Placements whose stage loads follow a geometric profile along the pipeline, one per ratio of
    :data:`PROFILE_RATIOS` (the last stage's load over the first's, each stage's divided by its worker's
    slowdown): cut where the layers' running load, the first stage's pinned part included, is nearest the
    profile's running target, every stage keeping a layer."""
    weights = problem.weights()
    hw = problem.hardware
    first = layer_weights([hw.first_stage_extra], problem.by)[0] if hw.first_stage_extra else 0.0
    last = layer_weights([hw.last_stage_extra], problem.by)[0] if hw.last_stage_extra else 0.0
    prefix = list(itertools.accumulate(weights, initial=first))
    total = prefix[-1] + last
    slowdown = hw.stage_slowdown(stages, stage_workers) or [1.0] * stages
    out = []
    for ratio in PROFILE_RATIOS:
        shares = [ratio ** (s / max(1, stages - 1)) / f for s, f in enumerate(slowdown)]
        targets = list(itertools.accumulate(total * x / sum(shares) for x in shares))
        bounds = [0]
        for s in range(stages - 1):
            lo, hi = bounds[-1] + 1, len(weights) - (stages - 1 - s)  # keep a layer for every stage
            cut = min(range(lo, hi + 1), key=lambda k: abs(prefix[k] - targets[s]))
            bounds.append(cut)
        out.append(Placement((*bounds, len(weights))))
    return list(dict.fromkeys(out))
