"""The projection keeps the schedule's interleaving, costs the parts, and its quick mode writes (a)-(d)."""

from __future__ import annotations

import json

import pytest

from benchmarks._lib.trace_cases import cost_trace, dense_trace, head_blocks, load_traces, synthetic_trace
from benchmarks.projection import Shape, best_placement, main, project, step_s
from lightning_dynmo.balancing import uniform
from lightning_dynmo.balancing.step_prediction import predict_step
from lightning_dynmo.pipeline import schedule_order


def test_projection_keeps_interleaving_through_the_schedules_action_lists():
    costs = cost_trace(synthetic_trace(8, 2)).mean_costs()
    placement = uniform(8, 4)
    interleaved = Shape(2, "Interleaved1F1B", 4)
    plain = Shape(4, "1F1B", 4)
    assert interleaved.stages == plain.stages == 4
    projected = step_s(costs, placement, interleaved)
    # The same 4 stages on 2 ranks (2 each, interleaved) run another step than on 4 ranks ...
    assert projected != pytest.approx(step_s(costs, placement, plain))
    # ... and it is exactly the policy's step model under torch's interleaved action lists.
    order = schedule_order("Interleaved1F1B")
    assert projected == predict_step(costs.problem(), placement, order, 4).step_s


def test_projection_costs_the_head():
    stats = dense_trace(8)  # stand-in costs (curves=None): the head's multiply-adds over a block's
    with_head, free = cost_trace(stats, curves=None), cost_trace(stats, head=False, curves=None)
    assert with_head.rows[0].last.fwd_time_s == pytest.approx(head_blocks()) and head_blocks() > 5
    shape = Shape(4, "1F1B", 8)
    # A free head: equal layers are the best split; a costed head moves layers off the last stage.
    assert best_placement(free.mean_costs(), shape, budget=64) == uniform(8, 4)
    placed = best_placement(with_head.mean_costs(), shape, budget=64)
    assert len(placed.layers_of(3)) == 1  # the head's stage keeps one layer (it cannot hold none)
    free_run = project(free, shape, window=1, budget=64)
    head_run = project(with_head, shape, window=1, budget=64)
    assert head_run.runs["static uniform"].total_s > free_run.runs["static uniform"].total_s
    assert head_run.gain("static uniform") > free_run.gain("static uniform") == pytest.approx(1.0)


def test_quick_projection_writes_the_four_tables(tmp_path):
    out = tmp_path / "projection.md"
    report = main(["--quick", "--out", str(out)])
    assert out.read_text() == report + "\n"
    assert f"`python -m benchmarks.projection --quick --out {out}`" in report
    tables = ("**(a) Bubble", "**(b) Rebalancing gain", "**(c) The paper's comparison", "**(d) Re-packing")
    for table in tables:
        assert table in report
    assert "cost curve: proportional" in report and "Step model: predict_step" in report
    assert report.count("| synthetic | 2 x ") == 8  # two shapes in each of the four tables


def test_a_mod_trace_of_the_routed_layers_gets_its_dense_layers_back(tmp_path):
    record = {
        "case": "mod",
        "statistic": "share of tokens processed",
        "unit": "fraction",
        "rows": [{"step": 1, "values": [0.25, 0.5]}, {"step": 2, "values": [0.125, 0.75]}],
    }
    (tmp_path / "mod-2026-11-26.json").write_text(json.dumps(record))
    (trace,) = load_traces(tmp_path)
    assert trace.values == ((1.0, 0.25, 1.0, 0.5), (1.0, 0.125, 1.0, 0.75))  # blocks 0..3, odd ones routed
