"""The end-to-end benchmarks run (tiny settings) and write their tables; no timing is asserted."""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# The sections of the freezing study.
STUDY_SECTIONS = (
    "### 1. Per-layer",
    "### 2. Stage-load imbalance",
    "### 3. Static vs DynMo",
    "### 4. Projection",
)


def run_benchmark(name: str, tmp_path: Path, *argv: str) -> str:
    """Run ``python -m benchmarks.<name> <argv> --out ...`` in this process; the report it wrote."""
    out = tmp_path / f"{name}.md"
    importlib.import_module(f"benchmarks.{name}").main([*argv, "--out", str(out)])
    return out.read_text()


def assert_contains(text: str, *labels: str) -> None:
    missing = [label for label in labels if label not in text]
    assert not missing, f"missing from the report: {missing}"


def test_profiling_benchmark_runs(tmp_path: Path) -> None:
    from benchmarks import profiling

    text = run_benchmark("profiling", tmp_path, "--quick")  # the steady allocator, 1 run of 2 steps
    assert "| steady | 1 | " in text
    assert text.count("| fwd |") == text.count("| bwd |") == len(profiling.HIDDEN)
    assert "python -m benchmarks.profiling --quick" in text and "Figures: **real compute**." in text


def test_profiling_benchmark_rejects_an_unknown_allocator() -> None:
    from benchmarks.profiling import set_allocator

    with pytest.raises(ValueError, match=r"allocator must be one of \('default', 'steady'\), got 'tc'"):
        set_allocator("tc")


def test_head_cost_benchmark_runs(tmp_path: Path) -> None:
    text = run_benchmark("head_cost", tmp_path, "--quick")
    for label in ("| fixed `0-0|1-3` |", "| fixed `0-1|2-3` |", "| fixed `0-2|3-3` |", "| DynMoCallback("):
        assert label in text
    assert "head + loss = nan" not in text  # the callback profiled a window and reported the parts
    assert "After the move (issue 19): DynMo's step / the step of the placement it ended at" in text
    assert "| measuring only `0-1|2-3` |" in text and "measuring only (the same window, no move)" in text
    assert text.count("fastest candidate") >= 1 and "DynMo's choice" in text and "block-only optimum" in text
    assert "Figures: **real compute**." in text and "of the ideal (medians over 1 round(s)" in text
    assert "python -m benchmarks.head_cost --quick" in text


@pytest.mark.timeout(600)  # 8 two-rank jobs
def test_heterogeneous_benchmark_runs(tmp_path: Path) -> None:
    text = run_benchmark("heterogeneous", tmp_path, "--quick")
    assert_contains(text, "### 1a. Rank 1 an emulated worker", "### 1b. Rank 0 -> rank 1", "### 2. GPT")
    assert text.count("| static (uniform) |") == 2 and text.count("| DynMoCallback |") == 2
    assert text.count("of the ideal (medians over 1 round(s)") == 2  # each scenario's paired comparison
    assert "Figures: **emulated**, **real compute**." in text
    assert "| re-pack, micro-batches kept |" in text and "| re-pack + re-tune |" in text
    assert "python -m benchmarks.heterogeneous --quick" in text


def test_a_dated_results_file_is_kept_unless_forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks._lib import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = common.results_path("x", None, force=False)
    path.write_text("committed figures\n")
    with pytest.raises(FileExistsError, match=r"exists; pass --out PATH to write elsewhere or --force"):
        common.results_path("x", None, force=False)
    assert common.results_path("x", None, force=True) == path
    assert common.results_path("x", tmp_path / "y.md", force=False) == tmp_path / "y.md"


def test_freezing_benchmark_runs(tmp_path: Path) -> None:
    text = run_benchmark("freezing", tmp_path, "--quick", "--spread", "0")
    assert_contains(text, *STUDY_SECTIONS)
    assert_contains(
        text,
        "| static uniform |",
        "| DynMo partition/time |",
        "| fixed 0-0|1-3 |",
        "| DynMo (re-partition per level) |",
        "| best fixed for the run |",
        "| first parts |",
    )
    assert text.count("| 2 | uniform |") == 1 and "75% frozen" in text
    assert "python -m benchmarks.freezing --quick --spread 0" in text
    assert "Figures: **real compute**, **projected**." in text


def test_callback_cost_benchmark_runs(tmp_path: Path) -> None:
    text = run_benchmark("callback_cost", tmp_path, "--quick")
    for label in ("no callback", "DynMo idle", "DynMo every step", "DynMo every step, no skipping"):
        assert f"| {label} |" in text
    assert "python -m benchmarks.callback_cost --quick" in text
    assert "Figures: **real compute**." in text


def test_hook_cost_benchmark_runs(tmp_path: Path) -> None:
    text = run_benchmark("hook_cost", tmp_path, "--quick")
    assert "python -m benchmarks.hook_cost --quick" in text
    for blocks in (1, 4, 7):  # the hooks table: one row per model and stage size
        assert re.search(rf"^\| gpt \| {blocks} \| [\d.]+ \| [\d.]+ \| [+-][\d.]+% \|", text, re.M), blocks
    for work in (1, 3, 6):  # the after-idle table: one row per amount of work
        assert re.search(rf"^\| {work} \| [\d.]+ \| [\d.]+ \| [+-][\d.]+ \| [\d.]+ \|$", text, re.M), work


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="co-running needs 2 usable cores")
def test_machine_noise_benchmark_runs(tmp_path: Path) -> None:
    text = run_benchmark("machine_noise", tmp_path, "--quick")
    assert "python -m benchmarks.machine_noise --quick" in text
    # Co-running: one row per timed core, both phases filed; drift: one row per fresh process.
    assert (
        len(re.findall(r"^\| \d \| [\d.]+ \| [\d.]+ \| [+-][\d.]+% \| [1-9]\d* / [1-9]\d* \|$", text, re.M))
        == 2
    )
    assert len(re.findall(r"^\| [12] \| \d \| [\d.]+, [\d.]+ \| [\d.]+ \| \d+% \|$", text, re.M)) == 2
    assert re.search(
        r"Inside a process, its segments span \d+% .* Between processes, their medians span \d+%", text
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="co-running needs 2 usable cores")
def test_machine_noise_refuses_one_core_and_a_phase_no_step_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import machine_noise

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit, match="machine_noise needs 2 usable cores"):
        machine_noise.main(["--quick", "--out", "unused.md"])
    monkeypatch.undo()
    # Phases longer than the run: every timed step falls in the first (busy) phase, none in an idle one.
    with pytest.raises(RuntimeError, match="no step fell inside a phase; raise --phase-s"):
        machine_noise.corun(sorted(os.sched_getaffinity(0))[:2], seconds=0.5, phase_s=100.0)
