"""The replay's CPU accounting: what the ranks' own work costs while their emulated costs sleep."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist

from benchmarks._lib.common import CpuOfEveryRank, cores_busy


def test_cores_busy_sums_the_ranks_mean_cpu_over_the_mean_step() -> None:
    # Two ranks, three steps of 1 s; the first step (skipped) is shape inference.
    cpu = [[0.9, 0.5, 0.5], [0.7, 0.25, 0.75]]
    assert cores_busy(cpu, [9.0, 1.0, 1.0], skip=1) == pytest.approx(0.5 + 0.5)
    assert cores_busy(cpu, [9.0, 2.0, 2.0], skip=1) == pytest.approx(0.5)
    assert cores_busy(cpu, [1.0, 1.0, 1.0], skip=0) != pytest.approx(1.0)  # the skipped step counts otherwise
    with pytest.raises(ValueError, match="cores_busy needs timed steps"):
        cores_busy(cpu, [], skip=1)
    with pytest.raises(ValueError, match="cores_busy needs timed steps"):
        cores_busy(cpu, [1.0, 1.0, 1.0, 1.0], skip=3)


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_rank_that_spins_is_counted_and_one_that_sleeps_is_not(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        meter = CpuOfEveryRank()
        for work in (lambda: _spin(0.2), lambda: time.sleep(0.2)):
            meter.on_train_batch_start()
            work()
            meter.on_train_batch_end()
        meter.on_train_end(None, None)  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()
    ((spun, slept),) = meter.cpu_s
    assert spun >= 0.2
    assert slept < 0.05  # negative control: a sleep costs no CPU
    assert cores_busy(meter.cpu_s, [0.2, 0.2], skip=1) < 0.25
