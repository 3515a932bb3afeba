"""The micro-batch count of a re-packed pipeline: simulated, bounded by memory and by the batch."""

import pytest

from lightning_dynmo.balancing import BalanceProblem, Hardware, LayerCost, Placement, simulate_pipeline
from lightning_dynmo.balancing.microbatches import RetuneOptions, choose_microbatches
from lightning_dynmo.balancing.policy import BalanceConfig, decide

BLOCKS = [LayerCost(fwd_time_s=1.0, bwd_time_s=2.0, memory_bytes=10) for _ in range(8)]


def test_each_candidate_is_the_simulated_step_of_equal_microbatches_with_a_per_op_cost():
    placement = Placement.from_string("0-3|4-7")
    choice = choose_microbatches(
        BalanceProblem(BLOCKS), placement, current=4, candidates=[1, 2, 4, 8], schedule="1F1B", per_op_s=0.1
    )
    for m, step in choice.predicted_step_s.items():
        expected = simulate_pipeline([4.0 / m + 0.1] * 2, [8.0 / m + 0.1] * 2, m, "1f1b").step_time_s
        assert step == pytest.approx(expected)
    assert (
        choice.num_microbatches == 8
    )  # 2 stages: more micro-batches shrink the bubble more than 0.1 s ops cost


def test_one_stage_has_no_bubble_so_the_fewest_microbatches_win():
    single = Placement.from_string("0-7")
    choice = choose_microbatches(
        BalanceProblem(BLOCKS), single, current=4, candidates=[1, 2, 4, 8], schedule="1F1B", per_op_s=0.01
    )
    assert choice.num_microbatches == 1
    free = choose_microbatches(
        BalanceProblem(BLOCKS), single, current=4, candidates=[1, 2, 4, 8], schedule="1F1B"
    )
    assert free.num_microbatches == 4  # no per-op cost: every count ties, the current one is kept


def test_memory_bounds_fewer_larger_microbatches():
    single = Placement.from_string("0-7")  # 80 bytes measured with 4 micro-batches
    choice = choose_microbatches(
        BalanceProblem(BLOCKS, hardware=Hardware(memory_capacity_bytes=170)),
        single,
        current=4,
        candidates=[1, 2, 4],
        schedule="1F1B",
        per_op_s=0.01,
    )
    assert choice.skipped == (1,)  # 80 x 4 / 1 = 320 bytes may not fit; 80 x 2 = 160 does
    assert choice.num_microbatches == 2


def test_the_current_count_stays_unless_another_is_min_gain_faster():
    placement = Placement.from_string("0-3|4-7")
    kwargs = dict(current=4, candidates=[4, 8], schedule="1F1B", per_op_s=0.1)
    problem = BalanceProblem(BLOCKS)
    steps = choose_microbatches(problem, placement, **kwargs).predicted_step_s
    gain = 1 - steps[8] / steps[4]
    assert choose_microbatches(problem, placement, **kwargs, min_gain=gain * 0.9).num_microbatches == 8
    assert choose_microbatches(problem, placement, **kwargs, min_gain=gain * 1.1).num_microbatches == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"current": 0}, r"current holds 0; micro-batch counts are integers >= 1"),
        ({"candidates": []}, r"candidates is empty"),
        ({"candidates": [2, 2.5]}, r"candidates holds 2.5"),
        ({"per_op_s": -1.0}, r"per_op_s=-1.0 must be a number of seconds >= 0"),
        ({"min_gain": 1.0}, r"min_gain=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_input_is_rejected(kwargs, match):
    args = {"current": 4, "candidates": [1, 2, 4], "schedule": "1F1B", **kwargs}
    with pytest.raises(ValueError, match=match):
        choose_microbatches(BalanceProblem(BLOCKS), Placement.from_string("0-7"), **args)


def test_decide_retunes_only_an_applied_repack():
    nearly_idle = [LayerCost(fwd_time_s=0.01, bwd_time_s=0.02, memory_bytes=10)] * 4 + BLOCKS[:4]
    current = Placement.from_string("0-3|4-7")
    config = BalanceConfig(repack=True, memory_capacity_bytes=1e9, max_slowdown=0.05)
    retune = RetuneOptions(counts={1: [1, 2, 4, 8], 2: [2, 4, 8]}, per_op_s=0.1)
    packed = decide(config.problem(nearly_idle), current, config, 4, "1F1B", retune=retune)
    assert packed.apply and packed.proposed.num_stages == 1
    assert packed.num_microbatches == 1 and set(packed.microbatch_steps) == {1, 2, 4, 8}
    assert packed.reason.endswith("1 micro-batches instead of 4")
    plain = decide(config.problem(nearly_idle), current, config, 4, "1F1B")
    assert plain.num_microbatches is None and plain.proposed == packed.proposed
    balanced = decide(
        BalanceProblem(BLOCKS), Placement.from_string("0-1|2-7"), BalanceConfig(), 4, "1F1B", retune=retune
    )
    assert balanced.apply and balanced.num_microbatches is None  # no re-pack: the count stays
    heavy = Hardware(last_stage_extra=LayerCost(fwd_time_s=0.0, memory_bytes=10**6))
    capped = BalanceConfig(repack=True, memory_capacity_bytes=[2_100_000] * 2, max_slowdown=0.05)
    bounded = decide(capped.problem(nearly_idle, heavy), current, capped, 4, "1F1B", retune=retune)
    assert bounded.num_microbatches == 2  # 1 would hold up to 4x the measured bytes: 4 MB > 2.1 MB
