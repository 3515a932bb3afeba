"""The headroom bound that lets an every-step DynMoCallback skip balanced steps."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_dynmo.balancing import BalanceProblem, Placement, partition
from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.headroom import (
    StageLoadAverage,
    headroom,
    pinned_bottleneck,
    pinned_headroom,
    pinned_workers,
    share_drift,
)


def test_headroom_is_what_the_best_split_of_the_same_work_could_save() -> None:
    assert headroom([2.0, 2.0]) == 0.0
    assert headroom([0.0, 0.0]) == 0.0
    assert headroom([1.0, 3.0]) == pytest.approx(1 - 2 / 3)
    # The bound holds against the exact partition: 1 unit + 3 units of four equal layers.
    costs = [LayerCost(fwd_time_s=1.0) for _ in range(4)]
    before = Placement.from_sizes([1, 3])
    best = partition(BalanceProblem(costs), 2)
    gain = 1 - max(len(best.layers_of(s)) for s in range(2)) / max(len(before.layers_of(s)) for s in range(2))
    assert gain <= headroom([1.0, 3.0]) + 1e-12
    assert gain == pytest.approx(headroom([1.0, 3.0]))  # and is reached here


@pytest.mark.parametrize("loads", [[], [1.0, -1.0], [1.0, float("nan")], [float("inf"), 1.0]])
def test_headroom_refuses_loads_that_are_not_times(loads: list[float]) -> None:
    with pytest.raises(ValueError, match="must be one finite number >= 0 per stage"):
        headroom(loads)


def test_the_average_follows_the_loads_and_restarts() -> None:
    avg = StageLoadAverage(0.5)
    assert avg.headroom is None and avg.loads is None
    avg.update([1.0, 1.0])
    assert avg.headroom == 0.0
    avg.update([1.0, 3.0])  # bias-corrected: the second step weighs 2/3, the first 1/3
    assert avg.loads == pytest.approx([1.0, 7 / 3])
    assert avg.headroom == pytest.approx(1 - (5 / 3) / (7 / 3))
    avg.update([1.0, 3.0])  # weights 1/7, 2/7, 4/7
    assert avg.loads == pytest.approx([1.0, 1 / 7 + 6 / 7 + 12 / 7])
    avg.restart()
    assert avg.headroom is None
    avg.update([1.0, 3.0])  # after a restart, the first step is the whole history
    assert avg.loads == [1.0, 3.0]
    avg.update([1.0, 1.0, 1.0])  # another stage count: a new pipeline, a fresh average
    assert avg.loads == [1.0, 1.0, 1.0]


def test_without_history_the_average_is_the_last_step() -> None:
    avg = StageLoadAverage(0.0)
    avg.update([1.0, 3.0])
    avg.update([2.0, 2.0])
    assert avg.headroom == 0.0
    heavy = StageLoadAverage(0.9)  # negative control: with history the imbalance lingers
    heavy.update([1.0, 3.0])
    heavy.update([2.0, 2.0])
    assert heavy.headroom is not None and heavy.headroom > 0.15


@pytest.mark.parametrize("weight", [-0.1, 1.0, 2.0])
def test_the_average_refuses_a_weight_outside_its_range(weight: float) -> None:
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\)"):
        StageLoadAverage(weight)


def test_share_drift_ignores_a_step_that_scales_every_stage_alike() -> None:
    assert share_drift([1.0, 3.0], [2.0, 6.0]) == 0.0
    assert share_drift([0.0, 0.0], [1.0, 1.0]) == 0.0  # no load reads as equal shares
    # Shares 0.25 / 0.75 -> 0.5 / 0.5: each moved 0.25, a third of the busiest share before.
    assert share_drift([1.0, 3.0], [2.0, 2.0]) == pytest.approx(0.25 / 0.75)


def test_share_drift_refuses_two_pipelines() -> None:
    with pytest.raises(ValueError, match="compare one pipeline"):
        share_drift([1.0, 1.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="one finite number >= 0 per stage"):
        share_drift([1.0, -1.0], [1.0, 1.0])


def test_the_drift_is_measured_from_the_mark_until_a_restart() -> None:
    avg = StageLoadAverage(0.0)
    avg.update([1.0, 3.0])
    assert avg.drift is None  # nothing marked
    avg.mark()
    avg.update([1.1, 3.3])  # a slower step, same shares
    assert avg.drift == pytest.approx(0.0)
    avg.update([2.0, 2.0])
    assert avg.drift == pytest.approx(1 / 3)
    avg.restart()  # a new placement: the mark described the old loads
    avg.update([2.0, 2.0])
    assert avg.drift is None
    avg.mark()
    avg.update([1.0, 1.0, 1.0])  # another stage count: another pipeline
    assert avg.drift is None


def test_stale_loads_are_measured_again_against_the_same_mark() -> None:
    avg = StageLoadAverage(0.5)
    avg.update([1.0, 3.0])
    avg.mark()
    assert avg.marked
    avg.stale()  # an event: the averaged loads may describe the old model
    assert avg.loads is None and avg.drift is None and avg.marked
    avg.update([2.0, 6.2])  # the first step after it, not averaged with the old loads
    assert avg.loads == [2.0, 6.2]
    assert avg.drift == pytest.approx(abs(6.2 / 8.2 - 0.75) / 0.75)
    # Negative control: a restart forgets the mark too.
    avg.restart()
    avg.update([2.0, 6.2])
    assert not avg.marked and avg.drift is None


def test_a_restart_can_mark_the_loads_a_decision_predicted() -> None:
    avg = StageLoadAverage(0.0)
    avg.update([1.0, 3.0])
    avg.restart(expected=[2.0, 2.0])  # a move predicted to share the load out evenly
    assert avg.loads is None and avg.drift is None  # nothing measured on the new placement yet
    avg.update([2.2, 2.1])  # as predicted, within a few percent
    assert avg.drift == pytest.approx(abs(2.2 / 4.3 - 0.5) / 0.5)
    avg.update([1.0, 3.0])  # not as predicted
    assert avg.drift == pytest.approx(0.5)
    # Negative controls: a restart without a prediction marks nothing; another stage count compares none.
    avg.restart()
    avg.update([2.0, 2.0])
    assert avg.drift is None
    avg.restart(expected=[1.0, 1.0, 1.0])
    avg.update([2.0, 2.0])
    assert avg.drift is None
    with pytest.raises(ValueError, match="must be one finite number"):
        avg.restart(expected=[1.0, -1.0])


def _stage_loads(costs: list[float], first: float, last: float, sizes: tuple[int, ...]) -> list[float]:
    bounds = [0, *itertools.accumulate(sizes)]
    loads = [sum(costs[bounds[s] : bounds[s + 1]]) for s in range(len(sizes))]
    loads[0] += first
    loads[-1] += last
    return loads


def _all_sizes(num_layers: int, num_stages: int) -> list[tuple[int, ...]]:
    cuts = itertools.combinations(range(1, num_layers), num_stages - 1)
    return [tuple(b - a for a, b in zip((0, *c), (*c, num_layers), strict=True)) for c in cuts]


def test_a_pinned_bottleneck_is_never_beaten_by_any_placement_of_whole_layers() -> None:
    rng = random.Random(0)
    found = 0
    for _ in range(300):
        layers, stages = rng.randint(3, 8), rng.randint(2, 4)
        if stages > layers:
            continue
        costs = [rng.uniform(0.5, 2.0) for _ in range(layers)]
        first, last = rng.choice([0.0, rng.uniform(0, 6)]), rng.choice([0.0, rng.uniform(0, 6)])
        placements = _all_sizes(layers, stages)
        for sizes in placements:
            loads = _stage_loads(costs, first, last, sizes)
            if pinned_bottleneck(loads, sizes) is None:
                continue
            found += 1
            best = min(max(_stage_loads(costs, first, last, other)) for other in placements)
            assert best == pytest.approx(max(loads)), (costs, first, last, sizes)
    assert found > 50  # the property was exercised


def _v_workers(stages: int) -> list[int]:
    """Stage ``s``'s rank in a V of ``stages`` stages over ``stages // 2`` ranks (``ZBVZeroBubble``)."""
    ranks = stages // 2
    return [s if s < ranks else stages - 1 - s for s in range(stages)]


