"""The action-list step model: dependencies, link times, the textbook step, the old simulator, bad input.

Per-schedule hand-worked timelines on torch's own action lists live in
``tests/unit/pipeline/test_schedule_actions.py`` (they need torch); these tests are pure.
"""

from __future__ import annotations

import math

import pytest

from lightning_dynmo.balancing import simulate_pipeline
from lightning_dynmo.balancing.schedule_model import (
    Action,
    LinkTime,
    StageTimes,
    simulate_step,
)
from tests.unit.balancing.timelines import per_rank


def gpipe(num_stages: int, m: int) -> list[list[Action]]:
    return [[(s, "F", i) for i in range(m)] + [(s, "B", i) for i in range(m)] for s in range(num_stages)]


def one_f_one_b(num_stages: int, m: int) -> list[list[Action]]:
    # Written out independently of actions.py: warm-up of p - s - 1 forwards, then F/B pairs, then Bs.
    out = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, m)
        order: list[Action] = [(s, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [(s, "F", warmup + i), (s, "B", i)]
        out.append(order + [(s, "B", i) for i in range(m - warmup, m)])
    return out


def test_gpipe_with_links_matches_the_hand_worked_timeline() -> None:
    # 2 ranks, 2 micro-batches, F=1, B=2, 0.5 s each way over the one boundary.
    # rank 0: F0 0-1, F1 1-2. rank 1: F0 waits for 1 + 0.5 -> 1.5-2.5, F1 max(2.5, 2 + 0.5) -> 2.5-3.5,
    # B0 3.5-5.5, B1 5.5-7.5. rank 0: B0 waits for 5.5 + 0.5 -> 6-8, B1 max(8, 7.5 + 0.5) -> 8-10. Step 10.
    sim = simulate_step(gpipe(2, 2), [StageTimes(1.0, 2.0)] * 2, [LinkTime(0.5)])
    assert per_rank(sim) == [
        "0F0@0-1 0F1@1-2 0B0@6-8 0B1@8-10",
        "1F0@1.5-2.5 1F1@2.5-3.5 1B0@3.5-5.5 1B1@5.5-7.5",
    ]
    assert sim.step_time_s == 10.0
    assert sim.rank_busy_s == (6.0, 6.0)
    assert sim.rank_idle_s == (4.0, 4.0)
    # The chain that sets the step: 0B1's start (8) ties between 0B0's end and 1B1's end + link; a tie
    # goes to the rank's previous action.
    path = [f"{t.stage}{t.kind}{t.micro_batch}" for t in sim.critical_path]
    assert path == ["0F0", "1F0", "1F1", "1B0", "0B0", "0B1"]


def test_gradient_and_activation_links_are_separate() -> None:
    # Activation 0 s, gradient 1 s: only the backward waits. rank 1: F0 1-2, F1 2-3, B0 3-5, B1 5-7.
    # rank 0: B0 waits for 5 + 1 -> 6-8, B1 max(8, 7 + 1) -> 8-10.
    sim = simulate_step(gpipe(2, 2), [StageTimes(1.0, 2.0)] * 2, [LinkTime(0.0, gradient_s=1.0)])
    assert per_rank(sim)[0] == "0F0@0-1 0F1@1-2 0B0@6-8 0B1@8-10"
    assert per_rank(sim)[1] == "1F0@1-2 1F1@2-3 1B0@3-5 1B1@5-7"


@pytest.mark.parametrize("order", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (2, 4), (4, 8), (8, 16), (4, 3)])
def test_equal_stages_give_the_textbook_step(order, p: int, m: int) -> None:
    fwd, bwd = 1.5, 2.5
    sim = simulate_step(order(p, m), [StageTimes(fwd, bwd)] * p)
    assert sim.step_time_s == pytest.approx((m + p - 1) * (fwd + bwd))


@pytest.mark.parametrize(("order", "name"), [(gpipe, "gpipe"), (one_f_one_b, "1f1b")])
@pytest.mark.parametrize("comm", [0.0, 0.3])
def test_the_old_simulator_agrees_on_single_stage_schedules(order, name: str, comm: float) -> None:
    # Unequal stages and links: the old op-order simulator and the action-list model must agree exactly.
    fwd, bwd, m = [1.0, 2.5, 0.7, 1.2], [2.0, 4.0, 1.1, 3.0], 6
    old = simulate_pipeline(fwd, bwd, m, name, comm_s=comm)
    new = simulate_step(order(4, m), [StageTimes(f, b) for f, b in zip(fwd, bwd, strict=True)], comm)
    assert new.step_time_s == pytest.approx(old.step_time_s)
    assert new.rank_idle_s == pytest.approx(old.stage_idle_s)


def test_stages_on_one_rank_exchange_without_link_time() -> None:
    # Stages 0 and 1 on rank 0, stage 2 on rank 1, one micro-batch, F=1, B=2, 5 s links: only the 1-2
    # boundary crosses ranks. F(0) 0-1, F(1) 1-2, F(2) 7-8, B(2) 8-10, B(1) 15-17, B(0) 17-19.
    acts = [[(0, "F", 0), (1, "F", 0), (1, "B", 0), (0, "B", 0)], [(2, "F", 0), (2, "B", 0)]]
    sim = simulate_step(acts, [StageTimes(1.0, 2.0)] * 3, 5.0)
    assert per_rank(sim) == ["0F0@0-1 1F0@1-2 1B0@15-17 0B0@17-19", "2F0@7-8 2B0@8-10"]


def test_split_backward_runs_weight_gradients_after_input_gradients() -> None:
    # One stage per rank, I=1, W=3: stage 0's I waits for stage 1's I (not its W).
    # rank 1: F 1-2, I 2-3, W 3-6. rank 0: F 0-1, I 3-4, W 4-7. Step 7.
    acts = [[(0, "F", 0), (0, "I", 0), (0, "W", 0)], [(1, "F", 0), (1, "I", 0), (1, "W", 0)]]
    times = [StageTimes(1.0, input_grad_s=1.0, weight_grad_s=3.0)] * 2
    sim = simulate_step(acts, times)
    assert per_rank(sim) == ["0F0@0-1 0I0@3-4 0W0@4-7", "1F0@1-2 1I0@2-3 1W0@3-6"]
    assert sim.step_time_s == 7.0


def test_a_wrong_order_deadlocks_and_names_the_waits() -> None:
    # Negative control: rank 1 runs B0 before the F0 it needs (swapped), so nothing can go on.
    acts = gpipe(2, 1)
    acts[1] = [(1, "B", 0), (1, "F", 0)]
    with pytest.raises(
        ValueError,
        match=r"deadlock: rank 0 waits at B\(stage 0, mb 0\) \(position 1\) for B\(stage 1, mb 0\) or "
        r"I\(stage 1, mb 0\); rank 1 waits at B\(stage 1, mb 0\) \(position 0\) for F\(stage 1, mb 0\)",
    ):
        simulate_step(acts, [StageTimes(1.0, 2.0)] * 2)


def test_a_missing_action_is_named_as_never_listed() -> None:
    acts = [[(0, "F", 0), (0, "B", 0)], [(1, "F", 0)]]
    with pytest.raises(
        ValueError, match=r"for B\(stage 1, mb 0\) or I\(stage 1, mb 0\) \(which no rank lists\)"
    ):
        simulate_step(acts, [StageTimes(1.0, 2.0)] * 2)


def test_a_different_valid_order_changes_the_step() -> None:
    # Negative control: feeding GPipe's order where 1F1B's runs (both valid) is seen in the step time
    # under unequal stages and links, so the model does follow the order it is given.
    times = [StageTimes(1.0, 2.0), StageTimes(2.0, 3.0), StageTimes(1.0, 1.0)]
    a = simulate_step(gpipe(3, 4), times, 0.5).step_time_s
    b = simulate_step(one_f_one_b(3, 4), times, 0.5).step_time_s
    assert a != b


@pytest.mark.parametrize(
    ("acts", "times", "links", "match"),
    [
        ([[(0, "X", 0)]], [StageTimes(1.0, 1.0)], 0.0, r"action \(0, 'X', 0\) of unknown kind 'X'"),
        ([[(1, "F", 0)]], [StageTimes(1.0, 1.0)], 0.0, r"whose stage must be an integer >= 0 below 1"),
        ([[(0, "F", -1)]], [StageTimes(1.0, 1.0)], 0.0, r"whose micro-batch must be an integer >= 0"),
        ([[(0, "F", 0), (0, "F", 0)]], [StageTimes(1.0, 1.0)], 0.0, r"lists F\(0, 0\) which rank 0 already"),
        (
            [[(0, "F", 0)], [(0, "B", 0)]],
            [StageTimes(1.0, 1.0)],
            0.0,
            r"stage 0 has actions on rank 0 and rank 1",
        ),
        ([[(0, "F", 0), (0, "B", 0), (0, "I", 0)]], [StageTimes(1, 1, 1, 1)], 0.0, r"both B and I for micro"),
        (
            [[(0, "F", 0)]],
            [StageTimes(-1.0, 1.0)],
            0.0,
            r"stage_times\[0\]\.forward_s=-1\.0 must be a finite",
        ),
        ([[(0, "F", 0)]], [StageTimes(1.0, math.nan)], 0.0, r"stage_times\[0\]\.backward_s=nan must be"),
        ([[(0, "F", 0)]], [StageTimes(1.0, 1.0)], -0.5, r"links=-0\.5 must be a finite number"),
        ([[(0, "F", 0)]] * 1, [StageTimes(1.0, 1.0)] * 2, [], r"links has 0 entries but 2 stages have 1"),
        (
            [[(0, "F", 0), (0, "I", 0)]],
            [StageTimes(1.0, 2.0)],
            0.0,
            r"stage 0 runs I actions but its StageTimes",
        ),
        ([[(0, "F", 0)]], [], 0.0, r"stage_times is empty"),
    ],
)
def test_bad_input_is_rejected(acts, times, links, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        simulate_step(acts, times, links)


def test_a_negative_gradient_link_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"links\[0\]\.gradient_s=-1\.0 must be a finite"):
        simulate_step(gpipe(2, 1), [StageTimes(1.0, 1.0)] * 2, [LinkTime(0.0, -1.0)])


def test_full_backward_defaults_to_input_plus_weight() -> None:
    assert StageTimes(1.0, input_grad_s=0.5, weight_grad_s=0.75).duration("B", 0) == 1.25
