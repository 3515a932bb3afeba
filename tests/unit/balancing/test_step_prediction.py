"""The policy's step model (a schedule's own action lists) and the search it refines, on worked examples."""

import dataclasses
import itertools

import pytest

from lightning_dynmo.balancing import BalanceProblem, Hardware, LayerCost, Placement, partition
from lightning_dynmo.balancing.policy import BalanceConfig, decide, predict
from lightning_dynmo.balancing.step_prediction import ScheduleOrder, fit_per_op, predict_step, refine


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[tuple[int, str, int]]]:
    """What torch's Schedule1F1B runs, one stage per rank (the pipeline tests compare it with torch's)."""
    out = []
    for s in range(num_stages):
        warmup = min(num_microbatches, num_stages - s)
        order = [(s, "F", m) for m in range(warmup)]
        for m in range(num_microbatches):
            order.append((s, "B", m))
            if warmup + m < num_microbatches:
                order.append((s, "F", warmup + m))
        out.append(order)
    return out


ORDER = ScheduleOrder("1F1B", one_f_one_b)

# Per micro-batch forward and backward of four layers; the costs are whole steps of 2 micro-batches.
FWD, BWD = (3, 2, 2, 4), (3, 1, 4, 1)
COSTS = [LayerCost(fwd_time_s=2.0 * f, bwd_time_s=2.0 * b) for f, b in zip(FWD, BWD, strict=True)]


def test_step_of_1f1b_follows_the_hand_worked_timeline():
    # 0-1|2-3: stage 0 F=5 B=4, stage 1 F=6 B=5, per micro-batch.
    #   rank 0: F0 0-5, F1 5-10;                     B0 16-20 (waits for rank 1's B0), B1 27-31
    #   rank 1: F0 5-11, B0 11-16, F1 16-22, B1 22-27
    # step 31; busy 18 + 22 of 2 x 31.
    step = predict_step(BalanceProblem(COSTS), Placement.from_string("0-1|2-3"), ORDER, 2)
    assert step.step_s == pytest.approx(31.0)
    assert step.bubble_ratio == pytest.approx(1 - 40 / 62)
    assert step.stage_loads == pytest.approx((18.0, 22.0))
    # 0-2|3: stage 0 F=7 B=8, stage 1 F=4 B=1.
    #   rank 0: F0 0-7, F1 7-14, B0 14-22, B1 22-30;  rank 1: F0 7-11, B0 11-12, F1 14-18, B1 18-19
    # step 30, although its heaviest stage (30) is far above the other split's (22).
    step = predict_step(BalanceProblem(COSTS), Placement.from_string("0-2|3"), ORDER, 2)
    assert step.step_s == pytest.approx(30.0)


def test_a_send_keeps_its_sender_busy_and_a_split_backward_shares_the_backward():
    hw = Hardware(comm_time_s=0.5)
    step = predict_step(BalanceProblem(COSTS, hardware=hw), Placement.from_string("0-2|3"), ORDER, 2)
    # Stage 0's forward becomes 7 + 0.5 (its send): rank 0: F0 0-7.5, F1 7.5-15, B0 15-23, B1 23-31;
    # rank 1: F0 7.5-11.5, B0 11.5-12.5, F1 15-19, B1 19-20. The last stage sends nothing.
    assert step.step_s == pytest.approx(31.0)
    assert step.stage_loads == pytest.approx((30.0, 10.0))  # compute only

    def split(num_stages: int, num_microbatches: int) -> list[list[tuple[int, str, int]]]:
        return [
            [(s, k, m) for s, kind, m in acts for k in (("I", "W") if kind == "B" else (kind,))]
            for acts in one_f_one_b(num_stages, num_microbatches)
        ]

    order = ScheduleOrder("split", split, weight_grad_share=0.25)
    step = predict_step(BalanceProblem(COSTS), Placement.from_string("0-2|3"), order, 2)
    # Stage 1's B0 is I 0.75 + W 0.25: rank 0's B0 still starts at 14 (it waits for F1, not the gradient).
    assert step.step_s == pytest.approx(30.0)
    with pytest.raises(ValueError, match=r"weight_grad_share=1.5 must be a number in \[0, 1\]"):
        ScheduleOrder("split", split, weight_grad_share=1.5)


