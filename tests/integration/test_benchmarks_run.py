"""The end-to-end benchmarks run (tiny settings) and write their tables; no timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_rebalance_benchmark_runs(tmp_path: Path) -> None:
    from benchmarks import rebalance

    out = tmp_path / "rebalance.md"
    argv = ["--quick", "--steps", "9", "--change-at", "3", "--settle", "2", "--layers", "4", "--fwd-ms", "1"]
    rebalance.main([*argv, "--out", str(out)])
    text = out.read_text()
    for label in (
        "static",
        "DynMo partition/time",
        "DynMo diffusion/time",
        "DynMo partition/params",
        "ideal",
    ):
        assert f"| {label}" in text
    assert "python -m benchmarks.rebalance --quick" in text


def test_overhead_benchmark_runs(tmp_path: Path) -> None:
    from benchmarks import overhead

    out = tmp_path / "overhead.md"
    overhead.main(["--quick", "--steps", "12", "--out", str(out)])
    text = out.read_text()
    assert "| every_n_steps=40 | 12 |" in text and "| every_step (routing noise +-50%) | 12 |" in text
