"""benchmarks.action_cost: the quick run keeps working (no timing is asserted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.action_cost import main

pytestmark = pytest.mark.slow  # each job is its own Python process


def test_quick_run_writes_every_job_and_the_profiled_against_measured_table(tmp_path: Path) -> None:
    out = tmp_path / "action_cost.md"
    main(["--quick", "--out", str(out)])
    report = out.read_text()
    assert "Command: `python -m benchmarks.action_cost --quick --out" in report
    for label in ("torch's bare PipelineStage + Schedule1F1B", "DynMoStrategy + DynMoCallback idle"):
        assert f"| {label} |" in report
    assert "DynMo idle / bare, CPU per action: **" in report
    assert "| compiled (backend 'eager'), a window every 2 steps |" in report
    # The same work in every job: the first step's loss is the same number.
    first = re.findall(r"(bare|dynmo_idle|dynmo_window): ([0-9.]+) \.\.", report)
    assert [name for name, _ in first] == ["bare", "dynmo_idle", "dynmo_window"]
    assert len({loss for _, loss in first}) == 1, first


def test_rounds_must_be_at_least_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--rounds=0: a comparison needs at least 1 round"):
        main(["--rounds", "0", "--out", str(tmp_path / "x.md")])
