"""What to rebalance to: the proposal, its predicted effect, and whether it is applied."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_dynmo.balancing import BalanceProblem, Hardware, LayerCost, Placement
from lightning_dynmo.balancing.diffusion import diffuse
from lightning_dynmo.balancing.partition import partition
from lightning_dynmo.balancing.policy import (
    BalanceConfig,
    RebalanceDecision,
    TriggerConfig,
    decide,
    predict,
    simulated_schedule,
    validate_policy,
)
from lightning_dynmo.balancing.trigger import AutoConfig


def _costs(times: list[float], params: list[int] | None = None) -> list[LayerCost]:
    params = params or [100] * len(times)
    return [
        LayerCost(fwd_time_s=t / 3, bwd_time_s=2 * t / 3, num_params=p)
        for t, p in zip(times, params, strict=True)
    ]


# Layers 0-3 became 4x cheaper (e.g. pruned): the uniform split now leaves stage 0 idle.
CHANGED = _costs([0.1, 0.1, 0.1, 0.1, 0.4, 0.4, 0.4, 0.4])
UNIFORM = Placement.from_string("0-3|4-7")


def test_partition_proposal_is_applied_when_faster():
    decision = decide(BalanceProblem(CHANGED), UNIFORM, BalanceConfig(), 4, "1F1B")
    assert decision.proposed == partition(BalanceProblem(CHANGED, by="time"), 2)
    assert decision.apply
    assert decision.predicted_step_after < decision.predicted_step_before
    assert decision.imbalance_after < decision.imbalance_before
    assert decision.bubble_ratio_after < decision.bubble_ratio_before
    assert decision.predicted_gain > 0.1
    assert decision.released_stages == 0
    assert decision.reason == "partition by time; predicted faster"


def test_balanced_placement_is_left_alone():
    best = partition(BalanceProblem(CHANGED, by="time"), 2)
    decision = decide(BalanceProblem(CHANGED), best, BalanceConfig(), 4, "1F1B")
    assert not decision.apply
    assert decision.proposed == best
    assert decision.reason.endswith("placement unchanged")


def test_small_gain_below_min_gain_is_not_applied():
    costs = _costs([1.0, 1.0, 1.0, 1.1])
    current = Placement.from_string("0-2|3-3")  # 3.0 vs 1.1: partition gives 0-1|2-3 (2.0 vs 2.1)
    applied = decide(BalanceProblem(costs), current, BalanceConfig(min_gain=0.0), 2, "GPipe")
    assert applied.apply
    gain = applied.predicted_gain
    held = decide(BalanceProblem(costs), current, BalanceConfig(min_gain=gain + 0.01), 2, "GPipe")
    assert not held.apply
    assert held.reason.endswith(f"predicted gain below min_gain={gain + 0.01}")


def test_diffusion_proposal():
    current = Placement.from_string("0-1|2-4|5-7")
    config = BalanceConfig(balancer="diffusion")
    decision = decide(config.problem(CHANGED), current, config, 6, "1F1B")
    assert decision.proposed == diffuse(BalanceProblem(CHANGED, by="time"), current).placement
    assert decision.apply == (decision.predicted_gain >= config.min_gain)


def test_static_never_moves():
    decision = decide(BalanceProblem(CHANGED), UNIFORM, BalanceConfig(balancer="static"), 4, "1F1B")
    assert decision.proposed == UNIFORM
    assert not decision.apply
    assert decision.reason == "static balancer; placement unchanged"
    assert decision.predicted_step_after == decision.predicted_step_before


def test_params_view_balances_parameter_counts():
    costs = _costs([1.0] * 4, params=[300, 100, 100, 100])
    decision = decide(
        BalanceProblem(costs, by="params"),
        Placement.from_string("0-1|2-3"),
        BalanceConfig(cost="params"),
        2,
        "GPipe",
    )
    assert decision.proposed == Placement.from_string("0|1-3")
    assert decision.apply


def test_memory_caps_constrain_the_proposal():
    costs = [LayerCost(fwd_time_s=t, num_params=1, memory_bytes=10) for t in (0.1, 0.1, 0.1, 0.1, 0.1, 0.5)]
    free = decide(BalanceProblem(costs), Placement.from_string("0-2|3-5"), BalanceConfig(), 2, "1F1B")
    assert free.proposed == Placement.from_string("0-4|5-5")
    capped = decide(
        BalanceProblem(costs),
        Placement.from_string("0-2|3-5"),
        BalanceConfig(memory_capacity_bytes=30),
        2,
        "1F1B",
    )
    assert capped.proposed == Placement.from_string("0-2|3-5")
    assert not capped.apply


def test_communication_time_enters_the_prediction():
    base = predict(BalanceProblem(CHANGED), UNIFORM, 4, "1F1B")
    with_comm = predict(
        BalanceProblem(CHANGED, hardware=Hardware(comm_time_s=[0.05] * 8)), UNIFORM, 4, "1F1B"
    )
    assert with_comm[0] > base[0]


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("GPipe", "gpipe"),
        ("1F1B", "1f1b"),
        ("Interleaved1F1B", "1f1b"),
        ("InterleavedZeroBubble", "zero_bubble"),
    ],
)
def test_schedule_names_map_to_simulator_models(name, model):
    assert simulated_schedule(name) == model


def test_unknown_schedule_is_rejected():
    with pytest.raises(ValueError, match=r"schedule='Wavefront' has no simulator model"):
        decide(BalanceProblem(CHANGED), UNIFORM, BalanceConfig(), 4, "Wavefront")


def test_costs_must_match_the_placement():
    with pytest.raises(ValueError, match=r"costs has 8 records but current=0-2\|3-5 covers 6 layers"):
        decide(BalanceProblem(CHANGED), Placement.from_string("0-2|3-5"), BalanceConfig(), 4, "1F1B")
    with pytest.raises(ValueError, match=r"comm_time_s has 2 entries but there are 8 layers"):
        decide(
            BalanceProblem(CHANGED, hardware=Hardware(comm_time_s=[0.1, 0.1])),
            UNIFORM,
            BalanceConfig(),
            4,
            "1F1B",
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"balancer": "greedy"},
            r"balancer='greedy' is not a balancer; use one of \('partition', 'diffusion'",
        ),
        ({"cost": "flops"}, r"cost='flops' is not a cost view; use one of \('time', 'params'\)"),
        ({"target_num_stages": 2}, r"target_num_stages=2 is only used when re-packing; set repack=True"),
        ({"repack": True, "target_num_stages": 0}, r"target_num_stages=0 must be an integer >= 1"),
        ({"repack": True, "balancer": "static"}, r"repack=True with balancer='static' contradict"),
        ({"max_slowdown": -0.1}, r"max_slowdown=-0.1 must be a finite number >= 0"),
        ({"min_gain": 1.0}, r"min_gain=1.0 must be below 1"),
        ({"diffusion_max_rounds": 0}, r"diffusion_max_rounds=0 must be an integer >= 1"),
    ],
)
def test_bad_balance_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BalanceConfig(**kwargs)


def test_repack_target_larger_than_the_pipeline_is_rejected():
    config = BalanceConfig(repack=True, target_num_stages=3, memory_capacity_bytes=1e9)
    with pytest.raises(
        ValueError, match=r"target_num_stages=3 is larger than the current pipeline \(2 stages\)"
    ):
        decide(config.problem(CHANGED), UNIFORM, config, 4, "1F1B")


def test_repack_without_memory_capacity_is_rejected():
    with pytest.raises(ValueError, match=r"repack=True needs memory_capacity_bytes"):
        BalanceConfig(repack=True).check_pipeline(4)


def test_static_with_triggers_is_rejected():
    static = BalanceConfig(balancer="static")
    validate_policy(static, TriggerConfig(on_events=False))  # static, no triggers: fine
    with pytest.raises(
        ValueError,
        match=r"balancer='static' never rebalances, but triggers are enabled: "
        r"every_n_steps=10, on_events=True",
    ):
        validate_policy(static, TriggerConfig(every_n_steps=10))
    with pytest.raises(ValueError, match=r"auto=True"):
        validate_policy(static, TriggerConfig(auto=AutoConfig(), on_events=False))
    validate_policy(BalanceConfig(), TriggerConfig(every_step=True))  # dynamic balancers take any trigger


# Stage 0 has almost nothing left to do: folding it into stage 1 costs ~2% and frees a worker.
NEARLY_IDLE = _costs([0.01] * 4 + [0.4] * 4)


def test_repack_releases_a_stage_within_max_slowdown():
    config = BalanceConfig(repack=True, memory_capacity_bytes=1e9, max_slowdown=0.05)
    decision = decide(config.problem(NEARLY_IDLE), UNIFORM, config, 4, "1F1B")
    assert decision.proposed == Placement.from_string("0-7")
    assert decision.released_stages == 1
    assert decision.apply
    assert decision.predicted_step_after <= decision.predicted_step_before * 1.05
    assert decision.reason.startswith("re-pack onto 1 stages")


def test_repack_to_a_target_that_costs_too_much_is_not_applied():
    config = BalanceConfig(repack=True, target_num_stages=1, memory_capacity_bytes=1e9, max_slowdown=0.05)
    decision = decide(config.problem(CHANGED), UNIFORM, config, 4, "1F1B")
    assert decision.proposed.num_stages == 1
    assert not decision.apply
    assert decision.reason.endswith("re-pack slows the step by more than max_slowdown=0.05")


def test_repack_that_finds_no_smaller_pipeline_falls_back_to_balancing():
    config = BalanceConfig(repack=True, memory_capacity_bytes=1e9, max_slowdown=0.0)
    decision = decide(config.problem(CHANGED), UNIFORM, config, 4, "1F1B")
    assert decision.proposed == partition(BalanceProblem(CHANGED), 2)
    assert decision.apply


def test_repack_beyond_memory_is_reported():
    costs = [LayerCost(fwd_time_s=0.1, memory_bytes=10) for _ in range(4)]
    config = BalanceConfig(repack=True, target_num_stages=1, memory_capacity_bytes=30)
    with pytest.raises(
        ValueError, match=r"target_num_stages=1 cannot be reached: the layers do not fit in memory"
    ):
        decide(config.problem(costs), Placement.from_string("0-1|2-3"), config, 2, "1F1B")


def test_virtual_stages_are_judged_by_their_workers():
    # 4 virtual stages on 2 workers, "loop" layout (stage s on worker s % 2). Moving layers between
    # stages 0 and 2 looks like a gain stage by stage but leaves both workers exactly as loaded.
    costs = _costs([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    current = Placement.from_string("0-1|2-3|4-5|6-7")
    staged = decide(BalanceProblem(costs), current, BalanceConfig(), 4, "InterleavedZeroBubble")
    assert staged.apply
    by_worker = decide(
        BalanceProblem(costs),
        current,
        BalanceConfig(),
        4,
        "InterleavedZeroBubble",
        stage_workers=[0, 1, 0, 1],
    )
    assert not by_worker.apply
    assert by_worker.predicted_step_before == 2.0  # the heaviest worker's load, not a simulated stage
    assert "partition of the workers" in by_worker.reason
    with pytest.raises(ValueError, match=r"stage_workers has 2 entries but current=0-1\|2-3\|4-5\|6-7 has 4"):
        decide(
            BalanceProblem(costs), current, BalanceConfig(), 4, "InterleavedZeroBubble", stage_workers=[0, 1]
        )


def test_a_migration_must_pay_for_itself():
    def decide_with(min_saving: float) -> RebalanceDecision:
        config = dataclasses.replace(BalanceConfig(), min_saving=min_saving)
        return decide(BalanceProblem(CHANGED), UNIFORM, config, 4, "1F1B")

    free = decide_with(0.0)
    saving = free.predicted_step_before - free.predicted_step_after
    assert free.apply
    paid = decide_with(saving * 0.9)
    assert paid.apply
    unpaid = decide_with(saving * 1.1)
    assert not unpaid.apply
    assert "below min_saving" in unpaid.reason
    with pytest.raises(ValueError, match=r"min_saving=-1.0 must be a finite number >= 0"):
        decide_with(-1.0)


def test_virtual_stages_are_balanced_by_their_workers():
    # The per-stage optimum 3|1+4+6|1+6|6+5 leaves worker 1 (stages 1 and 3) with 22 of 32.
    costs = _costs([3.0, 1.0, 4.0, 6.0, 1.0, 6.0, 6.0, 5.0])
    current = Placement.from_string("0-0|1-3|4-5|6-7")
    decision = decide(
        BalanceProblem(costs), current, BalanceConfig(), 4, "Interleaved1F1B", stage_workers=[0, 1, 0, 1]
    )
    assert decision.apply
    assert (decision.predicted_step_before, decision.predicted_step_after) == pytest.approx((22.0, 16.0))
    assert str(decision.proposed) == "0-0|1-2|3-5|6-7"
    # Per-stage caps become per-worker caps (the smallest of the worker's stages).
    capped = [LayerCost(fwd_time_s=c.fwd_time_s, memory_bytes=1) for c in costs]
    config = BalanceConfig(memory_capacity_bytes=[3, 9, 9, 9])
    tight = decide(config.problem(capped), current, config, 4, "Interleaved1F1B", stage_workers=[0, 1, 0, 1])
    assert sum(len(tight.proposed.layers_of(s)) for s in (0, 2)) <= 3


def test_a_repack_under_a_v_schedule_proposes_only_what_it_can_run():
    # 4 V stages on 2 workers, nearly idle: folding onto 1 stage would be cheapest, but V needs 2 per rank.
    current = Placement.from_string("0-1|2-3|4-5|6-7")
    config = BalanceConfig(repack=True, memory_capacity_bytes=1e9, max_slowdown=10.0)
    layouts = {4: [0, 1, 1, 0], 2: [0, 0]}
    decision = decide(
        config.problem(NEARLY_IDLE),
        current,
        config,
        4,
        "ZBVZeroBubble",
        stage_workers=[0, 1, 1, 0],
        repack_layouts=layouts,
    )
    assert decision.apply and decision.proposed.num_stages == 2
    assert decision.predicted_step_after == pytest.approx(
        sum(c.fwd_time_s + c.bwd_time_s for c in NEARLY_IDLE)
    )
    unconstrained = decide(
        config.problem(NEARLY_IDLE), current, config, 4, "ZBVZeroBubble", stage_workers=[0, 1, 1, 0]
    )
    assert unconstrained.proposed.num_stages == 1  # what the planner proposed before it knew the layouts
    with pytest.raises(
        ValueError, match=r"target_num_stages=3 is a pipeline the schedule cannot run: .* \[2, 4\]"
    ):
        BalanceConfig(repack=True, target_num_stages=3, memory_capacity_bytes=1e9).check_pipeline(4, [2, 4])


def test_a_micro_batch_count_below_one_is_refused_by_name():
    with pytest.raises(ValueError, match=r"num_microbatches=0 .*micro-batches per step"):
        decide(BalanceProblem(CHANGED), UNIFORM, BalanceConfig(), 0, "1F1B")


def test_a_decision_predicts_how_its_placement_shares_the_load_among_the_workers():
    # CHANGED moved to its partition 0-4|5-7: stage 0 holds 4 x 0.1 + 0.4, stage 1 3 x 0.4 (one step).
    decision = decide(BalanceProblem(CHANGED), UNIFORM, BalanceConfig(), 4, "1F1B")
    assert decision.proposed == Placement.from_string("0-4|5-7")
    loads = decision.worker_loads_after
    assert loads is not None and [x / sum(loads) for x in loads] == pytest.approx([0.4, 0.6])
    # Several stages per worker: each worker's stages summed (stages 0 and 3 on worker 0 of a V).
    costs = _costs([1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0])
    current = Placement.from_string("0-1|2-3|4-5|6-7")
    v = decide(BalanceProblem(costs), current, BalanceConfig(), 4, "1F1B", stage_workers=[0, 1, 1, 0])
    sums = [sum(1.0 * (i // 2 + 1) for i in v.proposed.layers_of(s)) for s in range(4)]
    loads = v.worker_loads_after
    assert loads is not None and len(loads) == 2
    assert loads[0] / sum(loads) == pytest.approx((sums[0] + sums[3]) / sum(sums))
