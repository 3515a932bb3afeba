"""A ``last.ckpt`` written after its epoch ended (``on_train_end``) resumes at the next epoch's first batch.

Single process, Lightning's own loops: a run of 3 steps with epochs of 3 batches saves ``last.ckpt`` in
``ModelCheckpoint.on_train_end`` (``save_top_k=0``: nothing is saved at the epoch's end). Resumed as
Lightning 2.6 reads it, epoch 1 trains one batch and epoch 2 starts early (the negative control); after
:func:`~lightning_dynmo.strategy.loop_state.start_next_epoch_afresh`, which ``DynMoStrategy.load_checkpoint``
applies, the resumed steps see the uninterrupted run's epochs and batch indices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_dynmo.strategy.loop_state import start_next_epoch_afresh

BATCHES_PER_EPOCH = 3


class WhereEachStepRuns(pl.Callback):
    """``(epoch, batch_idx)`` of every training step, in order."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append((trainer.current_epoch, batch_idx))


def _trainer(callbacks: list[pl.Callback], **stop: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        limit_train_batches=BATCHES_PER_EPOCH,
        limit_val_batches=0,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **stop,
    )


def _fit(max_steps: int, ckpt_dir: Path, ckpt_path: Path | None = None) -> list[tuple[int, int]]:
    """Fit, saving ``ckpt_dir/last.ckpt`` in ``on_train_end``; where each step ran."""
    where = WhereEachStepRuns()
    last_only = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=0, save_last=True)
    _trainer([where, last_only], max_steps=max_steps).fit(BoringModel(), ckpt_path=ckpt_path)
    return where.steps


def test_a_checkpoint_saved_on_train_end_resumes_at_the_next_epochs_first_batch(tmp_path: Path) -> None:
    whole = _fit(6, tmp_path / "whole")
    assert whole[3:] == [(1, 0), (1, 1), (1, 2)]
    _fit(3, tmp_path / "first")
    last = tmp_path / "first" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    # negative control: as saved, epoch 1 ends after one batch (batch_idx 3 of 3) and epoch 2 starts early
    assert _fit(6, tmp_path / "as_saved", ckpt_path=last) == [(1, 3), (2, 0), (2, 1)]

    assert start_next_epoch_afresh(checkpoint)
    torch.save(checkpoint, tmp_path / "repaired.ckpt")
    assert _fit(6, tmp_path / "resumed", ckpt_path=tmp_path / "repaired.ckpt") == whole[3:]
    # the totals still count every batch and step of the first run
    batches = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert batches["total"]["completed"] == 3 and batches["current"]["ready"] == 0
    assert not start_next_epoch_afresh(checkpoint)  # repaired once: now a checkpoint at an epoch's start


def test_checkpoints_lightning_resumes_correctly_are_left_as_they_are(tmp_path: Path) -> None:
    _fit(2, tmp_path)  # stops mid-epoch: on_train_end saves the epoch's unfinished batch counters
    mid_epoch = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert not start_next_epoch_afresh(mid_epoch)
    epoch_end = ModelCheckpoint(dirpath=tmp_path / "epoch_end", save_top_k=-1)  # in on_train_epoch_end
    _trainer([epoch_end], max_epochs=1).fit(BoringModel())
    saved_in_epoch_end_hook = torch.load(next((tmp_path / "epoch_end").glob("*.ckpt")), weights_only=False)
    before = repr(saved_in_epoch_end_hook["loops"])
    assert not start_next_epoch_afresh(saved_in_epoch_end_hook)
    assert repr(saved_in_epoch_end_hook["loops"]) == before
    assert not start_next_epoch_afresh({"state_dict": {}})  # no loops (a weights-only export)
