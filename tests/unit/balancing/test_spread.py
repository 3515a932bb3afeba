"""The margin a decision plans with: each layer's averaged times plus standard deviations of the averaged
windows, from the same moving average of the squared times; and the placement it leads to."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lightning_dynmo.balancing import LayerCost
from lightning_dynmo.balancing.averaging import HistoryWeight
from lightning_dynmo.balancing.policy import smooth_costs
from lightning_dynmo.balancing.spread import TIME_FIELDS, squared_times, with_margin


def _cost(t: float, params: int = 5) -> LayerCost:
    return LayerCost(
        fwd_time_s=t, bwd_time_s=2 * t, bwd_weight_time_s=t, update_time_s=0.1 * t, num_params=params
    )


def _averaged(samples: list[list[LayerCost]], weight: float) -> tuple[list[LayerCost], list[LayerCost]]:
    """The bias-corrected moving averages of ``samples`` (one list of layers a step) and of their squares."""
    history, mean, squares = HistoryWeight(weight), None, None
    for costs in samples:
        h = history.next()
        mean = smooth_costs(mean, costs, h)
        squares = smooth_costs(squares, squared_times(costs), h)
    assert mean is not None and squares is not None
    return mean, squares


def _averages(samples: list[list[float]], weight: float) -> tuple[list[LayerCost], list[LayerCost]]:
    return _averaged([[_cost(t) for t in row] for row in samples], weight)


@pytest.mark.parametrize("weight", [0.0, 0.5, 0.8])
def test_the_margin_is_the_weighted_standard_deviation_of_the_samples(weight: float) -> None:
    samples = [[1.0, 3.0], [2.0, 3.0], [4.0, 3.0], [1.5, 3.0]]
    mean, squares = _averages(samples, weight)
    planned = with_margin(mean, squares, 2.0)
    ages = range(len(samples) - 1, -1, -1)
    weights = [(1 - weight) * weight**age if weight else float(age == 0) for age in ages]
    xs = [row[0] for row in samples]
    mu = sum(w * x for w, x in zip(weights, xs, strict=True)) / sum(weights)
    sd = math.sqrt(sum(w * (x - mu) ** 2 for w, x in zip(weights, xs, strict=True)) / sum(weights))
    assert planned[0].fwd_time_s == pytest.approx(mu + 2 * sd)
    for field in TIME_FIELDS:  # every time scales with the forward here, and so does its spread
        scale = getattr(_cost(1.0), field)
        assert getattr(planned[0], field) == pytest.approx(scale * (mu + 2 * sd))
    # A layer that keeps still is planned at what it measures; sizes carry no margin.
    assert planned[1].fwd_time_s == pytest.approx(3.0)
    assert planned[0].num_params == 5


def test_the_weight_gradient_part_keeps_its_share_of_the_backward() -> None:
    # A split backward's weight part swings while the whole backward keeps still: on its own margin the
    # part would exceed the backward it belongs to (LayerCost refuses that; a live replay raised it).
    samples = [
        LayerCost(fwd_time_s=1.0, bwd_time_s=2.0, bwd_weight_time_s=w, update_time_s=0.1) for w in (1.2, 2.0)
    ]
    mean, squares = _averaged([[cost] for cost in samples], 0.5)
    (planned,) = with_margin(mean, squares, 1.0)
    assert planned.bwd_time_s == pytest.approx(2.0) and planned.fwd_time_s == pytest.approx(1.0)
    assert planned.bwd_weight_time_s == pytest.approx(mean[0].bwd_weight_time_s)  # its share of 2.0
    # The backward's own margin carries the part with it, at the same share.
    swinging = [
        dataclasses.replace(c, bwd_time_s=b, bwd_weight_time_s=b / 2)
        for c, b in zip(samples, (2.0, 4.0), strict=True)
    ]
    mean, squares = _averaged([[cost] for cost in swinging], 0.5)
    (planned,) = with_margin(mean, squares, 1.0)
    assert planned.bwd_time_s > mean[0].bwd_time_s
    assert planned.bwd_weight_time_s == pytest.approx(planned.bwd_time_s / 2)


def test_no_margin_and_one_sample_plan_the_average() -> None:
    mean, squares = _averages([[1.0, 4.0], [3.0, 2.0]], 0.5)
    assert with_margin(mean, squares, 0.0) == mean
    mean, squares = _averages([[1.0, 4.0]], 0.5)
    assert [c.fwd_time_s for c in with_margin(mean, squares, 3.0)] == [1.0, 4.0]


def test_the_margin_plans_a_swinging_layer_as_the_bottleneck_it_becomes() -> None:
    # Six layers on three stages; the last one costs 0 or 2 in turn (mean 1, standard deviation 1).
    steady = [2.0, 2.0, 1.5, 1.2, 1.5]
    mean = [_cost(t) for t in [*steady, 1.0]]
    # The mean of the squares of 0 and 2 (every time scales with the forward): 2 = 1 + 1 squared.
    squares = squared_times([*mean[:5], _cost(math.sqrt(2.0))])
    assert with_margin(mean, squares, 1.0)[5].fwd_time_s == pytest.approx(2.0)
    splits = [
        ((0, a), (a, b), (b, 6)) for a in range(1, 5) for b in range(a + 1, 6)
    ]  # every contiguous 3-stage split

    def heaviest(split: tuple[tuple[int, int], ...], times: list[float]) -> float:
        return max(sum(times[lo:hi]) for lo, hi in split)

    def best(costs: list[LayerCost]) -> tuple[tuple[int, int], ...]:
        return min(splits, key=lambda split: heaviest(split, [c.fwd_time_s for c in costs]))

    on_average, with_spread = best(mean), best(with_margin(mean, squares, 1.0))
    assert on_average == ((0, 1), (1, 3), (3, 6))  # 3.7 on the average: the swinging layer's stage is tight
    assert with_spread == ((0, 2), (2, 4), (4, 6))  # 4.0 on the average, with slack beside it
    # Over the two steps the layer alternates between, the margin's split is the faster one (negative
    # control: on the average alone the other looked 7.5% faster).
    steps = [[*steady, 0.0], [*steady, 2.0]]
    mean_step = {
        split: sum(heaviest(split, times) for times in steps) / 2 for split in (on_average, with_spread)
    }
    assert mean_step[on_average] == pytest.approx(4.1) and mean_step[with_spread] == pytest.approx(4.0)


def test_bad_margins_and_mismatched_layers_are_refused() -> None:
    mean, squares = _averages([[1.0]], 0.5)
    for bad in (-0.5, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="must be a number >= 0"):
            with_margin(mean, squares, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mean has 1 layers but squares has 2"):
        with_margin(mean, squares * 2, 1.0)
