"""Cost smoothing for fine-grained dynamism: act on what persists, not on one noisy window."""

from __future__ import annotations

import random

import pytest

from lightning_dynmo.balancing import BalanceProblem, LayerCost, partition
from lightning_dynmo.balancing.policy import smooth_costs
from lightning_dynmo.callback import DynMoCallback, ProfilingConfig


def _costs(times: list[float], params: int = 7) -> list[LayerCost]:
    return [LayerCost(fwd_time_s=t, bwd_time_s=2 * t, num_params=params) for t in times]


def test_moving_average_of_times_sizes_from_the_new_window():
    out = smooth_costs(_costs([1.0, 2.0]), _costs([3.0, 0.0], params=9), weight=0.75)
    assert [c.fwd_time_s for c in out] == [1.5, 1.5]
    assert [c.bwd_time_s for c in out] == [3.0, 3.0]
    assert {c.num_params for c in out} == {9}
    assert smooth_costs(None, _costs([3.0]), 0.75) == _costs([3.0])
    assert smooth_costs(_costs([1.0]), _costs([3.0]), 0.0) == _costs([3.0])


def test_noise_that_does_not_persist_stops_moving_layers_a_drift_does_not():
    rng = random.Random(0)
    smoothed, raw_moves, smoothed_moves = None, 0, 0
    for _ in range(200):  # 8 equal layers, +-50% i.i.d. noise per window
        window = _costs([1.0 + rng.uniform(-0.5, 0.5) for _ in range(8)])
        smoothed = smooth_costs(smoothed, window, 0.8)
        raw_moves += str(partition(BalanceProblem(window), 2)) != "0-3|4-7"
        smoothed_moves += str(partition(BalanceProblem(smoothed), 2)) != "0-3|4-7"
    assert smoothed_moves < raw_moves / 2  # the average converges to equal layers: uniform stays optimal
    drift, changed = smoothed, _costs([0.2] * 4 + [1.0] * 4)
    for _ in range(40):  # a real change: the first half becomes cheap and stays so
        drift = smooth_costs(drift, changed, 0.8)
    assert (
        partition(BalanceProblem(drift), 2)
        == partition(BalanceProblem(changed), 2)
        != partition(BalanceProblem(_costs([1.0] * 8)), 2)
    )


@pytest.mark.parametrize(
    ("weight", "match"), [(1.0, r"cost_smoothing=1.0 must be in \[0, 1\)"), (-0.1, "-0.1")]
)
def test_bad_weight_is_rejected_by_the_callback_and_the_function(weight, match):
    with pytest.raises(ValueError, match=match):
        DynMoCallback(profiling=ProfilingConfig(cost_smoothing=weight))
    with pytest.raises(ValueError, match=match):
        smooth_costs(None, _costs([1.0]), weight)
    with pytest.raises(ValueError, match="previous has 1 layers but measured has 2"):
        smooth_costs(_costs([1.0]), _costs([1.0, 1.0]), 0.5)


def test_defaults_follow_the_trigger():
    assert DynMoCallback(every_step=True).profiling.cost_smoothing == 0.5
    assert DynMoCallback(every_n_steps=10).profiling.cost_smoothing == 0.0


def test_the_background_search_switch_must_be_a_bool():
    with pytest.raises(
        ValueError, match=r"ProfilingConfig\(background_decisions='yes'\) must be True or False"
    ):
        ProfilingConfig(background_decisions="yes")  # type: ignore[arg-type]
    assert DynMoCallback(profiling=ProfilingConfig(background_decisions=True)).profiling.background_decisions


def test_the_cost_margin_must_be_a_number_of_at_least_zero():
    for bad in (-0.5, float("nan"), True, "1"):
        with pytest.raises(ValueError, match=r"ProfilingConfig\(cost_margin=.*\) must be a number >= 0"):
            ProfilingConfig(cost_margin=bad)  # type: ignore[arg-type]
    resolved = ProfilingConfig(cost_margin=0.0).resolved(every_step=True)
    assert resolved.cost_margin == 0.0 and ProfilingConfig().resolved(every_step=False).cost_margin == 1.0
