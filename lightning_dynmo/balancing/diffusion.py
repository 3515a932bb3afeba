"""Order-preserving diffusion balancer: the paper's Algorithm 3 without breaking layer order.

Read in this order: :func:`diffuse` (the rounds), :class:`DiffusionResult`, then ``_best_chain`` (which
move an overloaded stage makes), ``_ChainTable`` (the vectorised scoring) and ``relieve_bottleneck`` with
its two cascades (the bottleneck phase).

What changed from the paper (appendix C.3) and why:

* A stage may only hand a *boundary* layer to a *neighbour*: its first layer to the previous stage or its
  last layer to the next one. Anything else would break the pipeline's layer order.
* Variance descent with single neighbour moves stalls: with loads ``[6, 4, 2]`` and layers of weight 2,
  neither neighbour move lowers the variance, yet ``[4, 4, 4]`` exists. So a move is a *chain*: stage
  ``src`` hands a boundary layer to its neighbour, which hands its own boundary layer on, and so on up to
  stage ``dst``. Every stage of the chain keeps its size except ``src`` (one fewer) and ``dst`` (one
  more), so a layer's worth of load effectively travels through the intermediate stages.
* A chain is accepted only if it strictly lowers the variance of the stage loads (starting from the
  *current* variance, not ``+inf``), keeps ``src`` non-empty, keeps every changed stage within memory
  and never lifts any stage above the current bottleneck (so the bottleneck can never get worse).

* Variance descent converges to low-*variance* placements, and on uneven profiles the lowest-variance
  placement can have a bottleneck 5-30% above the min-max optimum (measured on the benchmark profiles).
  So, unless ``refine_bottleneck=False``, a second phase takes over when variance descent stops:
  the heaviest stage pushes a *cascade* towards a lighter stage (each stage on the way hands on the
  fewest boundary layers that keep it strictly below the bottleneck), accepted only if it strictly
  lowers (bottleneck, number of stages at the bottleneck). That phase may raise the variance; it
  never raises the bottleneck, and it keeps order, non-empty stages and memory like phase one.

A round lets every overloaded stage (load above the mean), heaviest first, make its best chain (the one
that lowers the variance most). Rounds stop when the imbalance is <= ``tolerance``, when a round
accepts no move, or after ``max_rounds``.

Cost (the benchmark asks for <= 250 ms at 1,024 layers x 720 stages): a round scores hundreds of stages but
accepts few chains, so the per-stage score terms are built once per boundary state for all stages
(``_ChainTable``) and each query slices them; the cascades are tight scalar loops, one bisection per
stage they pass through. The results are exactly those of scoring every path from scratch.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lightning_dynmo.balancing._checks import check_fraction, check_placement, check_positive_int
from lightning_dynmo.balancing.metrics import imbalance
from lightning_dynmo.balancing.moves import LayerMove, plan_moves
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem, takes_problem
from lightning_dynmo.balancing.stage_model import FloatArray, IntArray, StageModel

#: Relative slack of the load tests of a chain (a stage may reach the bottleneck up to rounding).
LOAD_SLACK = 1e-12


@dataclass(frozen=True)
class DiffusionResult:
    """What :func:`diffuse` decided.

    Attributes:
        placement: The new placement (ordered, contiguous, non-empty, within memory).
        moves: The net layer moves from ``current`` to ``placement`` in global layer order (what
            migration executes; a layer that travelled through several stages appears once).
        rounds: Rounds run (0 when ``current`` was already within tolerance).
        stage_loads: Load of every stage of ``placement``.
        imbalance_before: Imbalance of ``current``.
        imbalance_after: Imbalance of ``placement``.
        stop_reason: ``"tolerance"``, ``"no_improvement"`` or ``"max_rounds"``.
        refinement_moves: Cascades accepted by the bottleneck phase.
    """

    placement: Placement
    moves: tuple[LayerMove, ...]
    rounds: int
    stage_loads: tuple[float, ...]
    imbalance_before: float
    imbalance_after: float
    stop_reason: str
    refinement_moves: int = 0

    @property
    def bottleneck(self) -> float:
        """The heaviest stage's load."""
        return max(self.stage_loads)


