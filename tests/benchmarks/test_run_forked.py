"""benchmarks._lib.common.run_forked: a smoke run's job in a forked child, its report or its failure."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from benchmarks._lib.common import run_forked


def _report() -> dict[str, Any]:
    return {"pid": os.getpid(), "losses": [1.5, 1.25]}


def _raises() -> dict[str, Any]:
    print("about to fail")
    raise ValueError("boom in the job")


def _hangs() -> dict[str, Any]:
    time.sleep(60)
    return {}


def test_the_report_comes_back_from_another_process() -> None:
    report = run_forked(_report, "job ok", timeout_s=30)
    assert report["losses"] == [1.5, 1.25] and report["pid"] != os.getpid()


def test_a_job_that_raises_fails_with_its_output() -> None:
    expected = r"(?s)job bad failed \(exit 1\):.*about to fail.*ValueError: boom in the job"
    with pytest.raises(RuntimeError, match=expected):
        run_forked(_raises, "job bad", timeout_s=30)


def test_a_job_past_its_timeout_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"job slow ran past 0.5 s \(killed\)"):
        run_forked(_hangs, "job slow", timeout_s=0.5)
    assert time.monotonic() - start < 10
