"""Measurements -> Hardware: worker slowdowns from reference-workload times, costs on the reference worker."""

import pytest

from lightning_dynmo.balancing import BalanceProblem, LayerCost, Placement
from lightning_dynmo.balancing.hardware import to_reference, whole_backward_ratio, worker_slowdown


def test_slowdowns_are_relative_to_the_fastest_and_noise_is_ignored():
    assert worker_slowdown([0.010, 0.030], [0, 1]) == pytest.approx([1.0, 3.0])
    assert worker_slowdown([0.020, 0.010, 0.0104], [0, 1, 2]) == pytest.approx([2.0, 1.0, 1.0])
    assert worker_slowdown([0.010, 0.0104], [0, 1]) is None  # within 5%: alike
    assert worker_slowdown([0.010, 0.0104], [0, 1], tolerance=0.01) == pytest.approx([1.0, 1.04])


def test_replicas_at_one_position_count_as_their_slowest():
    # 2 replicas x 2 pipeline ranks: active ranks at positions 0, 1, 0, 1.
    assert worker_slowdown([0.01, 0.01, 0.01, 0.02], [0, 1, 0, 1]) == pytest.approx([1.0, 2.0])


@pytest.mark.parametrize(
    ("probe", "positions", "match"),
    [
        ([0.01], [0, 1], r"probe_s has 1 entries and pipeline_ranks 2"),
        ([0.01, 0.0], [0, 1], r"must all be > 0 seconds"),
        ([0.01, 0.02], [0, 2], r"no probe time for pipeline ranks \[1\]"),
    ],
)
def test_bad_probe_times_are_rejected(probe, positions, match):
    with pytest.raises(ValueError, match=match):
        worker_slowdown(probe, positions)


def test_costs_measured_on_slow_workers_are_brought_to_the_reference():
    measured = [LayerCost(fwd_time_s=1.0, bwd_time_s=2.0, memory_bytes=7)] * 2 + [
        LayerCost(fwd_time_s=3.0, bwd_time_s=6.0, memory_bytes=7)
    ] * 2
    reference = to_reference(measured, Placement.from_string("0-1|2-3"), [0, 1], [1.0, 3.0])
    assert reference == [LayerCost(fwd_time_s=1.0, bwd_time_s=2.0, memory_bytes=7)] * 4


def _cost(fwd: float, bwd: float, weight: float, params: int) -> LayerCost:
    return LayerCost(fwd_time_s=fwd, bwd_time_s=bwd, bwd_weight_time_s=weight, num_params=params)


def test_the_whole_to_split_backward_ratio_compares_alike_layers_measured_both_ways():
    # Blocks of 10 parameters: measured whole (weight part = all of it) bwd/fwd 1.5 and 2.5 (median 2),
    # measured split 2.5, 2.4 and 2.6 (median 2.5): 0.8. A layer of 7 parameters, measured split only,
    # does not count.
    whole = [_cost(2, 3, 3, 10), _cost(2, 5, 5, 10)]
    blocks = [*whole, _cost(2, 5, 2, 10), _cost(1, 2.4, 1, 10), _cost(1, 2.6, 1, 10)]
    assert whole_backward_ratio([*blocks, _cost(1, 9, 4, 7)]) == pytest.approx(0.8)
    # Two groups with both kinds: the median of their ratios (0.8 and 0.5 -> 0.65).
    assert whole_backward_ratio([*blocks, _cost(1, 1, 1, 7), _cost(1, 2, 1, 7)]) == pytest.approx(0.65)


def test_without_alike_layers_measured_both_ways_the_ratio_is_one():
    assert whole_backward_ratio([]) == 1.0
    assert whole_backward_ratio([_cost(1, 2, 1, 10), _cost(1, 3, 1, 10)]) == 1.0  # all split (or 1F1B)
    assert whole_backward_ratio([_cost(1, 2, 2, 10), _cost(1, 4, 1, 11)]) == 1.0  # not alike
    assert whole_backward_ratio([_cost(1, 2, 2, 0), _cost(1, 4, 1, 0)]) == 1.0  # parameter-free: unknown
    assert whole_backward_ratio([_cost(1, 2, 2, 10), _cost(0, 0, 0, 10)]) == 1.0  # nothing timed split
    assert whole_backward_ratio([_cost(1, 3, 3, 10), _cost(1, 2, 1, 10)]) == 1.0  # 1.5 measured: noise


def test_a_whole_backward_shorter_than_the_input_gradient_alone_does_not_count():
    # The first stage: one trainable block measured whole (bwd/fwd 2) behind two frozen ones whose whole
    # backward is a sliver (0.05); elsewhere trainable blocks split 2.5 with an input part of 1.5.
    first = [_cost(1, 0.05, 0.05, 10), _cost(1, 0.05, 0.05, 10), _cost(1, 2, 2, 10)]
    elsewhere = [_cost(1, 2.5, 1, 10)] * 3
    assert whole_backward_ratio([*first, *elsewhere]) == pytest.approx(0.8)
    # (Counted, the frozen ones' median would set it: 0.05 / 2.5 = 0.02, as before this rule.)
    # Only frozen ones measured whole: nothing alike to compare, the ratio stays 1.
    assert whole_backward_ratio([*first[:2], *elsewhere]) == 1.0


def test_frozen_layers_of_the_same_size_do_not_count_as_split_ones():
    # Trainable blocks: whole bwd/fwd 2 (first stage), split 2.5 (weight part timed): 0.8. Frozen blocks
    # of the same size elsewhere run no weight pass (bwd/fwd 1, weight part 0).
    trainable = [_cost(1, 2, 2, 10), _cost(1, 2.5, 1, 10), _cost(1, 2.5, 1, 10)]
    frozen = [_cost(1, 1, 0, 10)] * 3
    assert whole_backward_ratio([*trainable, *frozen]) == pytest.approx(0.8)
    # Negative control: counted as split, the frozen ones would pull the split median to 1 and give 1
    # (the ratio 2 is capped).
    as_if_split = [_cost(1, 1, 0.5, 10)] * 3
    assert whole_backward_ratio([*trainable, *as_if_split]) == 1.0


def test_a_problem_computes_its_whole_to_split_ratio_once_and_only_in_the_time_view():
    costs = [
        _cost(2, 3, 3, 10),
        _cost(2, 5, 5, 10),
        _cost(2, 5, 2, 10),
        _cost(1, 2.4, 1, 10),
        _cost(1, 2.6, 1, 10),
    ]
    problem = BalanceProblem(costs)
    assert problem.whole_to_split == pytest.approx(0.8) == whole_backward_ratio(costs)
    assert "whole_to_split" in vars(problem)  # cached: a search's thousands of predictions reuse it
    assert BalanceProblem(costs, by="params").whole_to_split == 1.0
