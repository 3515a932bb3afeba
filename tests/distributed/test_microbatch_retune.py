"""Re-tuning the micro-batch count with a re-pack keeps training exactly the single-process run.

Two ranks train the 2-stage pipeline with 4 micro-batches of a batch of 8; at batch 3 the pipeline is
re-packed onto rank 0 with another count (``apply_placement(..., num_microbatches=m)``), rank 1 leaves.
Losses and parameters must equal the single-process reference (float64, 1e-9). Negative control: a
strategy that accepts a count that does not divide the batch (3 micro-batches of 3, 3 and 2 samples:
the mean of their means is not the batch mean) must be caught by the same comparison. Bad input: the
real strategy refuses that count on every rank before anything moves (the run then equals the reference).
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_dynmo.pipeline.step.microbatches import MicrobatchCount
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import (
    TOL,
    LossRecorder,
    Run,
    local_state,
    make_strategy,
    max_param_diff,
    reference,
)
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

RUN = Run(num_layers=4, placement="0-1|2-3", num_microbatches=4, batch_size=8, steps=7)
REPACK_AT = 3


class RepackWithCount(pl.Callback):
    """At batch ``REPACK_AT``, re-pack onto one stage with ``count`` micro-batches.

    With ``try_bad`` it first asks for 3 micro-batches (which do not divide the batch of 8) and records
    the error every rank must raise before anything moves; training then goes on as if it was not asked.
    """

    def __init__(self, count: int, try_bad: bool = False) -> None:
        self.count = count
        self.try_bad = try_bad
        self.counts: list[int] = []
        self.bad_error: str | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == REPACK_AT:
            if self.try_bad:
                with pytest.raises(
                    ValueError, match=r"num_microbatches=3 does not divide the batch of 8"
                ) as err:
                    trainer.strategy.apply_placement("0-3", num_microbatches=3)
                self.bad_error = str(err.value)
            trainer.strategy.apply_placement("0-3", num_microbatches=self.count)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counts.append(trainer.strategy.num_microbatches)


class _UncheckedCount(MicrobatchCount):
    def check_retune(self, *args: Any) -> None:
        return None

    def for_batch(self, batch_size: int) -> int:
        return self.retuned or self.configured


class UnequalMicrobatchesStrategy(DynMoStrategy):
    """Negative control: re-tunes to any count, even one that cuts the batch into unequal micro-batches."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pipeline.microbatches = _UncheckedCount(self._pipeline.microbatches.configured)


def retune_worker(rank: int, world_size: int, count: int, negative: bool) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    recorder, repack = LossRecorder(), RepackWithCount(count, try_bad=not negative)
    extra = {"strategy_cls": UnequalMicrobatchesStrategy} if negative else {}
    strategy = make_strategy(RUN, **extra)
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        use_distributed_sampler=False,
        callbacks=[recorder, repack],
        **RUN.trainer_kwargs(),
    )
    model = RUN.model()
    trainer.fit(model, RUN.datamodule())
    return {
        "losses": recorder.losses,
        "state": local_state(model),
        "released": strategy.is_released,
        "counts": repack.counts,
        "bad_error": repack.bad_error,
    }


def _fit(tmp_path: Any, count: int, negative: bool = False) -> dict[str, Any]:
    results = run_distributed(retune_worker, 2, tmp_path, timeout_s=120, args=(count, negative))
    assert [r["released"] for r in results] == [False, True]
    if not negative:  # every rank refused the count that does not divide the batch, alike
        assert all(r["bad_error"] is not None for r in results)
    return results[0]


def _worst(kept: dict[str, Any]) -> float:
    ref = reference(RUN)
    assert len(kept["losses"]) == len(ref["losses"])
    loss_diff = max(abs(a - b) for a, b in zip(kept["losses"], ref["losses"], strict=True))
    return max(loss_diff, max_param_diff([kept], ref))


@pytest.mark.parametrize("count", [1, 8], ids=["fewer", "more"])
def test_a_repack_with_another_microbatch_count_equals_the_reference(tmp_path: Any, count: int) -> None:
    kept = _fit(tmp_path, count)
    assert kept["counts"] == [4] * REPACK_AT + [count] * (RUN.steps - REPACK_AT)
    worst = _worst(kept)
    assert worst < TOL, f"re-tuned to {count} micro-batches: differs from the reference by {worst:.3e}"


def test_negative_control_unequal_microbatches_are_caught(tmp_path: Any) -> None:
    kept = _fit(tmp_path, 3, negative=True)
    assert kept["counts"][-1] == 3
    assert _worst(kept) > 1e-6  # the comparison above can fail
