"""Feasibility probes for the exact partition search: "is there a placement whose heaviest stage <= B?"

Read in this order: :func:`probe` (dispatch), :func:`next_candidate` (the smallest stage load above a
failed bound, which lets the search jump between achievable values), then the two probes.

* ``_probe_greedy`` is the fast path, used when no communication time is given, every stage runs at
  the reference speed, all middle stages share one memory capacity and every single layer fits a
  middle stage. Then the positions where stage ``s`` can end form an interval ``[s, G_s]``, so one
  greedy jump per stage decides feasibility: O(S log n) per probe.
* ``_probe_dp`` is the safe path for everything else (per-boundary communication time, slower
  workers, heterogeneous per-stage capacities). It is a reachability DP over (stage, boundary
  position) with the bound fixed, vectorised over positions with numpy: O(S n) per probe.

Both return the boundaries of a placement meeting the bound, or ``None``. Both honour memory capacities,
fixed extras and the "exactly S non-empty stages" rule inside the search.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from lightning_dynmo.balancing.stage_model import FloatArray, IntArray, StageModel


def probe(model: StageModel, bound: float) -> tuple[int, ...] | None:
    """Boundaries of a placement whose every stage load is <= ``bound`` and fits memory, or ``None``."""
    if use_greedy(model):
        if model.num_stages <= 2:
            return _probe_greedy(model, bound)
        max_load, max_memory = _largest_layer(model)
        if max_load > bound:
            return None  # that layer exceeds the bound on any stage (extras only add)
        if max_memory + model.extra_memory[1] <= model.caps[1]:
            return _probe_greedy(model, bound)
        # A layer too big for a middle stage may still fit the first or last one: no interval structure.
    return _probe_dp(model, bound)


def use_greedy(model: StageModel) -> bool:
    """True when the interval structure behind the fast greedy probe holds."""
    middle_caps = set(model.caps[1:-1])
    return model.homogeneous and len(middle_caps) <= 1


def _min_start(
    prefix: FloatArray, ends: IntArray, add: FloatArray, extra: float, bound: float, scale: float = 1.0
) -> IntArray:
    """For each end ``b``, the smallest start ``a <= b`` whose load is within ``bound``.

    The load is ``(scale * (P[b] - P[a]) + add) + extra`` (``scale`` 1.0 is left out: same value).

    Returns ``b`` where even ``a = b - 1`` fails (no valid non-empty stage ends at ``b``). The
    searchsorted guess is corrected with the exact expression until it no longer moves, so rounding
    cannot disagree with :meth:`StageModel.load`.
    """
    if math.isinf(bound):
        return np.zeros(len(ends), dtype=np.int64)
    pe = prefix[ends]
    guess = (pe + add + extra) - bound if scale == 1.0 else pe - ((bound - extra) - add) / scale
    start = np.searchsorted(prefix, guess, side="left").astype(np.int64)
    start = np.minimum(start, ends)

    def value(a: IntArray) -> FloatArray:
        work = pe - prefix[a] if scale == 1.0 else scale * (pe - prefix[a])
        result: FloatArray = (work + add) + extra
        return result

    while True:
        bad = (start < ends) & (value(start) > bound)
        lower = np.maximum(start - 1, 0)
        fits = ~bad & (start > 0) & (value(lower) <= bound)
        if not (np.any(bad) or np.any(fits)):
            break
        start = start + bad - fits
    # A start equal to the end is an empty stage: it means "no start fits".
    return np.asarray(start, dtype=np.int64)


def _stage_min_starts(model: StageModel, stage: int, bound: float, ends: IntArray) -> IntArray:
    """Smallest feasible start (load and memory) of ``stage`` for every end in ``ends``."""
    add = model.comm[stage, ends - 1]
    by_load = _min_start(model.prefix_load, ends, add, model.extra_load[stage], bound, model.slowdown[stage])
    by_memory = _min_start(
        model.prefix_memory, ends, np.zeros(len(ends)), model.extra_memory[stage], model.caps[stage]
    )
    return np.maximum(by_load, by_memory)


def _probe_dp(model: StageModel, bound: float) -> tuple[int, ...] | None:
    n, stages = model.num_layers, model.num_stages
    ends = np.arange(1, n + 1, dtype=np.int64)
    positions = np.arange(n + 1, dtype=np.int64)
    reach = np.zeros(n + 1, dtype=bool)
    reach[0] = True
    latest: list[IntArray] = []  # latest[s][p]: largest reachable start of stage s at or before p
    cache: dict[tuple[float, float, float, float, int], IntArray] = {}
    for s in range(stages):
        # Middle stages usually share extras, capacity, speed and link, hence one min-start array for all.
        key = (
            model.extra_load[s],
            model.extra_memory[s],
            model.caps[s],
            model.slowdown[s],
            _link_key(model, s),
        )
        if key not in cache:
            cache[key] = _stage_min_starts(model, s, bound, ends)
        min_start = cache[key]
        prev = np.maximum.accumulate(np.where(reach, positions, -1))
        latest.append(prev)
        reach = np.zeros(n + 1, dtype=bool)
        reach[1:] = (prev[:-1] >= min_start) & (min_start < ends)
    if not reach[n]:
        return None
    bounds = [n]
    for s in range(stages - 1, -1, -1):
        bounds.append(int(latest[s][bounds[-1] - 1]))
    bounds.reverse()
    return tuple(bounds)


def _lists(model: StageModel) -> tuple[list[float], list[float]]:
    """The prefix sums as Python lists (cached on the model), for fast scalar bisection."""
    cached: tuple[list[float], list[float]] | None = model.__dict__.get("_lists")
    if cached is None:
        cached = (model.prefix_load.tolist(), model.prefix_memory.tolist())
        object.__setattr__(model, "_lists", cached)
    return cached


def _max_end(model: StageModel, start: int, stage: int, bound: float) -> int:
    """Largest end ``b`` such that ``stage`` can own ``start..b-1`` (``start`` if none fits).

    Only used on the greedy path, where there is no communication term.
    """
    w, m = _lists(model)
    n = model.num_layers
    extra, extra_mem, cap = model.extra_load[stage], model.extra_memory[stage], model.caps[stage]
    end = max(start, min(bisect.bisect_right(w, w[start] + (bound - extra), lo=start) - 1, n))
    while end < n and (w[end + 1] - w[start]) + extra <= bound:
        end += 1
    while end > start and (w[end] - w[start]) + extra > bound:
        end -= 1
    if not math.isinf(cap):
        mem_end = max(start, min(bisect.bisect_right(m, m[start] + (cap - extra_mem), lo=start) - 1, n))
        while mem_end < n and (m[mem_end + 1] - m[start]) + extra_mem <= cap:
            mem_end += 1
        while mem_end > start and (m[mem_end] - m[start]) + extra_mem > cap:
            mem_end -= 1
        end = min(end, mem_end)
    return end


def _min_start_py(model: StageModel, end: int, stage: int, bound: float) -> int:
    """Smallest start ``a`` such that ``stage`` can own ``a..end-1`` (``end`` if none fits)."""
    w, m = _lists(model)
    add, extra = model.comm_of(stage, end), model.extra_load[stage]
    start = min(bisect.bisect_left(w, (w[end] + add + extra) - bound, 0, end), end)
    while start < end and ((w[end] - w[start]) + add) + extra > bound:
        start += 1
    while start > 0 and ((w[end] - w[start - 1]) + add) + extra <= bound:
        start -= 1
    extra_mem, cap = model.extra_memory[stage], model.caps[stage]
    if not math.isinf(cap):
        mem = min(bisect.bisect_left(m, (m[end] + extra_mem) - cap, 0, end), end)
        while mem < end and (m[end] - m[mem]) + extra_mem > cap:
            mem += 1
        while mem > 0 and (m[end] - m[mem - 1]) + extra_mem <= cap:
            mem -= 1
        start = max(start, mem)
    return start


def _probe_greedy(model: StageModel, bound: float) -> tuple[int, ...] | None:
    n, stages = model.num_layers, model.num_stages
    if stages == 1:
        fits = model.load(0, n, 0) <= bound and model.memory(0, n, 0) <= model.caps[0]
        return (0, n) if fits else None
    reach_end = [0] * stages  # reach_end[s]: stage s can start anywhere in [s, reach_end[s]]
    reach_end[1] = _max_end(model, 0, 0, bound)
    if reach_end[1] < 1:
        return None
    for s in range(1, stages - 1):
        reach_end[s + 1] = _max_end(model, reach_end[s], s, bound)
    last_start = max(stages - 1, _min_start_py(model, n, stages - 1, bound))
    if last_start > min(reach_end[stages - 1], n - 1):
        return None
    bounds = [n, last_start]
    for s in range(stages - 2, 0, -1):
        bounds.append(max(s, _min_start_py(model, bounds[-1], s, bound)))
    bounds.append(0)
    bounds.reverse()
    return tuple(bounds)


def _largest_layer(model: StageModel) -> tuple[float, float]:
    """The largest single-layer load and memory (cached on the model)."""
    cached: tuple[float, float] | None = model.__dict__.get("_largest_layer")
    if cached is None:
        cached = (float(np.max(np.diff(model.prefix_load))), float(np.max(np.diff(model.prefix_memory))))
        object.__setattr__(model, "_largest_layer", cached)
    return cached


def _end_candidates(model: StageModel) -> tuple[FloatArray, FloatArray]:
    """Sorted loads the first and the last stage can have (they do not depend on the bound)."""
    cached: tuple[FloatArray, FloatArray] | None = model.__dict__.get("_end_candidates")
    if cached is None:
        n, last = model.num_layers, model.num_stages - 1
        if last == 0:
            first = np.asarray([model.load(0, n, 0)])
            cached = (first, first)
        else:
            cuts = np.arange(1, n, dtype=np.int64)
            zeros, fulls = np.zeros(len(cuts), dtype=np.int64), np.full(len(cuts), n, dtype=np.int64)
            first = model.loads_of(zeros, cuts, zeros)
            lasts = model.loads_of(cuts, fulls, np.full(len(cuts), last, dtype=np.int64))
            cached = (np.sort(first), np.sort(lasts))
        object.__setattr__(model, "_end_candidates", cached)
    return cached


def _link_key(model: StageModel, stage: int) -> int:
    """The first stage whose link row equals ``stage``'s (stages with equal rows share search tables)."""
    cached: list[int] | None = model.__dict__.get("_link_keys")
    if cached is None:
        keys: list[int] = []
        seen: dict[bytes, int] = {}
        for row in model.comm:
            keys.append(seen.setdefault(row.tobytes(), len(keys)))
        object.__setattr__(model, "_link_keys", keys)
        cached = keys
    return cached[stage]


