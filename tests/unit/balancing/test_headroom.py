"""The headroom bound that lets an every-step DynMoCallback skip balanced steps."""

from __future__ import annotations

import pytest

from lightning_dynmo.balancing import BalanceProblem, Placement, partition
from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.headroom import StageLoadAverage, headroom, share_drift


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
    avg.update([1.0, 3.0])  # one imbalanced step moves the average halfway
    assert avg.loads == [1.0, 2.0]
    assert avg.headroom == pytest.approx(1 - 1.5 / 2.0)
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
    assert heavy.headroom is not None and heavy.headroom > 0.2


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
    avg.restart()  # a new placement or an event: the mark described the old loads
    avg.update([2.0, 2.0])
    assert avg.drift is None
    avg.mark()
    avg.update([1.0, 1.0, 1.0])  # another stage count: another pipeline
    assert avg.drift is None