def test_without_links_one_stage_per_rank_the_schedule_model_matches_the_event_simulator():
    problem = BalanceProblem([LayerCost(fwd_time_s=f, bwd_time_s=2 * f) for f in (1.0, 2.0, 3.0, 1.5, 2.5)])
    for text in ("0|1-4", "0-1|2-4", "0-2|3-4", "0-3|4"):
        placement = Placement.from_string(text)
        by_name = predict(problem, placement, 4, "1F1B")
        by_order = predict(problem, placement, 4, ORDER)
        assert by_order == pytest.approx(by_name), text


def test_exact_search_finds_the_fastest_split_where_min_max_picks_another():
    problem = BalanceProblem(COSTS)
    proposal = partition(problem, 2)
    assert str(proposal) == "0-1|2-3"  # the lightest heaviest stage

    def step_of(p: Placement) -> float:
        return predict_step(problem, p, ORDER, 2).step_s

    found = refine(problem, proposal, step_of)
    assert (str(found.placement), found.step_s, found.proposal_step_s) == ("0-2|3-3", 30.0, 31.0)
    assert found.exact and found.simulations == 3
    best = min(step_of(Placement((0, cut, 4))) for cut in range(1, 4))
    assert found.step_s == best


def test_the_search_never_picks_a_placement_over_a_memory_cap():
    costs = [dataclasses.replace(c, memory_bytes=10) for c in COSTS]
    problem = BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=25))  # at most 2 layers a stage
    found = refine(
        problem, Placement.from_string("0-1|2-3"), lambda p: predict_step(problem, p, ORDER, 2).step_s
    )
    assert str(found.placement) == "0-1|2-3"  # "0-2|3" is faster but holds 30 bytes on stage 0


def test_local_search_is_never_slower_than_the_proposal_and_ends_in_a_local_optimum():
    costs = [LayerCost(fwd_time_s=1.0 + (i * 7 % 5), bwd_time_s=2.0 + (i * 3 % 4)) for i in range(24)]
    problem = BalanceProblem(costs)

    def step_of(p: Placement) -> float:
        return predict_step(problem, p, ORDER, 8).step_s

    proposal = partition(problem, 4)
    found = refine(problem, proposal, step_of, budget=500)  # C(23, 3) = 1771 placements: local search
    assert not found.exact and found.simulations <= 500
    assert found.step_s <= found.proposal_step_s == step_of(proposal)
    bounds = found.placement.boundaries
    for i, delta in itertools.product(range(1, 4), (-1, 1)):
        moved = (*bounds[:i], bounds[i] + delta, *bounds[i + 1 :])
        if moved[i - 1] < moved[i] < moved[i + 1]:
            assert step_of(Placement(moved)) >= found.step_s
    with pytest.raises(ValueError, match="budget=0 must be an integer >= 1"):
        refine(problem, proposal, step_of, budget=0)


def test_decide_with_the_schedule_order_moves_to_the_fastest_step_and_says_how_it_searched():
    problem = BalanceProblem(COSTS)
    config = BalanceConfig(min_gain=0.0)
    by_order = decide(problem, Placement.from_string("0|1-3"), config, 2, ORDER)
    assert str(by_order.proposed) == "0-2|3-3" and by_order.apply
    assert by_order.predicted_step_after == pytest.approx(30.0)
    assert "refined by exact search by the schedule's step (3 placements scored)" in by_order.reason
    by_name = decide(problem, Placement.from_string("0|1-3"), config, 2, "1F1B")
    assert str(by_name.proposed) == "0-1|2-3"  # the event simulator's policy keeps partition's choice


