"""Measured cost curves (benchmarks/trained/cost_curves): quick mode's file structure and its loading by
benchmarks/trace_cases. Structure only: no timing is asserted."""

import json
import statistics

import pytest

from benchmarks._lib import trace_cases
from benchmarks.trained import cost_curves
from lightning_dynmo.balancing.trace import StatisticTrace

CURVE_CASES = {"mod", "early_exit", "pruning", "sparse_attention", "moe", "freezing"}


@pytest.fixture(scope="module")
def quick_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("curves")
    return cost_curves.main(["--quick", "--out", str(out)])


def test_quick_mode_writes_every_case_with_points_label_fit_and_hardware(quick_file):
    data = json.loads(quick_file.read_text())
    assert quick_file.name.startswith("cost_curves-") and quick_file.with_suffix(".md").exists()
    assert data["quick"] is True and data["hardware"]
    assert data["command"] == f"python -m benchmarks.trained.cost_curves --quick --out {quick_file.parent}"
    assert set(data["cases"]) == CURVE_CASES
    for name, case in data["cases"].items():
        xs = [p[0] for p in case["points"]]
        assert xs == sorted(xs) and len(xs) >= 2, name
        assert all(len(p) == 3 and p[1] > 0 and p[2] >= 0 for p in case["points"]), name
        assert case["label"] and case["statistic"] and len(case["dense_block_s"]) == 2, name
        assert case["fit"]["max_relative_error"] >= 0, name
    assert set(data["parts"]) == {"dense_block", "embedding", "head_and_loss"}


def test_pruning_reports_every_kernel_and_uses_the_fastest_unstructured_one(quick_file):
    pruning = json.loads(quick_file.read_text())["cases"]["pruning"]
    assert [p[0] for p in pruning["points"]] == list(cost_curves.DENSITIES)
    block_fwd, block_bwd = pruning["dense_block_s"]
    rows = pruning["kernels_s"]
    # The dense kernel does the same work at every density: its time is the median over the densities.
    dense = tuple(statistics.median(row["dense"][i] for row in rows.values()) for i in (0, 1))
    for (density, row), (_, fwd, bwd) in zip(rows.items(), pruning["points"], strict=True):
        assert set(row) == set(cost_curves.KERNELS)
        winner = pruning["winners"][density]
        # Only a kernel that runs unstructured sparsity (never BSR's tiles), the faster of the two:
        assert winner in cost_curves.UNSTRUCTURED
        candidates = {k: dense if k == "dense" else tuple(row[k]) for k in cost_curves.UNSTRUCTURED}
        used = candidates[winner]
        assert sum(used) == min(sum(v) for v in candidates.values())
        assert fwd == pytest.approx(block_fwd - dense[0] + used[0])
        assert bwd == pytest.approx(block_bwd - dense[1] + used[1])
    assert pruning["semi_structured_2_4"]  # "supported" or why not
    assert "unstructured" in pruning["label"]


def test_freezing_curve_is_forward_only_when_frozen(quick_file):
    freezing = json.loads(quick_file.read_text())["cases"]["freezing"]
    (x0, _, frozen_bwd), (x1, _, trainable_bwd) = freezing["points"]
    assert (x0, x1, frozen_bwd) == (0.0, 1.0, 0.0) and trainable_bwd > 0


def test_fit_error_is_zero_on_a_line_and_relative_otherwise():
    assert cost_curves.fit_error([(0.0, 1.0, 2.0), (1.0, 2.0, 4.0), (2.0, 3.0, 6.0)])[
        "max_relative_error"
    ] == pytest.approx(0.0, abs=1e-12)
    bent = cost_curves.fit_error([(0.0, 1.0, 1.0), (1.0, 1.0, 1.0), (2.0, 4.0, 4.0)])
    assert bent["max_relative_error"] > 0.1


def test_trace_cases_uses_the_newest_measured_curve_and_stand_ins_otherwise(quick_file, tmp_path):
    stats = StatisticTrace("mod", "share", "fraction", (0,), ((1.0, 0.5),), "test")
    standin = trace_cases.cost_trace(stats, curves=tmp_path)  # an empty folder: no measured file
    assert "stand-in" in standin.curve_label and "proportional" in standin.curve_label
    data = json.loads(quick_file.read_text())
    del data["cases"]["moe"]
    (tmp_path / "cost_curves-2000-01-01.json").write_text(json.dumps({"cases": {}}))  # older: ignored
    (tmp_path / "cost_curves-2999-01-01.json").write_text(json.dumps(data))
    measured = trace_cases.cost_trace(stats, curves=tmp_path)
    assert measured.curve_label.startswith("measured (cost_curves-2999-01-01.json)")
    moe = StatisticTrace("moe", "ratio", "-", (0,), ((1.0, 2.0),), "test")
    assert "stand-in" in trace_cases.cost_trace(moe, curves=tmp_path).curve_label
    assert "stand-in" in trace_cases.cost_trace(stats, curves=None).curve_label


def test_the_model_without_its_dynamism_uses_the_cases_measured_curve(quick_file, tmp_path):
    (tmp_path / "cost_curves-2999-01-01.json").write_text(quick_file.read_text())
    stats = StatisticTrace("pruning", "density", "fraction", (0,), ((0.1, 0.5),), "test")
    dense = trace_cases.cost_trace(stats, dense=True, curves=tmp_path)  # renames the trace's case
    assert dense.curve_label.startswith("measured (cost_curves-2999-01-01.json)")
    sparse = trace_cases.cost_trace(stats, curves=tmp_path)
    costs = [r.layers for r in (dense.rows[0], sparse.rows[0])]
    assert costs[0][0] == costs[0][1] and costs[0][1] == costs[1][1]  # density 1.0 (dense) everywhere
