"""A rank killed by a signal is named by the process that launched it, in one line.

Lightning's script launcher (rank 0 starts the other ranks) and the application's launcher (torch's
elastic agent) each see only an exit code; the line says which rank, its pid and the signal, with "out of
memory?" for SIGKILL (what the OOM killer sends).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import lightning_dynmo.app.launch as app_launch
from lightning_dynmo.pipeline.faults.death import death_line
from lightning_dynmo.strategy.child_watch import ChildWatch


def test_the_line_names_the_rank_pid_and_signal() -> None:
    assert (
        death_line(1, 4242, -signal.SIGKILL)
        == "DynMo: rank 1 (pid 4242) was killed by SIGKILL (out of memory?)."
    )
    assert death_line(3, 7, -signal.SIGSEGV) == "DynMo: rank 3 (pid 7) was killed by SIGSEGV."
    assert death_line(1, None, -99) == "DynMo: rank 1 was killed by signal 99."
    assert death_line(2, 5, 1) == "DynMo: rank 2 (pid 5) exited with code 1; its error is in its log above."


def test_the_child_watch_names_a_killed_child_once_and_not_a_finished_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done.wait()
    # main_pid is never signalled here: only report_deaths runs (the thread is not started).
    watch = ChildWatch(main_pid=os.getpid(), child_processes=[done, killed])
    with caplog.at_level(logging.ERROR, logger="lightning_dynmo.strategy.child_watch"):
        assert watch.report_deaths() is False  # rank 2 still runs, rank 1 ended well
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert watch.report_deaths() is True
        assert watch.report_deaths() is True  # at exit, once more: nothing new
    assert [r.getMessage() for r in caplog.records] == [
        f"DynMo: rank 2 (pid {killed.pid}) was killed by SIGKILL (out of memory?)."
    ]


def test_the_app_launcher_names_a_killed_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def launch(config: object, entrypoint: str) -> object:
        def run(*args: str) -> None:
            failure = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file=str(tmp_path / "none"))
            raise ChildFailedError("lightning_dynmo.train", {1: failure})

        return run

    monkeypatch.setattr(app_launch, "elastic_launch", launch)
    with (
        caplog.at_level(logging.ERROR, logger="lightning_dynmo.app.launch"),
        pytest.raises(app_launch.LaunchFailed, match=r"rank 1 \(exit code -9\) of the 2 ranks failed"),
    ):
        app_launch.start_local_ranks(2, [], run_dir=str(tmp_path))
    assert [r.getMessage() for r in caplog.records] == [
        "DynMo: rank 1 (pid 4242) was killed by SIGKILL (out of memory?)."
    ]