def test_decide_adds_the_runtimes_cost_per_action_to_every_prediction_and_judges_the_gain_with_it():
    current = Placement.from_string("0|1-3")
    bare_problem, paid_problem = BalanceProblem(COSTS), BalanceProblem(COSTS, hardware=Hardware(per_op_s=1.0))
    bare = decide(bare_problem, current, BalanceConfig(min_gain=0.0), 2, ORDER)
    paid = decide(paid_problem, current, BalanceConfig(min_gain=0.0), 2, ORDER)
    assert paid.proposed == bare.proposed
    for decision, per_op in ((bare, 0.0), (paid, 1.0)):
        for placement, predicted in (
            (current, decision.predicted_step_before),
            (decision.proposed, decision.predicted_step_after),
        ):
            step = predict_step(bare_problem, placement, ORDER, 2, per_op_s=per_op)
            assert predicted == pytest.approx(step.step_s)
    # 0|1-3 runs 40 (34 bare), 0-2|3-3 34 (30): the fixed costs lie on the critical paths unevenly.
    assert (paid.predicted_step_before, paid.predicted_step_after) == pytest.approx((40.0, 34.0))
    assert predict_step(paid_problem, current, ORDER, 2).step_s == pytest.approx(40.0)  # the hardware's
    assert predict_step(paid_problem, current, ORDER, 2, per_op_s=0.0).step_s == pytest.approx(34.0)
    # Seconds never add to parameter counts: the params view predicts without them.
    counted = [dataclasses.replace(c, num_params=3 * (i + 1)) for i, c in enumerate(COSTS)]
    params = BalanceProblem(counted, by="params", hardware=Hardware(per_op_s=1.0))
    unpaid = predict_step(params, current, ORDER, 2, per_op_s=0.0).step_s
    assert unpaid > 0 and predict_step(params, current, ORDER, 2).step_s == unpaid
    # A minimum gain between the two gains: one prediction moves, the other holds.
    between = BalanceConfig(min_gain=(paid.predicted_gain + bare.predicted_gain) / 2)
    assert decide(paid_problem, current, between, 2, ORDER).apply
    held = decide(bare_problem, current, between, 2, ORDER)
    assert not held.apply and "predicted gain below min_gain" in held.reason
    # The event simulator's model (a schedule name) pays it too: 4 actions a micro-batch on each rank.
    by_name = [
        decide(p, current, BalanceConfig(), 2, "1F1B").predicted_step_before
        for p in (bare_problem, paid_problem)
    ]
    assert by_name[1] > by_name[0]
    with pytest.raises(ValueError, match=r"per_op_s=-0\.5 must be a finite number of seconds >= 0"):
        Hardware(per_op_s=-0.5)


def test_a_fixed_cost_per_action_adds_to_every_action_and_stages_on_one_rank_send_nothing():
    step = predict_step(BalanceProblem(COSTS), Placement.from_string("0-2|3"), ORDER, 2, per_op_s=1.0)
    # Per micro-batch F0=8 B0=9, F1=5 B1=2. rank 0: F0 0-8, F1 8-16, B0 16-25, B1 25-34;
    # rank 1: F0 8-13, B0 13-15, F1 16-21, B1 21-23.
    assert step.step_s == pytest.approx(34.0)
    with pytest.raises(ValueError, match=r"per_op_s=-1\.0 must be a finite number of seconds >= 0"):
        predict_step(BalanceProblem(COSTS), Placement.from_string("0-2|3"), ORDER, 2, per_op_s=-1.0)

    def one_rank(num_stages: int, num_microbatches: int) -> list[list[tuple[int, str, int]]]:
        return [[(0, "F", 0), (1, "F", 0), (1, "B", 0), (0, "B", 0)]]

    problem = BalanceProblem(COSTS, hardware=Hardware(comm_time_s=0.5))
    step = predict_step(problem, Placement.from_string("0-2|3"), ScheduleOrder("one", one_rank), 1)
    assert step.step_s == pytest.approx(2 * (7 + 8 + 4 + 1))  # costs of one micro-batch, no send


