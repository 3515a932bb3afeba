"""An independent check of the projection's best fixed placement: its own step evaluator and search.

Shares no code with :mod:`lightning_dynmo.balancing` (no balancer, no step model, no simulator): it takes
plain numbers (per layer and row, forward and backward seconds of one whole step; the pinned embedding and
head + loss) and per rank the schedule's ordered actions ``(stage, kind, micro_batch)`` (torch's order,
the one input it shares with the code under test). Its evaluator runs those lists as a dependency graph:
``F(s, m)`` after ``F(s-1, m)``; ``B``/``I(s, m)`` after the next stage's ``B``/``I(s+1, m)`` (the last
stage: after its own ``F``); every action after the one before it on its rank. Under a split backward
``I`` and ``W`` halve the backward, except on stage 0, whose whole backward is its ``W`` (torch has no
input gradient to send there). Transfers cost nothing (the projection's costs carry no activation bytes).

Its search, bounded: its own exact min-max split of the mean costs (binary search on the bottleneck with a
greedy feasibility check over the layers, parts included); where a rank holds several stages (ZBV's V),
that split moved layer by layer to the least heaviest rank; the best of 13 splits whose stage loads
follow a linear ramp (slopes -1.5 to 1.5, scored by the summed step); then steepest descent over
moving one stage boundary by one or two layers, scored by the whole trace's summed step, from each of
those and from the uniform split; the best placement found is returned as stage sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

Row = tuple[Sequence[tuple[float, float]], tuple[float, float], tuple[float, float]]  # layers, first, last
Actions = Sequence[Sequence[tuple[int, str, int]]]


def step_time(row: Row, sizes: Sequence[int], actions: Actions, microbatches: int) -> float:
    """One step of the placement ``sizes`` (layers per stage) on ``row``'s costs."""
    layers, first, last = row
    stages = len(sizes)
    fwd, bwd, start = [0.0] * stages, [0.0] * stages, 0
    for s, n in enumerate(sizes):
        for f, b in layers[start : start + n]:
            fwd[s] += f
            bwd[s] += b
        start += n
    fwd[0] += first[0]
    bwd[0] += first[1]
    fwd[-1] += last[0]
    bwd[-1] += last[1]
    cost: dict[tuple[int, str], float] = {}
    for s in range(stages):
        f, b = fwd[s] / microbatches, bwd[s] / microbatches
        cost[(s, "F")], cost[(s, "B")] = f, b
        cost[(s, "I")], cost[(s, "W")] = (0.0, b) if s == 0 else (b / 2, b / 2)
    done: dict[tuple[int, str, int], float] = {}
    pos, clock = [0] * len(actions), [0.0] * len(actions)
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for r, acts in enumerate(actions):
            while pos[r] < len(acts):
                s, kind, m = acts[pos[r]]
                if kind == "F":
                    dep = (s - 1, "F", m) if s > 0 else None
                elif kind in ("B", "I"):
                    if s == stages - 1:
                        dep = (s, "F", m)
                    else:
                        dep = (s + 1, "B", m) if (s + 1, "B", m) in done else (s + 1, "I", m)
                else:
                    dep = None
                if dep is not None and dep not in done:
                    break
                t0 = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = t0 + cost[(s, kind)]
                done[(s, kind, m)] = clock[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the action lists deadlock: check the schedule's order and the stage count.")
    return max(clock)


def total(rows: Sequence[Row], sizes: Sequence[int], actions: Actions, microbatches: int) -> float:
    """The summed step over every row."""
    return sum(step_time(r, sizes, actions, microbatches) for r in rows)


def minmax_sizes(loads: Sequence[float], first: float, last: float, stages: int) -> list[int]:
    """An exact min-max split of ``loads`` into ``stages`` non-empty runs, ``first``/``last`` pinned."""

    def fits(cap: float) -> list[int] | None:
        sizes: list[int] = []
        acc, n = first, 0
        for i, x in enumerate(loads):
            left_layers, left_stages = len(loads) - i, stages - len(sizes)
            if n and (acc + x > cap or left_layers < left_stages):
                sizes.append(n)
                acc, n = 0.0, 0
            acc += x
            n += 1
            if acc > cap:
                return None
        sizes.append(n)
        if len(sizes) > stages or acc + last > cap:
            return None
        while len(sizes) < stages:  # split the largest runs; a smaller stage never raises the max
            k = max(range(len(sizes)), key=lambda j: sizes[j])
            if sizes[k] < 2:
                return None
            sizes[k : k + 1] = [sizes[k] - 1, 1] if k < len(sizes) - 1 else [1, sizes[k] - 1]
        return sizes

    lo, hi = max(max(loads), first, last), sum(loads) + first + last
    best = fits(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        got = fits(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    assert best is not None
    return best


def rank_balanced(
    sizes: Sequence[int],
    loads: Sequence[float],
    first: float,
    last: float,
    rank_of: Sequence[int],
    lean: int = 0,
) -> list[int]:
    """``sizes`` moved, one layer at a time between any two stages, to the least heaviest rank (ties: the
    least sum of squared rank loads, then layers on later stages for ``lean=1``, earlier for ``-1``);
    ``rank_of[s]`` is stage ``s``'s rank (a V layout puts two there)."""

    def score(sz: Sequence[int]) -> tuple[float, float, float]:
        per_rank = [0.0] * (max(rank_of) + 1)
        start = 0
        for s, n in enumerate(sz):
            per_rank[rank_of[s]] += sum(loads[start : start + n])
            start += n
        per_rank[rank_of[0]] += first
        per_rank[rank_of[-1]] += last
        top = max(per_rank)
        return (
            round(top, 9),
            round(sum(x * x for x in per_rank) / (top * top), 9),
            -lean * sum(s * n for s, n in enumerate(sz)),
        )

    best, best_score = list(sizes), score(sizes)
    while True:
        improved = False
        for a in range(len(best)):
            for b in range(len(best)):
                if a == b or best[a] < 2:
                    continue
                cand = list(best)
                cand[a] -= 1
                cand[b] += 1
                got = score(cand)
                if got < best_score:
                    best, best_score, improved = cand, got, True
        if not improved:
            return best


def ramp_sizes(loads: Sequence[float], first: float, last: float, stages: int, slope: float) -> list[int]:
    """Stage loads that follow a linear ramp: stage ``s`` aims at a share ``1 + slope (s / (S-1) - 1/2)``
    of the mean (``slope > 0``: later stages heavier), the parts included; every stage keeps a layer."""
    weights = [max(0.05, 1 + slope * (s / max(1, stages - 1) - 0.5)) for s in range(stages)]
    whole = sum(loads) + first + last
    cuts, acc, i, target = [], first, 0, 0.0
    for s in range(stages - 1):
        target += whole * weights[s] / sum(weights)
        start = i
        while i < len(loads) - (stages - 1 - s) and (i == start or acc + loads[i] / 2 <= target):
            acc += loads[i]
            i += 1
        cuts.append(i)
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(loads)], strict=True)]
    return sizes