@takes_problem
def diffuse(
    problem: BalanceProblem,
    current: Placement | str,
    *,
    max_rounds: int = 5,
    tolerance: float = 0.0,
    refine_bottleneck: bool = True,
) -> DiffusionResult:
    """Rebalance ``current`` by moving boundary layers between neighbouring stages.

    The rounds, the bottleneck phase and why they keep layer order are described once, in this
    module's docstring; stage loads and memory are those of :mod:`~lightning_dynmo.balancing.stage_model`.

    Args:
        problem: The costs, their view and the hardware (stage ``s`` of ``current`` runs on worker
            ``s``; memory caps, slowdowns and per-link send times are per stage of ``current``).
        current: The placement in use (or its string form).
        max_rounds: Upper bound on variance-descent rounds, >= 1 (5, as in the reference code; the
            bottleneck phase that follows has no round limit, it stops when no cascade helps).
        tolerance: Stop once ``imbalance(stage loads) <= tolerance`` (``(max - min) / mean``, >= 0).
        refine_bottleneck: Run the bottleneck phase after variance descent stops.

    Returns:
        A :class:`DiffusionResult`; its bottleneck is never above ``current``'s.

    Raises:
        ValueError: on bad input, or if ``current`` already exceeds a memory capacity (use
            ``partition`` with memory caps to find a placement that fits).
        TypeError: when called in the old shape (loose costs, or a keyword that moved into the problem).
    """
    placement = check_placement(current, problem.num_layers)
    check_positive_int(max_rounds, "max_rounds")
    tol = check_fraction(tolerance, "tolerance")
    model = StageModel.build(problem, placement.num_stages)
    caps = model.caps
    over, stage = model.overflow(placement)
    if over > 0:
        raise ValueError(
            f"current={placement} already needs {model.memories(placement)[stage]:.0f} bytes on "
            f"stage {stage}, over its capacity {caps[stage]:.0f}; diffusion only makes moves that fit, so "
            "start from partition(problem, num_stages) instead (it places the layers within the memory caps)."
        )
    state = _State(model, list(placement.boundaries))
    before = state.imbalance()
    rounds, reason = 0, "max_rounds"
    while True:
        if state.imbalance() <= tol:
            reason = "tolerance"
            break
        if rounds == max_rounds:
            break
        rounds += 1
        if not state.run_round():
            reason = "no_improvement"
            break
    refinements = 0
    if refine_bottleneck and reason != "tolerance":
        while state.imbalance() > tol and state.relieve_bottleneck():
            refinements += 1
        if state.imbalance() <= tol:
            reason = "tolerance"
    final = Placement(tuple(state.bounds))
    loads = model.loads(final)
    return DiffusionResult(
        final, plan_moves(placement, final), rounds, loads, before, imbalance(loads), reason, refinements
    )


