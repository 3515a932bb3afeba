"""A lost rank stops the others within the process-group timeout, with an error naming the lost peer.

Rank 1 of a 2-stage pipeline dies (``os._exit(1)``) or stalls (sleeps far past the timeout) at the start
of a batch; rank 0 is then inside its schedule step, waiting for rank 1's activations' gradients. The
harness reports every rank's story in one AssertionError: rank 0's traceback must carry DynMo's
``RuntimeError`` naming its own stage, the peer (stage 1 on global rank 1) and the transport error, and it
must come well within ``timeout + 30 s``.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from tests.distributed.fitting import Run, make_strategy
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

_FAIL_AT_BATCH = 3


class Misbehave(pl.Callback):
    """On rank 1, at batch ``_FAIL_AT_BATCH``: die at once, or stall for ``stall_s`` seconds."""

    def __init__(self, mode: str, stall_s: float) -> None:
        self.mode = mode
        self.stall_s = stall_s

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != 1 or batch_idx != _FAIL_AT_BATCH:
            return
        if self.mode == "die":
            os._exit(1)
        time.sleep(self.stall_s)


def faulty_worker(rank: int, world_size: int, mode: str, timeout_s: float) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    run = Run(steps=8)
    strategy = make_strategy(run, timeout=timedelta(seconds=timeout_s))
    trainer = pl.Trainer(
        devices=world_size, strategy=strategy, callbacks=[Misbehave(mode, stall_s=60)], **run.trainer_kwargs()
    )
    trainer.fit(run.model(), run.datamodule())


@pytest.mark.parametrize(
    ("mode", "transport_error"),
    [("die", r"Connection (closed|reset) by peer"), ("stall", r"Timed out waiting 4000ms")],
)
def test_survivor_fails_within_the_timeout_naming_the_lost_peer(
    mode: str, transport_error: str, tmp_path: Path
) -> None:
    timeout_s = 4.0
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(faulty_worker, 2, tmp_path, timeout_s=90, args=(mode, timeout_s))
    elapsed = time.monotonic() - start
    report = str(info.value)
    rank0 = report.split("----- rank 0 -----")[1].split("----- rank 1 -----")[0]
    assert "RuntimeError: DynMo: rank 0 (stage 0) lost contact with a peer during a schedule step" in rank0
    assert "It exchanges data with: stage 1 on global rank 1." in rank0
    assert re.search(transport_error, rank0), rank0[-2000:]
    assert elapsed < timeout_s + 30, f"the survivor took {elapsed:.1f} s to fail"