def search(rows: Sequence[Row], stages: int, actions: Actions, microbatches: int) -> list[int]:
    """The best fixed placement (stage sizes) over ``rows`` that the bounded search finds."""
    n = len(rows[0][0])
    mean = [sum(r[0][i][0] + r[0][i][1] for r in rows) / len(rows) for i in range(n)]
    first = sum(sum(r[1]) for r in rows) / len(rows)
    last = sum(sum(r[2]) for r in rows) / len(rows)
    base, extra = divmod(n, stages)
    rank_of = [0] * stages
    for r, acts in enumerate(actions):
        for s, _, _ in acts:
            rank_of[s] = r
    split = minmax_sizes(mean, first, last, stages)
    starts = [split, [base + (s < extra) for s in range(stages)]]
    slopes = [x / 4 for x in range(-6, 7)]
    ramps = [ramp_sizes(mean, first, last, stages, k) for k in slopes]
    starts.append(min(ramps, key=lambda sz: total(rows, sz, actions, microbatches)))
    if len(set(rank_of)) < stages:  # several stages per rank: also balance the ranks' loads
        starts += [rank_balanced(split, mean, first, last, rank_of, lean) for lean in (0, 1, -1)]
    best, best_t = starts[0], total(rows, starts[0], actions, microbatches)
    for sizes in starts:
        t = total(rows, sizes, actions, microbatches)
        while True:
            moves = []
            for b in range(stages - 1):
                for d in (-2, -1, 1, 2):
                    cand = list(sizes)
                    cand[b] += d
                    cand[b + 1] -= d
                    if min(cand[b], cand[b + 1]) >= 1:
                        moves.append(cand)
            scored = [(total(rows, c, actions, microbatches), c) for c in moves]
            if not scored:  # one layer per stage: the only placement
                break
            t_new, c_new = min(scored, key=lambda x: x[0])
            if t_new >= t * (1 - 1e-12):
                break
            t, sizes = t_new, c_new
        if t < best_t:
            best, best_t = sizes, t
    return best