def _worker_loads(stage_loads: list[float], workers: list[int]) -> list[float]:
    loads = [0.0] * (max(workers) + 1)
    for w, load in zip(workers, stage_loads, strict=True):
        loads[w] += load
    return loads


def _draw(
    rng: random.Random, stages: int, workers: list[int]
) -> tuple[float, list[tuple[tuple[int, ...], list[float]]]]:
    """A random problem on ``stages`` stages run by ``workers``: every placement with its ranks' loads,
    and the lowest busiest-rank load over them."""
    layers = rng.randint(stages, stages + 4)
    costs = [rng.uniform(0.5, 2.0) for _ in range(layers)]
    first, last = rng.uniform(0, 4), rng.uniform(0, 6)
    every = [
        (sizes, _worker_loads(_stage_loads(costs, first, last, sizes), workers))
        for sizes in _all_sizes(layers, stages)
    ]
    return min(max(loads) for _, loads in every), every


def test_a_pinned_rank_of_a_v_is_never_beaten_by_any_placement_of_whole_layers() -> None:
    # Two stages a rank in a V: rank 0 runs both end stages. Once each holds one layer and rank 0 is the
    # busiest, no placement lowers the busiest rank's load, checked against every placement.
    rng = random.Random(1)
    found = missed = 0
    for _ in range(400):
        stages = rng.choice([4, 6])
        workers = _v_workers(stages)
        best, every = _draw(rng, stages, workers)
        for sizes, loads in every:
            if pinned_bottleneck(loads, sizes, workers) is None:
                missed += best < max(loads) - 1e-9
                continue
            found += 1
            assert best == pytest.approx(max(loads)), (loads, sizes)
    # The property was exercised, and the rule does not hold everywhere (it is not vacuous).
    assert found > 50 and missed > 50


