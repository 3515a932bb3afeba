"""The paper-setup projection: its independent evaluator and search agree with the code under test (and
can disagree), the depth mapping, the sequence scaling, the errors, and the quick mode's tables."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest

from benchmarks import cost_smoothing
from benchmarks._lib import independent_search as ind
from benchmarks._lib.trace_cases import CASES
from benchmarks.paper_setup import (
    best_placement,
    dynmo_placements,
    main,
    map_depth,
    mapped,
    newest_head,
    seq_scale,
)
from benchmarks.projection import Shape, step_s
from lightning_dynmo.balancing import LayerCost, Placement, partition, uniform
from lightning_dynmo.balancing.hardware import Hardware
from lightning_dynmo.balancing.problem import BalanceProblem
from lightning_dynmo.balancing.step_prediction import predict_step
from lightning_dynmo.balancing.trace import CostTrace, StatisticTrace, StepCosts
from lightning_dynmo.balancing.workers import worker_loads
from lightning_dynmo.pipeline import schedule_order
from lightning_dynmo.pipeline.step.actions import schedule_actions


def _problem(draw: random.Random, layers: int) -> tuple[BalanceProblem, ind.Row]:
    costs = [(draw.uniform(1, 3), draw.uniform(2, 6)) for _ in range(layers)]
    first, last = (0.1, 0.2), (draw.uniform(3, 8), draw.uniform(6, 16))
    problem = BalanceProblem(
        [LayerCost(fwd_time_s=f, bwd_time_s=b) for f, b in costs],
        hardware=Hardware(
            LayerCost(fwd_time_s=first[0], bwd_time_s=first[1]),
            LayerCost(fwd_time_s=last[0], bwd_time_s=last[1]),
        ),
    )
    return problem, (costs, first, last)


@pytest.mark.parametrize(("schedule", "stages"), [("1F1B", 4), ("ZBVZeroBubble", 4), ("ZBVZeroBubble", 8)])
def test_the_independent_evaluator_agrees_with_the_step_model_and_a_wrong_rule_does_not(schedule, stages):
    draw = random.Random(stages)
    problem, row = _problem(draw, 12)
    m = 8
    actions = schedule_actions(schedule, stages, m)
    for _ in range(5):
        cuts = sorted(draw.sample(range(1, 12), stages - 1))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, 12], strict=True)]
        placement = Placement.from_sizes(sizes)
        model = predict_step(problem, placement, schedule_order(schedule), m).step_s
        assert ind.step_time(row, sizes, actions, m) == pytest.approx(model, rel=1e-9)
    # Negative control: the same comparison fails when the head's backward is counted twice.
    costs, first, last = row
    wrong = (costs, first, (last[0], 2 * last[1]))
    assert ind.step_time(wrong, sizes, actions, m) != pytest.approx(model, rel=1e-6)


def test_the_independent_search_finds_the_exhaustive_optimum():
    draw = random.Random(1)
    rows = [_problem(draw, 8)[1] for _ in range(3)]
    actions = schedule_actions("1F1B", 4, 8)
    every = [
        [b - a for a, b in zip([0, *c], [*c, 8], strict=True)] for c in itertools.combinations(range(1, 8), 3)
    ]
    best = min(ind.total(rows, s, actions, 8) for s in every)
    found = ind.search(rows, 4, actions, 8)
    assert ind.total(rows, found, actions, 8) == pytest.approx(best, rel=1e-9)
    # Negative control: the uniform split is measurably worse here (the head sits on the last stage).
    assert ind.total(rows, [2, 2, 2, 2], actions, 8) > 1.01 * best


def test_minmax_sizes_is_the_exact_bottleneck():
    loads = [1.0, 5.0, 1.0, 1.0, 1.0, 1.0]
    sizes = ind.minmax_sizes(loads, 0.0, 4.0, 3)
    assert sum(sizes) == 6 and len(sizes) == 3 and min(sizes) >= 1
    runs, start = [], 0
    for n in sizes:
        runs.append(sum(loads[start : start + n]))
        start += n
    runs[-1] += 4.0
    assert max(runs) == pytest.approx(6.0)  # [1] [5] [1 1 1 1]+4 -> 8; [1 5] [1 1] [1 1]+4 -> 6


def test_depth_mapping_by_fraction():
    values = tuple(float(i) for i in range(30))
    assert map_depth(values, 30) == values
    assert map_depth(values, 48)[0] == 0.0 and map_depth(values, 48)[-1] == 29.0
    assert map_depth(values, 24) == tuple(float(int((i + 0.5) * 30 / 24)) for i in range(24))
    mod = StatisticTrace("mod", "share", "fraction", (0, 1), ((1.0, 0.2) * 15, (1.0, 0.4) * 15))
    row = mapped(mod, 48, 8).values[1]
    assert len(row) == 48 and row[0::2] == (1.0,) * 24 and set(row[1::2]) == {0.4}


def test_seq_scale_is_linear_x2_and_scores_x4():
    a = 1024 / (12 * 1024 + 1024)
    assert seq_scale() == pytest.approx(2 * (1 - a) + 4 * a)
    assert seq_scale(seq_to=1024) == pytest.approx(1.0)


def test_missing_head_measurement_and_bad_options_fail_with_the_fix(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"no paper_head-<date>\.json in .*measure it first"):
        newest_head(tmp_path)
    with pytest.raises(SystemExit):
        main(["--quick", "--rows", "0", "--out", str(tmp_path / "x.md")])
    assert "--rows=0 must be >= 1" in capsys.readouterr().err


def test_measure_head_writes_every_round_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "head.json"
    text = main(["--quick", "--measure-head", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert json.loads(text) == record and len(record["rounds"]) == 2
    assert record["ratio_fwd"] > 0 and record["ratio_bwd"] > 0 and "quick" in record["kind"]
    assert record["command"].startswith("python -m benchmarks.paper_setup --quick --measure-head 2")
    with pytest.raises(FileExistsError, match="exists; pass --out PATH"):
        main(["--quick", "--measure-head", "2", "--out", str(out)])


def test_zbv_placements_balance_the_ranks_as_the_policy_does():
    draw = random.Random(1)  # a draw where the per-stage split stacks load on one rank
    loads = [draw.choice([1.0, 1.0, 2.0, 4.0]) for _ in range(16)]
    costs = tuple(LayerCost(fwd_time_s=x, bwd_time_s=2 * x) for x in loads)
    step = StepCosts(costs, LayerCost(), LayerCost(fwd_time_s=4.0, bwd_time_s=8.0))
    shape = Shape(4, "ZBVZeroBubble", 8)  # stage s and 7 - s share a rank
    workers = [0, 1, 2, 3, 3, 2, 1, 0]

    def heaviest(p: Placement) -> float:
        return max(worker_loads(step.problem(), p, workers).values())

    placed = best_placement(step, shape, budget=4)
    assert heaviest(placed) == 36.0
    assert heaviest(partition(step.problem(), 8)) == 42.0  # control: the per-stage split


def test_quick_mode_writes_the_four_tables(tmp_path):
    out = tmp_path / "paper.md"
    report = main(["--quick", "--out", str(out)])
    assert out.read_text() == report + "\n"
    for table in (
        "**(a) Mean step",
        "**(b) Bubble",
        "**(c) Best fixed, re-derived independently",
        "**(d) The policy's decision time",
    ):
        assert table in report
    assert report.count("| synthetic | 8 | 2 x ") == 8  # two shapes in each of the four tables
    assert "all rows within 1%" in report


def test_the_search_returns_the_only_placement_when_every_stage_has_one_layer():
    row = ([(1.0, 2.0)] * 4, (0.0, 0.0), (3.0, 6.0))
    actions = schedule_actions("1F1B", 4, 4)
    assert ind.search([row], 4, actions, 4) == [1, 1, 1, 1]


def test_decisions_only_writes_table_d_alone(tmp_path):
    report = main(["--quick", "--decisions-only", "--out", str(tmp_path / "d.md")])
    assert "**(d) The policy's decision time**" in report and "no projection ran" in report
    assert "**(a) Mean step" not in report and "Independent check" not in report
    assert report.count("| synthetic | 8 | 2 x ") == 2  # one line per timed shape


def _noisy_trace(rows: int, persistent_from: int | None = None) -> CostTrace:
    draw = random.Random(3)
    head = LayerCost(fwd_time_s=3.0, bwd_time_s=6.0)
    steps = []
    for r in range(rows):
        heavy = persistent_from is not None and r >= persistent_from
        loads = [(3.0 if heavy and i < 4 else 1.0) * draw.uniform(0.85, 1.15) for i in range(16)]
        steps.append(
            StepCosts(tuple(LayerCost(fwd_time_s=x, bwd_time_s=2 * x) for x in loads), LayerCost(), head)
        )
    return CostTrace("moe", "synthetic", tuple(range(rows)), tuple(steps))


def test_dynmo_is_the_librarys_policy_it_keeps_its_split_under_noise_and_follows_a_lasting_change():
    shape = Shape(4, "1F1B", 8)
    noisy = _noisy_trace(12)
    placements = dynmo_placements(noisy, shape, phases=False)
    assert len(set(map(str, placements))) == 1  # noise of +-15% per step: no move after the first
    # Negative control: the old rule (the previous row's best, applied when predicted faster at all)
    # chases the same noise.
    chased, current = [], uniform(16, 4)
    for r in range(noisy.num_rows):
        seen = noisy.rows[max(0, r - 1)]
        candidate = best_placement(seen, shape, budget=64)
        if step_s(seen, candidate, shape) < step_s(seen, current, shape):
            current = candidate
        chased.append(str(current))
    assert len(set(chased)) > 1
    # A lasting change (the first four layers three times as costly from row 4) is followed.
    shifted = dynmo_placements(_noisy_trace(12, persistent_from=4), shape, phases=False)
    assert shifted[3] == placements[3] and shifted[-1] != shifted[3]
    assert step_s(_noisy_trace(12, 4).rows[-1], shifted[-1], shape) < step_s(
        _noisy_trace(12, 4).rows[-1], shifted[3], shape
    )


def test_a_phased_case_runs_each_row_at_the_placement_decided_from_its_own_costs():
    # The pruner announces every pruning stage (notify_dynamism("pruned")), freezing every decision:
    # DynMo rebalances on the event, so each phase runs balanced for itself.
    assert CASES["pruning"].phases and CASES["freezing"].phases
    shape = Shape(4, "1F1B", 8)
    trace = _noisy_trace(3, persistent_from=1)  # the first four layers three times as costly from row 1
    phased = dynmo_placements(trace, shape, phases=True)
    decided_on_row_1 = dynmo_placements(
        CostTrace("moe", "synthetic", (0,), (trace.rows[1],)), shape, phases=True
    )[0]
    assert phased[1] == decided_on_row_1 and phased[1] != phased[0]
    # Negative control: unphased, row 1 still runs at what row 0's costs decided (one row behind).
    behind = dynmo_placements(trace, shape, phases=False)
    assert behind[1] == behind[0] and step_s(trace.rows[1], phased[1], shape) < step_s(
        trace.rows[1], behind[1], shape
    )


def test_the_bias_corrected_average_follows_a_change_the_first_row_would_hold_back():
    # Row 0 (the start of a run) has its first four layers three times as costly; every later row is
    # flat. The callback's bias-corrected average gives row 0 a share (1 - w) w ** age over the weights'
    # sum, which fades: DynMo ends on a split of the flat rows.
    shape = Shape(4, "1F1B", 8)
    flat = _noisy_trace(6)
    first = _noisy_trace(1, persistent_from=0).rows[0]
    trace = dataclasses.replace(flat, rows=(first, *flat.rows[1:]))

    def later_rows_s(placements: list[Placement]) -> float:
        return sum(step_s(r, p, shape) for r, p in zip(trace.rows[1:], placements[1:], strict=True))

    corrected = dynmo_placements(trace, shape, phases=False, smoothing=0.8, margin=0.0)
    # Negative control: the average started from row 0 keeps 0.8 ** n of it (41% after four more rows):
    # it moves once, half way, and stays on a split that still shields the first layers.
    uncorrected = dynmo_placements(
        trace, shape, phases=False, smoothing=0.8, bias_corrected=False, margin=0.0
    )
    assert len(set(map(str, uncorrected[2:]))) == 1 and uncorrected[-1] != corrected[-1]
    assert later_rows_s(corrected) < 0.95 * later_rows_s(uncorrected)
    assert step_s(trace.rows[-1], corrected[-1], shape) < 0.9 * step_s(trace.rows[-1], uncorrected[-1], shape)


def test_cost_smoothing_quick_mode_reports_every_weight_and_margin(tmp_path):
    report = cost_smoothing.main(["--quick", "--out", str(tmp_path / "s.md")])
    header = (
        "| replay | uniform | head-aware | 0.3 | 0.5 | 0.65 | 0.8 | margin 0 | margin 0.5 | margin 1 | "
        "margin 1.5 | margin 2 | 0.8, not corrected, no margin |"
    )
    assert header in report and (tmp_path / "s.md").read_text() == report + "\n"
    assert report.count("| **mean** |") == 1 and "6 steps, a row a step" in report