def test_a_measured_weight_gradient_sets_the_split_and_an_unmeasured_one_takes_the_share():
    def split_one(num_stages: int, num_microbatches: int) -> list[list[tuple[int, str, int]]]:
        return [[(s, "F", 0), (s, "I", 0), (s, "W", 0)] for s in range(num_stages)]

    order, placement = ScheduleOrder("split", split_one), Placement.from_string("0|1")
    head = LayerCost(fwd_time_s=1.0, bwd_time_s=4.0, bwd_weight_time_s=3.0)
    problem = BalanceProblem([LayerCost(fwd_time_s=1.0, bwd_time_s=6.0), head])
    # Stage 1 measured I=1, W=3: rank 1 F 1-2, I 2-3, W 3-6; rank 0 (share 0.5: I=3, W=3) F 0-1, I 3-6, W 6-9.
    assert predict_step(problem, placement, order, 1).step_s == pytest.approx(9.0)
    # Unmeasured, stage 1 splits 2 + 2: its I ends at 4, rank 0's I 4-7, W 7-10.
    unmeasured = BalanceProblem([problem.costs[0], dataclasses.replace(head, bwd_weight_time_s=0.0)])
    assert predict_step(unmeasured, placement, order, 1).step_s == pytest.approx(10.0)
    with pytest.raises(ValueError, match=r"bwd_weight_time_s=5\.0 exceeds bwd_time_s=4\.0"):
        dataclasses.replace(head, bwd_weight_time_s=5.0)


def test_the_first_stage_runs_its_whole_backward_in_w_and_its_i_costs_nothing():
    # torch's stage runs stage 0's backward unsplit in its W action (its input needs no gradient).
    def zero_bubble_like(num_stages: int, num_microbatches: int) -> list[list[tuple[int, str, int]]]:
        assert (num_stages, num_microbatches) == (2, 2)
        return [
            [(0, "F", 0), (0, "I", 0), (0, "F", 1), (0, "W", 0), (0, "I", 1), (0, "W", 1)],
            [(1, "F", 0), (1, "I", 0), (1, "F", 1), (1, "W", 0), (1, "I", 1), (1, "W", 1)],
        ]

    order = ScheduleOrder("zb", zero_bubble_like)
    # Whole steps of 2 micro-batches. Layer 0 measured on a first stage (its backward all W), layer 1
    # measured split, layer 2 the heavy last stage.
    costs = [
        LayerCost(fwd_time_s=2.0, bwd_time_s=4.0, bwd_weight_time_s=4.0),
        LayerCost(fwd_time_s=2.0, bwd_time_s=4.0, bwd_weight_time_s=1.0),
        LayerCost(fwd_time_s=2.0, bwd_time_s=20.0, bwd_weight_time_s=10.0),
    ]
    # Per micro-batch, 0-1|2: stage 0 F 2, I 0, W 4 (not I 1.5 + W 2.5 as its records' split says);
    # stage 1 F 1, I 5, W 5.
    #   rank 0: F0 0-2, I0 8-8 (waits for rank 1's I0), F1 8-10, W0 10-14, I1 21-21, W1 21-25
    #   rank 1: F0 2-3, I0 3-8, F1 10-11 (waits for F1), W0 11-16, I1 16-21, W1 21-26
    # step 26; with stage 0's I taking 1.5, rank 0's F1 ends at 11.5 and the step at 27.5.
    step = predict_step(BalanceProblem(costs), Placement.from_string("0-1|2"), order, 2)
    assert step.step_s == pytest.approx(26.0)