def next_candidate(model: StageModel, bound: float) -> float:
    """The smallest achievable stage load strictly greater than ``bound`` (``inf`` if none).

    The candidate set is every ``load(a, b, s)`` a stage could have, searched lazily. First and last
    stages have a fixed start or end, so their loads are sorted once. For a middle stage ending at
    ``b`` only the largest start that *violates* the bound matters, because a load only grows as the
    stage starts earlier. Middle stages that differ (speed, link, extras) are searched one kind at a
    time. A value from a superset of the real candidates is still a valid lower bound on the optimum
    whenever ``bound`` is infeasible, which is all the search needs.
    """
    best = math.inf
    for values in _end_candidates(model):
        i = int(np.searchsorted(values, bound, side="right"))
        if i < len(values):
            best = min(best, float(values[i]))
    n = model.num_layers
    if model.num_stages <= 2 or n <= 2:
        return best
    ends = np.arange(2, n, dtype=np.int64)
    kinds = {
        (model.slowdown[s], _link_key(model, s), model.extra_load[s]): s
        for s in range(1, model.num_stages - 1)
    }
    for stage in kinds.values():
        add = model.comm[stage, ends - 1]
        start = (
            _min_start(model.prefix_load, ends, add, model.extra_load[stage], bound, model.slowdown[stage])
            - 1
        )
        ok = start >= 1
        if np.any(ok):
            st, en = start[ok], ends[ok]
            vals = model.loads_of(st, en, np.full(len(st), stage, dtype=np.int64))
            vals = vals[vals > bound]
            if len(vals):
                best = min(best, float(np.min(vals)))
    return best