class _State:
    """Mutable boundaries plus cached per-stage loads and memory during diffusion."""

    def __init__(self, model: StageModel, bounds: list[int]) -> None:
        self.model = model
        self.bounds = bounds
        self.bounds_arr = np.asarray(bounds)
        self.weights = np.diff(model.prefix_load)
        self.memory = np.diff(model.prefix_memory)
        self.caps = np.asarray(model.caps)
        stages = range(model.num_stages)
        self.loads = np.asarray([model.load(bounds[s], bounds[s + 1], s) for s in stages])
        self.mems = np.asarray([model.memory(bounds[s], bounds[s + 1], s) for s in stages])
        self.stage_ids = np.arange(model.num_stages, dtype=np.int64)
        # The cascades evaluate StageModel.load's expression on these Python lists (much faster than
        # method calls): (slowdown * (W[b] - W[a]) + comm[s][b - 1]) + extra.
        self.prefix_w: list[float] = model.prefix_load.tolist()
        self.prefix_m: list[float] = model.prefix_memory.tolist()
        self.slowdown: list[float] = list(model.slowdown)
        self.extra_w: list[float] = list(model.extra_load)
        self.extra_m: list[float] = list(model.extra_memory)
        self.comm: list[list[float]] | None = model.comm.tolist() if np.any(model.comm) else None
        self.capped = any(math.isfinite(c) for c in model.caps)
        # Chain scoring tables per direction, valid until the next boundary change (see _ChainTable).
        self._tables: dict[int, _ChainTable] = {}

    def imbalance(self) -> float:
        """``(max - min) / mean`` of the current loads (0 when all are 0)."""
        mean = float(np.mean(self.loads))
        return 0.0 if mean == 0 else float(np.max(self.loads) - np.min(self.loads)) / mean

    def run_round(self) -> bool:
        """One round; True if any chain was accepted."""
        mean = float(np.mean(self.loads))
        overloaded = [int(s) for s in np.argsort(-self.loads, kind="stable") if self.loads[s] > mean]
        accepted = False
        for src in overloaded:
            chain = self._best_chain(src)
            if chain is not None:
                self._apply(src, *chain)
                accepted = True
        return accepted

    def _best_chain(self, src: int) -> tuple[int, int] | None:
        """The (direction, dst) of the chain from ``src`` that lowers the variance most, if any."""
        if self.bounds[src + 1] - self.bounds[src] < 2:
            return None  # src would become empty
        best: tuple[float, int, int] | None = None
        for direction in (+1, -1):
            found = self._chain_deltas(src, direction)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], direction, found[1])
        return None if best is None else (best[1], best[2])

    def _chain_deltas(self, src: int, direction: int) -> tuple[float, int] | None:
        """Best (sum-of-squares change, dst) of chains from ``src`` in ``direction`` (+1 right, -1 left)."""
        table = self._tables.get(direction)
        if table is None:
            table = self._tables[direction] = _ChainTable.build(self, direction)
        found = table.best(src if direction > 0 else self.model.num_stages - 1 - src)
        if found is None:
            return None
        delta, dst = found
        return delta, dst if direction > 0 else self.model.num_stages - 1 - dst

    def _apply(self, src: int, direction: int, dst: int) -> None:
        lo, hi = (src, dst) if direction > 0 else (dst, src)
        self.bounds[lo + 1 : hi + 1] = [bound - direction for bound in self.bounds[lo + 1 : hi + 1]]
        self._refresh(lo, hi)

    def relieve_bottleneck(self) -> bool:
        """Apply a cascade from a bottleneck stage; False if none lowers the bottleneck.

        Of the two directions the shorter cascade wins (fewer layers to migrate), then the one that
        lowers the variance more; the second direction is only explored as far as the first reached.
        """
        peak = float(np.max(self.loads))
        stages = self.model.num_stages
        for src in np.flatnonzero(self.loads == peak):
            right = self._cascade_right(int(src), peak, stages)
            reach = stages if right is None else right[1] - int(src)
            left = self._cascade_left(int(src), peak, reach)
            best = right
            if left is not None:
                length = int(src) - left[0]
                if (
                    right is None
                    or length < reach
                    or (length == reach and self._square_change(*left) < self._square_change(*right))
                ):
                    best = left
            if best is not None:
                lo, hi, bounds = best
                self.bounds[lo + 1 : hi + 1] = bounds
                self._refresh(lo, hi)
                return True
        return False

    def _square_change(self, lo: int, hi: int, bounds: list[int]) -> float:
        """Change of the sum of squared loads if stages ``lo..hi`` took inner boundaries ``bounds``."""
        b = np.asarray([self.bounds[lo], *bounds, self.bounds[hi + 1]])
        new = self.model.loads_of(b[:-1], b[1:], self.stage_ids[lo : hi + 1])
        return float(np.sum(new**2) - np.sum(self.loads[lo : hi + 1] ** 2))

    def _load(self, stage: int, start: int, end: int) -> float:
        """``StageModel.load`` on the cached lists (the cascades' inner loop)."""
        w = self.prefix_w
        send = 0.0 if self.comm is None else self.comm[stage][end - 1]
        return (self.slowdown[stage] * (w[end] - w[start]) + send) + self.extra_w[stage]

    # The two cascades below are the refinement phase's inner loop (tens of thousands of steps at 720
    # stages), so they are written as tight scalar loops over Python lists: one bisection per stage plus
    # an exact correction, instead of helper calls. Both return ``(lo, hi, inner boundaries)``: the
    # changed stages ``lo..hi`` and their new boundaries ``lo + 1..hi``, or ``None`` if no stage within
    # ``max_length`` stages of ``src`` absorbs the cascade.

    def _cascade_right(self, src: int, peak: float, max_length: int) -> tuple[int, int, list[int]] | None:
        """Cascade from ``src`` towards the last stage (each stage hands on its last layers)."""
        w, m, old = self.prefix_w, self.prefix_m, self.bounds
        caps, capped, load = self.model.caps, self.capped, self._load
        factor, extra_w, extra_m = self.slowdown, self.extra_w, self.extra_m
        last = min(self.model.num_stages - 1, src + max_length)
        cuts: list[int] = []
        a, lowest = old[src], old[src] + 1  # src keeps at least one layer
        for k in range(src, last):
            # Stage k (now starting at a) keeps the most layers that stay strictly below the peak, hands
            # on at least one, and an intermediate stage keeps what it just received (cut >= lowest).
            # The bisection guesses from the work alone (a link only adds); the walks are exact.
            b = old[k + 1]
            limit = w[a] + (peak - extra_w[k]) / factor[k]
            cut = bisect.bisect_left(w, limit, lowest, b) - 1
            while cut + 1 < b and load(k, a, cut + 1) < peak:
                cut += 1
            while cut >= lowest and not load(k, a, cut) < peak:
                cut -= 1
            if capped:  # a stage already over its cap (allowed when it was so) may stay as full
                room = max(caps[k], float(self.mems[k])) - extra_m[k]
                cut = min(cut, _last_end(m, a, room, strict=False))
            if cut < lowest:
                return None
            cuts.append(cut)
            end = old[k + 2]
            if load(k + 1, cut, end) < peak and (
                not capped or (m[end] - m[cut]) + extra_m[k + 1] <= caps[k + 1]
            ):
                # The nearest stage that absorbs ends the cascade: fewer layers move and it keeps the
                # refinement phase linear in the cascade length.
                return src, k + 1, cuts
            a, lowest = cut, b
        return None

    def _cascade_left(self, src: int, peak: float, max_length: int) -> tuple[int, int, list[int]] | None:
        """Cascade from ``src`` towards the first stage (each stage hands on its first layers)."""
        w, m, old = self.prefix_w, self.prefix_m, self.bounds
        caps, capped, load = self.model.caps, self.capped, self._load
        factor, extra_w, extra_m = self.slowdown, self.extra_w, self.extra_m
        first = max(0, src - max_length)
        cuts: list[int] = []
        b, highest = old[src + 1], old[src + 1] - 1  # src keeps at least one layer
        for k in range(src, first, -1):
            a = old[k]
            send = 0.0 if self.comm is None else self.comm[k][b - 1]
            limit = w[b] - ((peak - extra_w[k]) - send) / factor[k]
            cut = bisect.bisect_right(w, limit, a + 1, highest + 1)
            while cut - 1 > a and load(k, cut - 1, b) < peak:
                cut -= 1
            while cut <= highest and not load(k, cut, b) < peak:
                cut += 1
            if capped:
                room = max(caps[k], float(self.mems[k])) - extra_m[k]
                cut = max(cut, _first_start(m, b, room, strict=False))
            if cut > highest:
                return None
            cuts.append(cut)
            start = old[k - 1]
            if load(k - 1, start, cut) < peak and (
                not capped or (m[cut] - m[start]) + extra_m[k - 1] <= caps[k - 1]
            ):
                cuts.reverse()
                return k - 1, src, cuts
            b, highest = cut, a
        return None

    def _refresh(self, lo: int, hi: int) -> None:
        """Recompute the cached loads and memory of stages ``lo..hi`` after their boundaries moved."""
        b = np.asarray(self.bounds)
        self.bounds_arr = b
        self._tables.clear()
        # StageModel's own expressions, one vector op for a chain that may span hundreds of stages.
        starts, ends = b[lo : hi + 1], b[lo + 1 : hi + 2]
        ids = self.stage_ids[lo : hi + 1]
        self.loads[lo : hi + 1] = self.model.loads_of(starts, ends, ids)
        self.mems[lo : hi + 1] = self.model.memories_of(starts, ends, ids)