def test_a_record_measured_whole_on_a_first_stage_splits_by_the_share_on_another():
    def split_one(num_stages: int, num_microbatches: int) -> list[list[tuple[int, str, int]]]:
        return [[(s, "F", 0), (s, "I", 0), (s, "W", 0)] for s in range(num_stages)]

    order = ScheduleOrder("split", split_one)  # weight_grad_share 0.5
    whole = LayerCost(fwd_time_s=1.0, bwd_time_s=6.0, bwd_weight_time_s=6.0)  # measured on a stage 0
    costs = [LayerCost(fwd_time_s=1.0, bwd_time_s=10.0, bwd_weight_time_s=10.0), whole]
    costs.append(LayerCost(fwd_time_s=1.0, bwd_time_s=2.0, bwd_weight_time_s=1.0))
    # 0|1-2, one micro-batch: stage 1 F 2, W = 1 (layer 2, measured) + 0.5 x 6 (layer 1) = 4, I = 4.
    #   rank 1: F 1-3, I 3-7, W 7-11; rank 0: F 0-1, I 7-7, W 7-17 (stage 0: all 10 in W). Step 17
    #   (taking layer 1's whole backward as W, stage 1's I would be 1 and the step 14).
    placement = Placement.from_string("0|1-2")
    assert predict_step(BalanceProblem(costs), placement, order, 1).step_s == pytest.approx(17.0)
    # Control: measured split (W 5 of 6), layer 1 keeps its split: stage 1 I 2, W 6; rank 0 I 5-5, W 5-15.
    costs[1] = dataclasses.replace(whole, bwd_weight_time_s=5.0)
    assert predict_step(BalanceProblem(costs), placement, order, 1).step_s == pytest.approx(15.0)


def test_a_backward_moved_between_the_first_stage_and_another_costs_the_measured_whole_to_split_ratio():
    def split_one(num_stages: int, num_microbatches: int) -> list[list[tuple[int, str, int]]]:
        return [[(s, "F", 0), (s, "I", 0), (s, "W", 0)] for s in range(num_stages)]

    def problem(params: int, *whole_first: bool) -> BalanceProblem:
        # Alike blocks (fwd 1): measured whole on a first stage their backward took 2, split elsewhere 4
        # (I 2 + W 2): the profile's ratio is 0.5. Without parameters the blocks are not known alike.
        whole = LayerCost(fwd_time_s=1.0, bwd_time_s=2.0, bwd_weight_time_s=2.0, num_params=params)
        split = LayerCost(fwd_time_s=1.0, bwd_time_s=4.0, bwd_weight_time_s=2.0, num_params=params)
        return BalanceProblem([whole if w else split for w in whole_first])

    order = ScheduleOrder("split", split_one)
    # 0-1|2 with layer 1 measured split: on stage 0 it runs whole, 0.5 x 4. Stage 0 F 2, I 0, W 2 + 2;
    # stage 1 F 1, I 2, W 2. Rank 0 F 0-2; rank 1 F 2-3, I 3-5, W 5-7; rank 0 I 5-5, W 5-9: step 9.
    # Control, nothing known alike: layer 1's W on stage 0 is its measured 4, rank 0's W 5-11.
    onto_first = Placement.from_string("0-1|2")
    assert predict_step(problem(10, True, False, False), onto_first, order, 1).step_s == pytest.approx(9.0)
    assert predict_step(problem(0, True, False, False), onto_first, order, 1).step_s == pytest.approx(11.0)
    # 0|1-2 with layer 1 measured whole (2): split on stage 1 it costs 2 / 0.5 = 4 (I 2, W 2 at the share);
    # stage 1 I 4, W 4. Rank 0 F 0-1; rank 1 F 1-3, I 3-7, W 7-11; rank 0 I 7-7, W 7-9: step 11.
    # Control: I 3, W 3 (layer 1's I 1 + W 1), rank 1 W 6-9 and the step 9.
    off_first = Placement.from_string("0|1-2")
    assert predict_step(problem(10, True, True, False), off_first, order, 1).step_s == pytest.approx(11.0)
    assert predict_step(problem(0, True, True, False), off_first, order, 1).step_s == pytest.approx(9.0)


def test_a_schedule_order_without_callable_actions_is_refused():
    with pytest.raises(ValueError, match=r"actions=\[\] must be a callable \(num_stages, num_microbatches\)"):
        ScheduleOrder("1F1B", [])  # type: ignore[arg-type]


