"""What DynMoCallback tells the user: metrics through Lightning's loggers and one line per rebalance."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.demos import DemoGPT
from tests.distributed.callback.test_callback_rebalance import RUN, SLEEP_MS, PruneFirstHalf
from tests.distributed.fitting import make_strategy
from tests.distributed.harness import run_distributed
from tests.distributed.test_throughput import MemoryLogger

pytestmark = pytest.mark.distributed


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fit_logged(rank: int, world_size: int, log_every: int) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    lines = _Lines()
    logging.getLogger("lightning_dynmo.callback.dynmo_callback").addHandler(lines)
    logging.getLogger("lightning_dynmo.callback.dynmo_callback").setLevel(logging.INFO)
    logger = MemoryLogger()
    trainer = pl.Trainer(
        devices=world_size,
        strategy=make_strategy(RUN),
        use_distributed_sampler=False,
        callbacks=[PruneFirstHalf(), DynMoCallback(profiling=ProfilingConfig(steps=2))],
        **{**RUN.trainer_kwargs(), "logger": logger, "log_every_n_steps": log_every},
    )
    model = DemoGPT(num_layers=RUN.num_layers, lr_gamma=RUN.lr_gamma, sleep_ms=[SLEEP_MS] * RUN.num_layers)
    trainer.fit(model, RUN.datamodule())
    return {"metrics": logger.metrics, "lines": lines.lines}


def test_metrics_reach_the_loggers_and_each_rebalance_is_one_readable_line(tmp_path: Any) -> None:
    rank0, rank1 = run_distributed(_fit_logged, 2, tmp_path, timeout_s=150, args=(1,))
    keys = set().union(*rank0["metrics"])
    per_step = {"dynmo/imbalance", "dynmo/bubble_ratio", "dynmo/step_time_s", "dynmo/imbalance_avg"}
    per_step |= {"dynmo/stage0/busy_s", "dynmo/stage1/busy_s", "dynmo/active_workers"}
    decision = {"dynmo/predicted_gain", "dynmo/profiling_s", "dynmo/decision_s", "dynmo/migration_s"}
    decision |= {"dynmo/overhead_s", "dynmo/simulated_bubble_ratio", "dynmo/stage0/num_layers"}
    assert per_step | decision | {"dynmo/measured_gain"} <= keys, sorted(keys)
    steps_with_imbalance = [m for m in rank0["metrics"] if "dynmo/imbalance" in m]
    assert len(steps_with_imbalance) == RUN.steps  # log_every_n_steps=1: every step
    assert all(m["dynmo/active_workers"] == 2.0 for m in steps_with_imbalance)
    # Before the rebalance the pruned half makes the stages unequal; the imbalance is measured, not zero.
    assert max(m["dynmo/imbalance"] for m in steps_with_imbalance) > 0.3
    # One line at the decision (old -> new, predicted gain), one when the gain has been measured; rank 0 only.
    decided, measured = [line for line in rank0["lines"] if line.startswith("DynMo rebalance at step")]
    assert "0-3|4-7 -> 0-5|6-7" in decided and "predicted step" in decided and "migration" in decided
    assert re.search(r"\(\+[\d.]+%, [\d.e+-]+ ms per action\)", decided), decided
    assert "0-3|4-7 -> 0-5|6-7" in measured and "measured step time" in measured and "predicted" in measured
    assert not any(line.startswith("DynMo rebalance") for line in rank1["lines"])


def test_per_step_metrics_follow_log_every_n_steps(tmp_path: Any) -> None:
    rank0, _ = run_distributed(_fit_logged, 2, tmp_path, timeout_s=150, args=(4,))
    logged = [m for m in rank0["metrics"] if "dynmo/imbalance" in m]
    assert len(logged) == RUN.steps // 4  # handed to Lightning only where its loggers write