def test_pinned_headroom_bounds_what_any_placement_saves_off_the_busiest_rank() -> None:
    # One stage a rank and a V of two a rank: no placement's busiest rank is below the current one by more
    # than pinned_headroom, checked against every placement; the floor is tight (some placement reaches
    # it) on many draws, and it is tighter than the mean's bound on many.
    rng = random.Random(2)
    tighter = reached = 0
    for _ in range(300):
        stages = rng.choice([3, 4, 6])
        workers = _v_workers(stages) if stages % 2 == 0 and rng.random() < 0.5 else list(range(stages))
        best, every = _draw(rng, stages, workers)
        for sizes, loads in every:
            room = pinned_headroom(loads, sizes, workers)
            assert best >= max(loads) * (1.0 - room) - 1e-9, (loads, sizes, workers)
            assert room <= headroom(loads) + 1e-12
            tighter += room < headroom(loads) - 1e-9
            reached += best == pytest.approx(max(loads) * (1.0 - room))
    assert tighter > 100 and reached > 100


def test_pinned_headroom_is_the_gap_to_the_heavier_pinned_rank() -> None:
    # One stage a rank: the first and the last stage hold one layer each (ranks 0 and 2 pinned).
    assert pinned_workers((1, 3, 1)) == (0, 2)
    assert pinned_headroom([4.0, 5.0, 1.0], (1, 3, 1)) == pytest.approx(1 - 4.0 / 5.0)
    assert pinned_headroom([5.0, 4.0, 1.0], (1, 3, 1)) == 0.0  # the pinned rank is the busiest
    # A V: rank 0 runs both end stages; interleaved, no rank runs only end stages.
    v, interleaved, sizes, loads = [0, 1, 2, 2, 1, 0], [0, 1, 2, 0, 1, 2], (1, 2, 2, 2, 2, 1), [4.5, 5.0, 1.0]
    assert pinned_workers(sizes, v) == (0,)
    assert pinned_workers(sizes, interleaved) == ()
    assert pinned_headroom(loads, sizes, v) == pytest.approx(0.1)
    # Negative controls: the mean's bound when nothing is pinned, or when it is the tighter one; loads
    # that cannot be mapped to stages (several a rank, no ranks given) keep the plain headroom.
    assert pinned_headroom(loads, sizes, interleaved) == pytest.approx(headroom(loads))
    assert pinned_headroom([1.0, 9.0, 2.0], (1, 3, 1)) == pytest.approx(headroom([1.0, 9.0, 2.0]))
    assert pinned_headroom(loads, sizes) == pytest.approx(headroom(loads))
    with pytest.raises(ValueError, match="must name one worker"):
        pinned_headroom([4.5, 5.0], (1, 3, 3, 1), [0, 1, 1])
    with pytest.raises(ValueError, match="must name one worker"):
        pinned_workers((1, 3, 3, 1), [0, 1, -1, 0])


