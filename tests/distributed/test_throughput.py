"""PipelineThroughputMonitor counts every sample once; Lightning's stock monitor over-counts (control)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

from lightning_dynmo.throughput import PipelineThroughputMonitor
from tests.distributed.fitting import Run, make_strategy
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed


class MemoryLogger(Logger):
    """Keeps every logged metric in memory (rank 0 only, like every Lightning logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))


def _fit_with_monitor(rank: int, world_size: int, run: Run, monitor_cls: type) -> dict[str, float] | None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    logger = MemoryLogger()
    monitor = monitor_cls(batch_size_fn=lambda batch: batch.shape[0], window_size=3)
    kwargs = {**run.trainer_kwargs(), "logger": logger, "log_every_n_steps": 1}
    trainer = pl.Trainer(
        devices=world_size,
        strategy=make_strategy(run),
        use_distributed_sampler=run.use_sampler,
        callbacks=[monitor],
        **kwargs,
    )
    trainer.fit(run.model(), run.datamodule())
    if rank != 0:
        return None
    return [m for m in logger.metrics if "train/samples_per_sec" in m or "train/samples" in m][-1]


@pytest.mark.parametrize(
    ("run", "replicas"),
    [(Run(world_size=2, steps=5), 1), (Run(world_size=4, pipeline_size=2, steps=5, use_sampler=True), 2)],
    ids=["pipeline-2", "data-2x-pipeline-2"],
)
def test_each_sample_is_counted_once(run: Run, replicas: int, tmp_path: Any) -> None:
    ours = run_distributed(
        _fit_with_monitor,
        run.world_size,
        tmp_path,
        timeout_s=120,
        args=(run, PipelineThroughputMonitor),
    )[0]
    stock = run_distributed(
        _fit_with_monitor, run.world_size, tmp_path, timeout_s=120, args=(run, ThroughputMonitor)
    )[0]
    assert ours is not None and stock is not None
    # Rank 0 sees its replica's batches: steps x batch_size samples, each counted once.
    assert ours["train/samples"] == run.steps * run.batch_size
    device_rate = ours["train/device/samples_per_sec"]
    if replicas == 1:
        # One replica: the replica's rate *is* the global rate, no global metric is added.
        assert "train/samples_per_sec" not in ours
    else:
        assert ours["train/samples_per_sec"] == pytest.approx(device_rate * replicas)
    # Control: Lightning's monitor scales by every rank, i.e. pipeline_size times too much.
    pipeline_size = run.world_size // replicas
    assert stock["train/samples_per_sec"] == pytest.approx(
        stock["train/device/samples_per_sec"] * run.world_size
    )
    assert run.world_size == replicas * pipeline_size and pipeline_size > 1
