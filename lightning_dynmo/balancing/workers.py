"""Placements for schedules that run several (virtual) stages per worker: balance the workers.

Interleaved 1F1B, looped BFS and the zero-bubble V schedules give each worker (rank) more than one stage:
stage ``s`` runs on worker ``stage_workers[s]``. A worker's step is bounded by the work of all its stages
together, so the quantity to minimise is the heaviest *worker*, not the heaviest stage that
:func:`~lightning_dynmo.balancing.partition` minimises. Layers stay in order and every stage keeps at
least one layer, as everywhere in this package.

The heaviest sum of non-adjacent stages is a harder objective than the contiguous min-max (no exact
polynomial search for it is known to us), so :func:`partition_workers` is a local search with two
guarantees: it starts from the per-stage optimum, from an even split and from the current placement
(when given), and it only ever accepts moves that lower ``(memory overflow, heaviest worker, sum of
squared worker loads)``, so it is never worse than any of its starting points. A move shifts one stage
boundary anywhere between its neighbours, two boundaries by one layer each, or a run of boundaries by
one layer (a layer passed along a chain of stages). On small problems an escape phase then descends
again from every neighbour of the optimum found (within ``KICK_WORK``). The tests and
``benchmarks.balancing`` compare it with brute force on small cases.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from lightning_dynmo.balancing._checks import MemoryCapacity, PerWorker, check_num_stages
from lightning_dynmo.balancing.costs import layer_weights
from lightning_dynmo.balancing.partition import partition
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem, takes_problem

#: Work the escape phase may spend after the first local optimum, in descents x layers x stages (see
#: ``_Search.kick``): small problems get many extra descents, large ones none.
KICK_WORK = 4000


@dataclass(frozen=True)
class WorkerPartitionResult:
    """A placement balanced per worker, and what each worker then carries.

    Attributes:
        placement: The placement (stage ``s`` on worker ``stage_workers[s]``).
        bottleneck: The heaviest worker's load: the sum of its stages' loads.
        worker_loads: Load of every worker, by worker id.
        worker_memory_bytes: Memory of every worker (its stages' layers and extras), by worker id.
    """

    placement: Placement
    bottleneck: float
    worker_loads: Mapping[int, float]
    worker_memory_bytes: Mapping[int, float]


@takes_problem
def worker_loads(
    problem: BalanceProblem, placement: Placement, stage_workers: Sequence[int]
) -> dict[int, float]:
    """Each worker's load under ``placement``: the summed load of all its stages.

    A stage's load is its layers' weight, plus the pinned extras on the first and last stage, times its
    worker's slowdown, plus the time to send its boundary activation (see :func:`partition_workers`).
    """
    _check_workers(stage_workers, placement.num_stages)
    model = _Model.build(problem, stage_workers)
    return dict(zip(model.ids, model.totals(placement.boundaries)[0], strict=True))


@takes_problem
def partition_workers(
    problem: BalanceProblem, stage_workers: Sequence[int], current: Placement | None = None
) -> WorkerPartitionResult:
    """A placement over ``len(stage_workers)`` stages whose heaviest worker is as light as we can find.

    The search and its guarantees are described once, in this module's docstring.

    Args:
        problem: The costs, their view and the hardware, read per *worker*: ``worker_slowdown`` and
            ``memory_capacity_bytes`` are one per worker (a sequence indexed by worker id, or a mapping
            keyed by it; one number for every worker, or ``None``). A worker's memory is the summed
            ``memory_bytes`` of the layers and pinned parts of all its stages. Per-link ``comm_time_s``
            rows are per stage boundary (row ``s``: stage ``s`` -> ``s + 1``); stage ``s``'s worker
            pays the send of its last layer's output, except for the last stage.
        stage_workers: The worker of every stage, e.g. ``[0, 1, 0, 1]`` (interleaved, 2 workers) or
            ``[0, 1, 1, 0]`` (V schedules). Every stage gets at least one layer.
        current: The placement in use, tried as a starting point too (so the result is never worse).

    Returns:
        The best placement found; deterministic for the same input.

    Raises:
        ValueError: on bad input, or if no placement found fits memory (the message gives the smallest
            overflow found in bytes and the worker that overflows).
        TypeError: when called in the old shape (loose costs, or a keyword that moved into the problem).
    """
    num_layers = problem.num_layers
    num_stages = check_num_stages(len(stage_workers), num_layers, name="len(stage_workers)")
    _check_workers(stage_workers, num_stages)
    if current is not None and (current.num_stages != num_stages or current.num_layers != num_layers):
        raise ValueError(
            f"current={current} has {current.num_stages} stages and {current.num_layers} layers; "
            f"expected {num_stages} stages (one per stage_workers entry) and {num_layers} layers."
        )
    model = _Model.build(problem, stage_workers)
    search = _Search(model, _worker_caps(problem.hardware.memory_capacity_bytes, stage_workers))
    # The per-stage optimum (each stage at its worker's speed, memory aside) is one starting point.
    per_stage = partition(
        problem.with_hardware(
            worker_slowdown=[model.factor[k] for k in model.owner], memory_capacity_bytes=None
        ),
        num_stages,
    )
    starts = [per_stage.boundaries, _even(num_layers, num_stages)]
    if current is not None:
        starts.append(current.boundaries)
    best = min((search.descend(list(b)) for b in starts), key=search.score)
    best = search.kick(best, budget=KICK_WORK // (num_layers * num_stages))
    over, worst = search.overflow(best)
    if over > 0:
        raise ValueError(
            f"no placement found that fits memory: the best one needs {over:.0f} bytes more than worker "
            f"{worst} has. Raise memory_capacity_bytes, use more workers, or a model that fits."
        )
    placement = Placement(tuple(best))
    loads, memory = model.totals(best)
    by_worker = dict(zip(model.ids, loads, strict=True))
    return WorkerPartitionResult(placement, max(loads), by_worker, dict(zip(model.ids, memory, strict=True)))


@dataclass(frozen=True)
class _Model:
    """Worker loads and memory of boundary lists (workers in slots ``0..W-1``: sorted ids).

    A stage's load is ``(factor * (layers + extra) + send)``: its layers' and pinned extra's reference
    weight times its worker's slowdown, plus the time to send its last layer's output (not for the last
    stage).
    """

    ids: list[int]
    owner: list[int]  # slot of each stage's worker
    factor: list[float]  # slowdown of each slot
    prefix_load: list[float]
    prefix_memory: list[float]
    extra_load: list[float]  # per stage, reference weight of its pinned extra
    extra_memory: list[float]
    comm: list[list[float]] | None  # per stage boundary, per layer

    @classmethod
    def build(cls, problem: BalanceProblem, stage_workers: Sequence[int]) -> _Model:
        ids = sorted(set(stage_workers))
        slot = {w: k for k, w in enumerate(ids)}
        num_stages = len(stage_workers)
        hardware, by = problem.hardware, problem.by
        extra_load, extra_memory = [0.0] * num_stages, [0.0] * num_stages
        for stage, extra in ((0, hardware.first_stage_extra), (num_stages - 1, hardware.last_stage_extra)):
            if extra is not None:
                extra_load[stage] += layer_weights([extra], by)[0]
                extra_memory[stage] += float(extra.memory_bytes)
        prefix_load, prefix_memory = [0.0], [0.0]
        for w, c in zip(problem.weights(), problem.costs, strict=True):
            prefix_load.append(prefix_load[-1] + w)
            prefix_memory.append(prefix_memory[-1] + float(c.memory_bytes))
        return cls(
            ids=ids,
            owner=[slot[w] for w in stage_workers],
            factor=list(_worker_slowdown(hardware.worker_slowdown, ids)),
            prefix_load=prefix_load,
            prefix_memory=prefix_memory,
            extra_load=extra_load,
            extra_memory=extra_memory,
            comm=problem.links(num_stages),
        )

    def totals(self, b: Sequence[int]) -> tuple[list[float], list[float]]:
        """Per worker slot: (load, memory) of boundaries ``b``."""
        loads, memory = [0.0] * len(self.ids), [0.0] * len(self.ids)
        for s, k in enumerate(self.owner):
            work = (self.prefix_load[b[s + 1]] - self.prefix_load[b[s]]) + self.extra_load[s]
            send = self.comm[s][b[s + 1] - 1] if self.comm is not None and s < len(self.owner) - 1 else 0.0
            loads[k] += self.factor[k] * work + send
            memory[k] += (self.prefix_memory[b[s + 1]] - self.prefix_memory[b[s]]) + self.extra_memory[s]
        return loads, memory


class _Search:
    """The descent over boundary moves on a :class:`_Model`.

    A move changes some boundaries; moving boundary ``i`` from ``x`` to ``y`` hands the layers in
    between from one of its stages to the other, so stage ``i - 1`` gains ``P[y] - P[x]`` (prefix sums
    ``P``, times its worker's slowdown) and stage ``i`` loses it, and stage ``i - 1``'s send changes
    with its last layer. Moves are therefore scored from the current worker totals in O(workers),
    without re-summing the stages.
    """

    def __init__(self, model: _Model, caps: Mapping[int, float]) -> None:
        self.model = model
        self.ids = model.ids
        self.owner = model.owner
        self.caps = [caps[w] for w in self.ids]
        # Without a finite cap no placement overflows: the descent then leaves memory out of its moves.
        self.capped = any(math.isfinite(c) for c in self.caps)
        # Strict improvement below this is float noise, not progress (it keeps the descent finite).
        self.eps = 1e-12 * max(model.prefix_load[-1] * max(model.factor), 1.0)

    def _score(self, loads: list[float], memory: list[float] | None) -> tuple[float, float, float]:
        """``memory`` ``None``: nothing is capped, nothing overflows."""
        over = 0.0 if memory is None else sum(max(0.0, m - c) for m, c in zip(memory, self.caps, strict=True))
        return over, max(loads), sum(map(operator.mul, loads, loads))

    def overflow(self, b: Sequence[int]) -> tuple[float, int]:
        """Largest bytes over capacity (<= 0 when everything fits) and the worker where it happens."""
        memory = self.model.totals(b)[1]
        worst = max(range(len(self.ids)), key=lambda k: memory[k] - self.caps[k])
        return memory[worst] - self.caps[worst], self.ids[worst]

    def score(self, b: Sequence[int]) -> tuple[float, float, float]:
        return self._score(*self.model.totals(b))

    def descend(self, b: list[int]) -> list[int]:
        """Steepest descent over the moves of :meth:`_moves`; returns a local optimum."""
        b = list(b)
        loads, totals = self.model.totals(b)
        memory = totals if self.capped else None
        current = self._score(loads, memory)
        eps = self.eps
        while True:
            best: tuple[_Move, list[float], list[float] | None] | None = None
            best_score = current
            for move, new_loads, new_memory in self._scored_moves(b, loads, memory):
                if new_memory is None and max(new_loads) > best_score[1] + eps:
                    continue  # nothing overflows and the heaviest worker got heavier: _better says no
                score = self._score(new_loads, new_memory)
                if _better(score, best_score, eps):  # copied: a chain's sums go on changing
                    kept_memory = None if new_memory is None else new_memory[:]
                    best, best_score = (move, new_loads[:], kept_memory), score
            if best is None:
                return b
            move, loads, memory = best
            for i, y in _changes(b, move):
                b[i] = y
            current = best_score

    def _shift(
        self, b: Sequence[int], i: int, y: int, loads: list[float], memory: list[float] | None
    ) -> None:
        """Move boundary ``i`` from ``b[i]`` to ``y`` in the totals ``loads`` and ``memory``, in place."""
        model, owner = self.model, self.owner
        pl, factor, comm = model.prefix_load, model.factor, model.comm
        x = b[i]
        dl = pl[y] - pl[x]
        gain = factor[owner[i - 1]] * dl
        if comm is not None:  # stage i - 1 now ends before layer y instead of x
            gain += comm[i - 1][y - 1] - comm[i - 1][x - 1]
        loads[owner[i - 1]] += gain
        loads[owner[i]] -= factor[owner[i]] * dl
        if memory is not None:
            dm = model.prefix_memory[y] - model.prefix_memory[x]
            memory[owner[i - 1]] += dm
            memory[owner[i]] -= dm

    def _scored_moves(
        self, b: list[int], loads: list[float], memory: list[float] | None
    ) -> Iterator[tuple[_Move, list[float], list[float] | None]]:
        """Every move of :meth:`_moves`, in its order, with the worker totals after it.

        A move is its ``(boundary, position)`` list, or ``(i, j, d)`` for boundaries ``i .. j`` each moved
        by ``d`` (a chain). A chain's totals extend the chain one boundary shorter by one shift, the same
        additions in the same order as shifting its boundaries one by one, so scoring every chain costs
        O(stages^2), not O(stages^3); its totals are lists the next chains go on changing.
        """
        num_stages = len(b) - 1

        def fresh() -> tuple[list[float], list[float] | None]:
            return loads[:], None if memory is None else memory[:]

        for i in range(1, num_stages):
            for y in range(b[i - 1] + 1, b[i + 1]):
                if y != b[i]:
                    new_loads, new_memory = fresh()
                    self._shift(b, i, y, new_loads, new_memory)
                    yield [(i, y)], new_loads, new_memory
        for i in range(1, num_stages):
            chains: dict[int, tuple[list[float], list[float] | None]] = {}
            for d in (-1, 1):
                if b[i - 1] < b[i] + d:  # the chain's first stage keeps a layer
                    chains[d] = fresh()
                    self._shift(b, i, b[i] + d, *chains[d])
            for j in range(i + 1, num_stages):
                for yi, yj in _pair_moves(b, i, j):
                    new_loads, new_memory = fresh()
                    self._shift(b, i, yi, new_loads, new_memory)
                    self._shift(b, j, yj, new_loads, new_memory)
                    yield [(i, yi), (j, yj)], new_loads, new_memory
                for d, (run_loads, run_memory) in chains.items():  # d = -1 first, as _moves
                    self._shift(b, j, b[j] + d, run_loads, run_memory)
                    if j > i + 1 and b[j] + d < b[j + 1]:  # the chain's last stage keeps a layer
                        yield (i, j, d), run_loads, run_memory

    def kick(self, b: list[int], budget: int) -> list[int]:
        """Escape the local optimum: from every neighbour of ``b``, descend again; keep what is better.

        Repeats from each improvement, for at most ``budget`` descents in all.
        """
        current = self.score(b)
        spent = 0
        improved = True
        while improved:
            improved = False
            for changes in self._moves(b):
                spent += 1
                if spent > budget:
                    return b
                neighbour = list(b)
                for i, y in changes:
                    neighbour[i] = y
                candidate = self.descend(neighbour)
                score = self.score(candidate)
                if _better(score, current, self.eps):
                    b, current, improved = candidate, score, True
                    break
        return b

    @staticmethod
    def _moves(b: list[int]) -> list[list[tuple[int, int]]]:
        """Moves as (boundary index, new position) lists; every stage keeps at least one layer."""
        num_stages = len(b) - 1
        moves: list[list[tuple[int, int]]] = []
        for i in range(1, num_stages):  # boundary i anywhere strictly between its neighbours
            moves.extend([(i, y)] for y in range(b[i - 1] + 1, b[i + 1]) if y != b[i])
        for i in range(1, num_stages):
            for j in range(i + 1, num_stages):
                moves.extend([(i, yi), (j, yj)] for yi, yj in _pair_moves(b, i, j))
                if j > i + 1:  # a run of boundaries by one layer: a layer passed down a chain of stages
                    for d in (-1, 1):
                        if b[i - 1] < b[i] + d and b[j] + d < b[j + 1]:
                            moves.append(_changes(b, (i, j, d)))
        return moves


#: A boundary move: its ``(boundary, new position)`` changes, or ``(i, j, d)`` (boundaries i .. j, each by d).
_Move = list[tuple[int, int]] | tuple[int, int, int]


def _changes(b: Sequence[int], move: _Move) -> list[tuple[int, int]]:
    """``move``'s ``(boundary, new position)`` changes from boundaries ``b``."""
    if isinstance(move, tuple):  # a chain
        i, j, d = move
        return [(k, b[k] + d) for k in range(i, j + 1)]
    return move


def _pair_moves(b: Sequence[int], i: int, j: int) -> Iterator[tuple[int, int]]:
    """New positions of boundaries ``i < j`` moved by one layer each, every stage keeping a layer."""
    for di in (-1, 1):
        for dj in (-1, 1):
            yi, yj = b[i] + di, b[j] + dj
            right_of_i = yj if j == i + 1 else b[i + 1]
            left_of_j = yi if j == i + 1 else b[j - 1]
            if b[i - 1] < yi < right_of_i and left_of_j < yj < b[j + 1]:
                yield yi, yj


def _better(a: tuple[float, float, float], b: tuple[float, float, float], eps: float) -> bool:
    """``a`` strictly better than ``b`` (lexicographic, with a tolerance for float noise)."""
    for x, y in zip(a, b, strict=True):
        if x < y - eps:
            return True
        if x > y + eps:
            return False
    return False


def _even(num_layers: int, num_stages: int) -> tuple[int, ...]:
    return tuple(round(num_layers * s / num_stages) for s in range(num_stages + 1))


def _check_workers(stage_workers: Sequence[int], num_stages: int) -> None:
    if len(stage_workers) != num_stages or num_stages < 1:
        raise ValueError(
            f"stage_workers has {len(stage_workers)} entries for {num_stages} stages; give the worker of "
            "every stage (at least one)."
        )
    bad = [w for w in stage_workers if isinstance(w, bool) or not isinstance(w, int) or w < 0]
    if bad:
        raise ValueError(f"stage_workers={list(stage_workers)} holds {bad!r}; worker ids are integers >= 0.")


def _worker_slowdown(slowdown: PerWorker, ids: Sequence[int]) -> tuple[float, ...]:
    """Per worker slot, its slowdown factor (1.0 when none is given)."""
    if slowdown is None:
        return (1.0,) * len(ids)
    if isinstance(slowdown, Mapping):
        missing = [w for w in ids if w not in slowdown]
        if missing:
            raise ValueError(f"worker_slowdown has no entry for workers {missing}; give one per worker.")
        values = [slowdown[w] for w in ids]
    elif isinstance(slowdown, Sequence) and not isinstance(slowdown, (str, bytes)):
        if len(slowdown) <= ids[-1]:
            raise ValueError(
                f"worker_slowdown has {len(slowdown)} entries but worker ids go up to {ids[-1]}; give one "
                "per worker, indexed by worker id."
            )
        values = [slowdown[w] for w in ids]
    else:
        raise ValueError(f"worker_slowdown={slowdown!r} must be None, or one factor per worker.")
    return tuple(float(v) for v in values)  # each checked by Hardware


def _worker_caps(capacity: MemoryCapacity, stage_workers: Sequence[int]) -> dict[int, float]:
    ids = sorted(set(stage_workers))
    if capacity is None:
        return dict.fromkeys(ids, math.inf)
    if isinstance(capacity, (int, float)) and not isinstance(capacity, bool):
        caps = dict.fromkeys(ids, float(capacity))
    elif isinstance(capacity, Mapping):
        missing = [w for w in ids if w not in capacity]
        if missing:
            raise ValueError(
                f"memory_capacity_bytes has no entry for workers {missing}; give one per worker."
            )
        caps = {w: float(capacity[w]) for w in ids}
    elif isinstance(capacity, Sequence) and not isinstance(capacity, str):
        values = [float(c) for c in capacity]
        if len(values) <= ids[-1]:
            raise ValueError(
                f"memory_capacity_bytes has {len(values)} entries but worker ids go up to {ids[-1]}; give "
                "one per worker, indexed by worker id."
            )
        caps = {w: values[w] for w in ids}
    else:
        raise ValueError(
            f"memory_capacity_bytes={capacity!r} must be None, a number of bytes, or one number per worker."
        )
    bad = {w: c for w, c in caps.items() if not c > 0}
    if bad:
        raise ValueError(f"memory_capacity_bytes must be > 0 for every worker; got {bad}.")
    return caps