@dataclass(frozen=True, eq=False)
class _ChainTable:
    """Every per-stage term of the chain scores in one direction, for one state of the boundaries.

    A round scores chains from hundreds of overloaded stages but accepts few of them, so the terms that
    do not depend on ``src`` are computed once per state (vectorised over all stages) and a query only
    slices them. Arrays are *oriented*: position ``j`` is stage ``j`` going right and stage
    ``num_stages - 1 - j`` going left, so a chain always runs from ``j`` to higher positions. A stage's
    load after a move is evaluated with :meth:`StageModel.loads_of` on its new boundaries, so slower
    workers, links and extras count exactly as everywhere else.
    """

    loads: FloatArray
    src_term: FloatArray  # [j]: square change of stage j when it hands on a layer and receives none
    pass_term: FloatArray  # [j]: square change of stage j when it receives a layer and hands one on
    recv_term: FloatArray  # [j]: square change of stage j when it receives a layer and keeps it
    recv_ok: npt.NDArray[np.bool_]  # [j]: stage j may end the chain (bottleneck and memory)
    next_fail: npt.NDArray[np.int64]  # [j]: first position >= j that may not pass a layer on
    eps: float

    @classmethod
    def build(cls, state: _State, direction: int) -> _ChainTable:
        """Tables for ``state`` in ``direction`` (+1 right, -1 left)."""
        b = state.bounds_arr
        starts, ends = b[:-1], b[1:]
        n = state.model.num_layers
        if direction > 0:  # a stage receives at its start and hands on its last layer
            received = (np.maximum(starts - 1, 0), ends)
            passing = (np.maximum(starts - 1, 0), ends - 1)
            source = (starts, ends - 1)
        else:  # a stage receives at its end and hands on its first layer
            received = (starts, np.minimum(ends + 1, n))
            passing = (starts + 1, np.minimum(ends + 1, n))
            source = (starts + 1, ends)
        order = slice(None) if direction > 0 else slice(None, None, -1)
        passed_layer = ends - 1 if direction > 0 else starts

        def new_loads(bounds: tuple[IntArray, IntArray]) -> FloatArray:
            lo, hi = np.minimum(bounds[0], n - 1), bounds[1]
            hi = np.maximum(hi, lo + 1)  # where the move is impossible, any valid (unused) value
            return state.model.loads_of(lo, hi, state.stage_ids)[order]

        loads = state.loads[order]
        # A stage may reach the bottleneck, not exceed it; the slack absorbs the rounding of vectorised
        # loads (a chain that leaves a stage exactly at the bottleneck was refused by one ulp).
        limit = float(np.max(state.loads)) * (1.0 + LOAD_SLACK)
        recv_load, pass_load, src_load = new_loads(received), new_loads(passing), new_loads(source)
        pass_ok = pass_load <= limit
        recv_ok = recv_load <= limit
        if state.capped:  # without caps every memory test passes; skip the arrays
            mems, caps, mx = state.mems[order], state.caps[order], state.memory[passed_layer][order]
            gain_mem = np.concatenate(([0.0], mx[:-1]))
            pass_mem = mems + gain_mem - mx
            pass_ok &= (pass_mem <= caps) | (pass_mem <= mems)
            recv_ok &= mems + gain_mem <= caps
        # Position 0 never receives (the first stage going right, the last going left).
        recv_ok[0] = False
        positions = np.arange(len(loads))
        fails = np.where(pass_ok, len(loads), positions)
        return cls(
            loads=loads,
            src_term=src_load**2 - loads**2,
            pass_term=pass_load**2 - loads**2,
            recv_term=recv_load**2 - loads**2,
            recv_ok=recv_ok,
            next_fail=np.minimum.accumulate(fails[::-1])[::-1],
            eps=1e-12 * max(1.0, float(np.sum(state.loads**2))),
        )

    def best(self, src: int) -> tuple[float, int] | None:
        """Best (sum-of-squares change, dst position) of the chains from position ``src``, if any."""
        last = len(self.loads) - 1
        if src == last:
            return None
        # dst may be any position up to the first one that cannot pass a layer on (that one may still
        # receive and keep it).
        end = min(int(self.next_fail[src + 1]), last)
        recv_ok = self.recv_ok[src + 1 : end + 1]
        if not recv_ok.any():
            return None
        head = self.src_term[src]
        pass_ss = np.cumsum(np.concatenate(([0.0], self.pass_term[src + 1 : end])))
        delta = head + pass_ss + self.recv_term[src + 1 : end + 1]
        valid = recv_ok & (delta < -self.eps)
        if not valid.any():
            return None
        k = int(np.argmin(np.where(valid, delta, math.inf)))
        return float(delta[k]), src + 1 + k


def _last_end(prefix: list[float], start: int, limit: float, strict: bool) -> int:
    """Largest ``e >= start`` with ``prefix[e] - prefix[start]`` below ``limit`` (``<=`` unless strict)."""

    def fits(e: int) -> bool:
        value = prefix[e] - prefix[start]
        return value < limit if strict else value <= limit

    if math.isinf(limit):
        return len(prefix) - 1
    e = min(max(bisect.bisect_left(prefix, prefix[start] + limit, lo=start) - 1, start), len(prefix) - 1)
    while e + 1 < len(prefix) and fits(e + 1):
        e += 1
    while e > start and not fits(e):
        e -= 1
    return e


def _first_start(prefix: list[float], end: int, limit: float, strict: bool) -> int:
    """Smallest ``s <= end`` with ``prefix[end] - prefix[s]`` below ``limit`` (``<=`` unless strict)."""

    def fits(s: int) -> bool:
        value = prefix[end] - prefix[s]
        return value < limit if strict else value <= limit

    if math.isinf(limit):
        return 0
    s = min(bisect.bisect_right(prefix, prefix[end] - limit, 0, end), end)
    while s > 0 and fits(s - 1):
        s -= 1
    while s < end and not fits(s):
        s += 1
    return s
