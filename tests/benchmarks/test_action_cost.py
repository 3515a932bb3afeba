"""benchmarks.action_cost: the quick run keeps working (no timing is asserted), the check's options."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks import action_cost
from benchmarks.action_cost import PIECES, WHOLE, main, sizes_for


@pytest.mark.slow  # each job is its own Python process
def test_quick_run_writes_every_job_and_the_profiled_against_measured_table(tmp_path: Path) -> None:
    out = tmp_path / "action_cost.md"
    main(["--quick", "--out", str(out)])
    report = out.read_text()
    assert "Command: `python -m benchmarks.action_cost --quick --out" in report
    for label in ("torch's bare PipelineStage + Schedule1F1B", "DynMoStrategy + DynMoCallback idle"):
        assert f"| {label} |" in report
    assert "DynMo idle / bare, CPU per action: **" in report
    for label in ("uncompiled", "compiled (backend 'eager')"):
        assert f"| {label} | 1 |" in report
        assert f"| {label} | median |" in report
    assert "### Where the step goes" in report
    # The same work in every job: the first step's loss is the same number.
    first = re.findall(r"(bare|dynmo_idle|dynmo_window|dynmo_check:\w+): ([0-9.]+) \.\.", report)
    assert [name for name, _ in first] == [
        "bare",
        "dynmo_idle",
        "dynmo_window",
        "dynmo_check:none",
        "dynmo_check:eager",
    ]
    assert len({loss for _, loss in first}) == 1, first


def _fake_run(share: float) -> dict[str, Any]:
    """A job's report whose profiled blocks + parts + update are ``share`` of the whole step (10 ms)."""
    steps = 12  # the default shape's medians start at step 10
    pieces = {name: [0.001] * steps for name in PIECES}
    pieces[WHOLE] = [0.010] * steps
    return {
        "cpu_s": [0.008] * steps,
        "wall_s": [0.009] * steps,
        "schedule_s": [0.008] * steps,
        "pieces_s": pieces,
        "whole_cpu_s": [0.010] * steps,
        "losses": [5.0] * steps,
        "profiled_s": {"blocks": 0.007 * share, "parts": 0.002 * share, "update": 0.001 * share},
        "window_steps": [9, 10, 11],
    }


def test_check_only_runs_the_check_jobs_alone_and_its_verdict_can_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched: list[str] = []

    def fake_launch(name: str, sizes: Any, timeout_s: float = 0.0) -> dict[str, Any]:
        launched.append(name)
        return _fake_run(0.95 if name == "dynmo_check:none" else 0.5)

    monkeypatch.setattr(action_cost, "launch_job", fake_launch)
    out = tmp_path / "check.md"
    main(["--check-only", "--rounds", "2", "--out", str(out)])
    assert sorted(launched) == ["dynmo_check:inductor"] * 2 + ["dynmo_check:none"] * 2
    report = out.read_text()
    assert "CPU per action" not in report  # no per-action table
    assert "| uncompiled | 2 |" in report
    for over in ("over the steps the profiler measured", "over the run's steps"):
        assert f"- uncompiled, {over}" in report
    # Over the window's steps and over the run's.
    assert report.count("median of the rounds: **0.950**: within 10% of the measured step.") == 2
    assert report.count("median of the rounds: **0.500**: NOT within 10% of the measured step.") == 2
    assert "| uncompiled | 1 (steps 9, 10, 11) | 6.65 | 1.90 | 0.95 | 9.50 |" in report  # the update counts
    assert "| · optimizer update (AdamW) | 1.00 | 10.0% |" in report


def test_shape_d512_is_a_realistic_stage_and_quick_overrides_it() -> None:
    sizes = sizes_for("d512", quick=False)
    assert (sizes.width, sizes.tokens, sizes.heads) == (512, 256, 8)
    assert sizes.steps > sizes.skip
    assert sizes_for("d512", quick=True).width == 32


def test_unknown_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--shape='d4096' is not one of \['d512', 'd512x2', 'small'\]"):
        main(["--shape", "d4096", "--out", str(tmp_path / "x.md")])


def test_rounds_must_be_at_least_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--rounds=0: a comparison needs at least 1 round"):
        main(["--rounds", "0", "--out", str(tmp_path / "x.md")])
