"""Measured cost curves (benchmarks/trained/cost_curves): quick mode's file structure and its loading by
benchmarks/trace_cases. Structure only: no timing is asserted."""

import json

import pytest

from benchmarks import trace_cases
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


def test_pruning_reports_every_kernel_and_a_winner_per_density(quick_file):
    pruning = json.loads(quick_file.read_text())["cases"]["pruning"]
    assert [p[0] for p in pruning["points"]] == list(cost_curves.DENSITIES)
    for density, row in pruning["kernels_s"].items():
        assert set(row) == set(cost_curves.KERNELS)
        assert pruning["winners"][density] in {*cost_curves.KERNELS, "emulated"}
    assert pruning["semi_structured_2_4"]  # "supported" or why not
    if any(w == "emulated" for w in pruning["winners"].values()):
        assert "emulated" in pruning["label"]


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