def test_pinned_bottleneck_of_a_v_needs_both_end_stages_of_one_layer_on_the_busiest_rank() -> None:
    workers = _v_workers(4)  # [0, 1, 1, 0]
    assert pinned_bottleneck([5.0, 2.0], (1, 3, 3, 1), workers) == 0
    # Negative controls: two layers on either end stage could move off rank 0; a busiest middle rank
    # could shed a layer; per-stage loads cannot be read as per-rank ones without the ranks.
    assert pinned_bottleneck([5.0, 2.0], (2, 3, 2, 1), workers) is None
    assert pinned_bottleneck([5.0, 2.0], (1, 3, 2, 2), workers) is None
    assert pinned_bottleneck([2.0, 5.0], (1, 3, 3, 1), workers) is None
    assert pinned_bottleneck([5.0, 2.0], (1, 3, 3, 1)) is None
    # Interleaved (stage s on rank s % 2): no rank runs both end stages, and a rank whose other stage is
    # a middle one is never pinned.
    assert pinned_bottleneck([5.0, 2.0], (1, 3, 3, 1), [0, 1, 0, 1]) is None
    assert pinned_bottleneck([2.0, 5.0], (1, 3, 3, 1), [0, 1, 0, 1]) is None
    with pytest.raises(ValueError, match="must name one worker"):
        pinned_bottleneck([5.0, 2.0], (1, 3, 3, 1), [0, 1, 2, 0])
    with pytest.raises(ValueError, match="must name one worker"):
        pinned_bottleneck([5.0, 2.0], (1, 3, 3, 1), [0, 1, 0])


def test_pinned_bottleneck_names_only_an_end_stage_of_one_layer_that_is_the_busiest() -> None:
    assert pinned_bottleneck([1.0, 1.0, 5.0], (2, 3, 1)) == 2  # a head on a one-layer last stage
    assert pinned_bottleneck([5.0, 1.0, 1.0], (1, 3, 2)) == 0  # an embedding on a one-layer first stage
    # Negative controls: two layers on the busiest end stage could be split; a busiest middle stage of
    # one layer could take a lighter layer; several stages per rank do not map loads to stages.
    assert pinned_bottleneck([1.0, 1.0, 5.0], (2, 2, 2)) is None
    assert pinned_bottleneck([1.0, 5.0, 1.0], (3, 1, 2)) is None
    assert pinned_bottleneck([1.0, 5.0], (1, 1, 1, 1)) is None
    # A busiest stage that could shed load is not a pinned bottleneck, and some placement beats it.
    costs, sizes = [1.0, 1.0, 1.0, 1.0], (1, 3)
    assert pinned_bottleneck(_stage_loads(costs, 0.0, 0.0, sizes), sizes) is None
    assert min(max(_stage_loads(costs, 0.0, 0.0, o)) for o in _all_sizes(4, 2)) < 3.0
