"""benchmarks.gpu_overhead: its CPU dry run takes the GPU run's code path (no timing is asserted)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from benchmarks._lib.common import run_forked
from benchmarks.gpu_overhead import DRY, MODES, launch_job, main, measure, run_job

pytestmark = pytest.mark.slow  # jobs run in processes of their own


def test_dry_run_runs_every_mode_on_the_same_batches(tmp_path: Path) -> None:
    out = tmp_path / "gpu_overhead.md"
    main(["--dry-run", "--out", str(out)])
    report = out.read_text()
    assert "(dry run: not figures)" in report
    rows = re.findall(r"^\| (\w+) \(vs (\w+)\) \|.*\| ([0-9.]+) \|$", report, flags=re.MULTILINE)
    assert [mode for mode, _, _ in rows] == list(MODES)
    assert dict((mode, base) for mode, base, _ in rows)["dynmo_compile"] == "plain_compile"
    # Plain Lightning, DynMo and both compiled runs do the same work: the first step's loss agrees.
    assert len({loss for _, _, loss in rows}) == 1, rows
    assert "- DynMo + compile / plain + compile:" in report


def test_a_job_in_a_fresh_interpreter_reports_what_the_forked_one_does() -> None:
    # The GPU run launches every job as `python -m benchmarks.gpu_overhead --job ...`; the dry run forks.
    fresh = launch_job("plain", DRY, "cpu", timeout_s=300)
    forked = run_forked(functools.partial(run_job, "plain", DRY, "cpu"), "plain", timeout_s=300)
    assert fresh.keys() == forked.keys() and len(fresh["step_s"]) == len(forked["step_s"]) > 0
    assert fresh["losses"] == forked["losses"]  # the same seed and batches in both


def test_jobs_are_forked_on_the_cpu_only() -> None:
    with pytest.raises(ValueError, match=r"forked jobs run on the CPU only, not on device='cuda'"):
        measure(DRY, 1, "cuda", timeout_s=10, forked=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_the_gpu_run_refuses_to_start_without_a_gpu(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"measures a GPU and none is visible; use --dry-run on CPU"):
        main(["--out", str(tmp_path / "x.md")])