def test_the_cost_per_action_fitted_on_a_measured_step_reproduces_it():
    problem, placement = BalanceProblem(COSTS), Placement.from_string("0-1|2-3")
    # Worked on the timeline above, each action +x: the step's chain is rank 0's F0, rank 1's F0 B0 F1
    # B1, rank 0's B1 (6 actions; rank 1's F1 waits for its own B0, 16 + 3x, not rank 0's F1, 10 + 2x),
    # so the step is 31 + 6x and a measured 34 s gives x = 0.5.
    per_op = fit_per_op(problem, placement, ORDER, 2, 34.0)
    assert per_op == pytest.approx(0.5, abs=1e-6)
    assert predict_step(problem, placement, ORDER, 2, per_op_s=per_op).step_s == pytest.approx(34.0, abs=1e-6)
    # Negative control: another per-action cost misses the measurement.
    assert predict_step(problem, placement, ORDER, 2, per_op_s=0.25).step_s != pytest.approx(34.0, abs=1e-3)
    # A step already slower than measured has nothing left to spread.
    assert fit_per_op(problem, placement, ORDER, 2, 30.0) == 0.0
    with pytest.raises(ValueError, match=r"measured_step_s=0\.0 must be a finite number of seconds > 0"):
        fit_per_op(problem, placement, ORDER, 2, 0.0)


def test_the_optimizer_update_adds_the_slowest_stages_update_once_per_step():
    # Per layer, its share of the update (seconds per step): stage 0 of 0-1|2-3 updates 1 + 2 = 3 s,
    # stage 1 0.5 + 0.5 = 1 s; all stages update at once after the flush: 31 (the timeline above) + 3.
    updated = [
        dataclasses.replace(c, update_time_s=u) for c, u in zip(COSTS, (1.0, 2.0, 0.5, 0.5), strict=True)
    ]
    problem = BalanceProblem(updated)
    step = predict_step(problem, Placement.from_string("0-1|2-3"), ORDER, 2)
    assert step.step_s == pytest.approx(34.0)
    assert step.bubble_ratio == pytest.approx(1 - 40 / 62)  # the schedule's bubble, as without the update
    # 0-2|3: stage 0 updates 3.5 s, stage 1 0.5 s: 30 + 3.5.
    assert predict_step(problem, Placement.from_string("0-2|3"), ORDER, 2).step_s == pytest.approx(33.5)
    # The pinned parts update on their stages: the embedding's 2 s on stage 0 makes it 5 s.
    parts = BalanceProblem(updated, hardware=Hardware(first_stage_extra=LayerCost(update_time_s=2.0)))
    assert predict_step(parts, Placement.from_string("0-1|2-3"), ORDER, 2).step_s == pytest.approx(36.0)
    # Negative controls: not the stages' sum (35), not per micro-batch; the fit no longer absorbs it.
    assert step.step_s != pytest.approx(31.0 + 4.0)
    assert fit_per_op(problem, Placement.from_string("0-1|2-3"), ORDER, 2, 34.0) == 0.0
    assert fit_per_op(BalanceProblem(COSTS), Placement.from_string("0-1|2-3"), ORDER, 2, 34.0) > 0.0
    # Costs without an update (traces, emulated models) predict as before, and "params" ignores it.
    assert predict_step(BalanceProblem(COSTS), Placement.from_string("0-1|2-3"), ORDER, 2).step_s == 31.0
    by_params = BalanceProblem([dataclasses.replace(c, num_params=1) for c in updated], by="params")
    plain = BalanceProblem([dataclasses.replace(c, num_params=1) for c in COSTS], by="params")
    placement = Placement.from_string("0-1|2-3")
    assert (
        predict_step(by_params, placement, ORDER, 2).step_s == predict_step(plain, placement, ORDER, 2).step_s
    )


def test_a_negative_or_unknown_update_time_is_refused():
    with pytest.raises(ValueError, match=r"LayerCost\.update_time_s must be a finite number >= 0, got -1\.0"):
        LayerCost(update_time_s=-1.0)
