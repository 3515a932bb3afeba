"""Crash-safe checkpoints: a job SIGKILLed at any point of a save keeps its last good checkpoint.

A 2-rank job trains two epochs with a ``ModelCheckpoint`` that rewrites ``last.ckpt`` at every epoch's
end: the save at the end of epoch 1 completes, and the save at the end of epoch 2 is killed (SIGKILL of
one rank, of all ranks, or of the coordinator) at one point of the save: before any item is written,
after the items, before the manifest, between the two renames of the rename-aside swap. A fresh 2-rank
job then resumes from ``last.ckpt`` and trains to the end of epoch 3: its losses and final parameters
must equal the single-process uninterrupted run's from the checkpoint's step on (float64, 1e-9), and
nothing the killed save left behind remains.

Negative control: the order DynMo used before (delete the old checkpoint, then write the new one in its
place) loses the checkpoint when killed at the same point.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dynmo.pipeline.checkpoint import atomic, sharded
from lightning_dynmo.pipeline.checkpoint.checksums import MANIFEST_FILENAME
from lightning_dynmo.pipeline.checkpoint.sharded import (
    CheckpointSaveError,
    export_full_checkpoint,
    save_sharded,
)
from lightning_dynmo.strategy import DynMoStrategy, checkpointing
from tests.distributed.fitting import TOL, LossRecorder, make_strategy, max_param_diff, reference
from tests.distributed.harness import run_distributed
from tests.distributed.test_checkpoint import EpochRun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUN = EpochRun(num_layers=4, placement="0-1|2-3", steps=2, epochs=2)
RESUMED_EPOCHS = 3
_armed = False


class ArmAtEpoch(pl.Callback):
    """Arms the kill from the second epoch on: the first save (epoch 1's end) completes."""

    @staticmethod
    def on_train_epoch_start(trainer: pl.Trainer, pl_module: Any) -> None:
        global _armed
        _armed = trainer.current_epoch >= 1


def _every_epoch(dirpath: Path) -> ModelCheckpoint:
    """``last.ckpt`` rewritten at the end of every epoch (one checkpoint, replaced by each save)."""
    return ModelCheckpoint(dirpath=dirpath, filename="last", enable_version_counter=False)


def _die_here(rank: int, ranks: tuple[int, ...]) -> None:
    if _armed and rank in ranks:
        os.kill(os.getpid(), signal.SIGKILL)


def _install_kill(point: str, rank: int, ranks: tuple[int, ...], old_order: bool) -> None:
    """Patch this forked rank so the armed save dies at ``point`` on ``ranks``."""
    if point == "before_items":
        write = sharded._RecordingWriter.write_data

        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            _die_here(rank, ranks)
            return write(self, plan, planner)

        sharded._RecordingWriter.write_data = write_data  # type: ignore[method-assign]
    elif point == "after_items":
        checksum = sharded._checksum_written

        def checksum_written(path: Path, results: Any) -> Any:
            out = checksum(path, results)
            _die_here(rank, ranks)
            return out

        sharded._checksum_written = checksum_written
    elif point == "before_manifest":
        manifest = sharded.write_manifest

        def write_manifest(*args: Any, **kwargs: Any) -> None:
            _die_here(rank, ranks)
            manifest(*args, **kwargs)

        sharded.write_manifest = write_manifest
    elif point == "between_renames":
        atomic._exchange = lambda a, b: False  # the rename-aside path, which has a "between"
        rename, renames = atomic._rename, []

        def rename_then_die(src: Path, dst: Path) -> None:
            rename(src, dst)
            renames.append(dst)
            if _armed and len(renames) == 1:
                _die_here(rank, ranks)

        atomic._rename = rename_then_die
    if old_order:
        # What save_sharded did before: delete the checkpoint, then write the new one in its place.
        sharded.staging_path = lambda target, token: Path(target)
        sharded.repair = lambda target: shutil.rmtree(target, ignore_errors=True)
        sharded.swap_in = lambda staged, target: None


def crash_worker(
    rank: int, world_size: int, dirpath: Path, point: str, ranks: tuple[int, ...], old_order: bool
) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    _install_kill(point, rank, ranks, old_order)
    trainer = pl.Trainer(
        devices=world_size,
        use_distributed_sampler=False,
        strategy=make_strategy(RUN),
        callbacks=[ArmAtEpoch(), _every_epoch(dirpath)],
        **{**RUN.trainer_kwargs(), "enable_checkpointing": True},
    )
    trainer.fit(RUN.model(), RUN.datamodule())
    raise AssertionError(f"rank {rank}: the save at epoch 2's end should have been killed")


def resume_worker(rank: int, world_size: int, dirpath: Path, ckpt_path: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    recorder = LossRecorder()
    run = replace(RUN, epochs=RESUMED_EPOCHS)
    trainer = pl.Trainer(
        devices=world_size,
        use_distributed_sampler=False,
        strategy=make_strategy(run),
        callbacks=[recorder, _every_epoch(dirpath)],
        **{**run.trainer_kwargs(), "enable_checkpointing": True},
    )
    model = run.model()
    trainer.fit(model, run.datamodule(), ckpt_path=ckpt_path)
    assert isinstance(trainer.strategy, DynMoStrategy)
    return {
        "losses": recorder.losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _crash(tmp_path: Path, point: str, ranks: tuple[int, ...], old_order: bool = False) -> Path:
    dirpath = tmp_path / "checkpoints"
    with pytest.raises(AssertionError, match=r"died|exit code|killed|-9"):
        run_distributed(crash_worker, 2, tmp_path, timeout_s=120, args=(dirpath, point, ranks, old_order))
    return dirpath


def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST_FILENAME).is_file()


CASES = {
    # point: (ranks killed, checkpoint step a resumed job starts from)
    "one rank before the first item": ("before_items", (1,), RUN.steps),
    "one rank after its items": ("after_items", (1,), RUN.steps),
    "all ranks after their items": ("after_items", (0, 1), RUN.steps),
    "coordinator before the manifest": ("before_manifest", (0,), RUN.steps),
    # The new checkpoint was complete before the old one was set aside: repair promotes it.
    "coordinator between the renames": ("between_renames", (0,), 2 * RUN.steps),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_save_killed_anywhere_leaves_a_checkpoint_that_resumes_exactly(tmp_path: Path, case: str) -> None:
    point, ranks, start_step = CASES[case]
    dirpath = _crash(tmp_path, point, ranks)
    last = dirpath / "last.ckpt"
    if point != "between_renames":
        assert _is_complete(last), f"last.ckpt must survive a save killed {case}"

    resumed = run_distributed(resume_worker, 2, tmp_path, timeout_s=120, args=(dirpath, str(last)))

    ref = reference(replace(RUN, epochs=RESUMED_EPOCHS))
    expected = ref["losses"][start_step:]
    for rank, res in enumerate(resumed):
        assert len(res["losses"]) == len(expected), f"rank {rank} resumed from the wrong step"
        diff = max(abs(a - b) for a, b in zip(res["losses"], expected, strict=True))
        assert diff < TOL, f"rank {rank}: resumed losses differ from the uninterrupted run by {diff:.3e}"
    worst = max_param_diff(resumed, ref)
    assert worst < TOL, f"final parameters differ from the uninterrupted run by {worst:.3e}"
    # The resumed job's own saves cleaned up what the killed save left behind.
    assert sorted(p.name for p in dirpath.iterdir()) == ["last.ckpt"]
    assert _is_complete(last)


def test_the_old_delete_then_write_order_loses_the_checkpoint(tmp_path: Path) -> None:
    # Negative control: the same kill, with the save order DynMo had before, leaves no usable checkpoint.
    dirpath = _crash(tmp_path, "after_items", (0, 1), old_order=True)
    last = dirpath / "last.ckpt"
    assert last.is_dir() and not _is_complete(last)


# -- a save that fails (disk full, read-only target): every rank stops with the cause, nothing is lost --


def _fail_on(rank: int, where: str, fail_rank: int, cause: OSError) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise cause

    if rank != fail_rank:
        return
    if where == "items":
        sharded._RecordingWriter.write_data = fail  # type: ignore[method-assign]
    elif where == "directory":
        sharded._prepare = fail
    elif where == "manifest":
        sharded.write_manifest = fail


def failing_save_worker(
    rank: int, world_size: int, path: Path, where: str, fail_rank: int, cause: OSError
) -> str:
    save_sharded(
        path, {"state_dict": {f"layers.{rank}.w": torch.zeros(3)}, "epoch": 1}, group=None, coordinator=0
    )
    _fail_on(rank, where, fail_rank, cause)
    try:
        save_sharded(
            path, {"state_dict": {f"layers.{rank}.w": torch.ones(3)}, "epoch": 2}, group=None, coordinator=0
        )
    except CheckpointSaveError as err:
        return str(err)
    raise AssertionError(f"rank {rank}: the failing save did not raise")


FAILURES = {
    "disk full while one rank writes its items": (
        "items",
        1,
        OSError(errno.ENOSPC, "No space left on device"),
    ),
    "read-only target": ("directory", 0, OSError(errno.EROFS, "Read-only file system")),
    "disk full while the coordinator writes the manifest": (
        "manifest",
        0,
        OSError(errno.ENOSPC, "No space left on device"),
    ),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_failed_save_names_the_path_and_cause_on_every_rank_and_keeps_the_old_checkpoint(
    tmp_path: Path, case: str
) -> None:
    where, fail_rank, cause = FAILURES[case]
    path = tmp_path / "last.ckpt"
    messages = run_distributed(
        failing_save_worker, 2, tmp_path, timeout_s=60, args=(path, where, fail_rank, cause)
    )
    for message in messages:
        assert re.search(
            rf"saving the checkpoint '.*last\.ckpt' failed .*rank {fail_rank}: OSError: .*{cause.strerror}",
            message,
        )
        assert "previous checkpoint at that path, if any, is intact" in message
    old = torch.load(export_full_checkpoint(path, tmp_path / "old.ckpt"), weights_only=True)
    assert old["epoch"] == 1 and torch.equal(old["state_dict"]["layers.1.w"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir() if "store" not in p.name) == ["last.ckpt", "old.ckpt"]


# -- ckpt_path="last": an incomplete last.ckpt is skipped for the newest complete checkpoint beside it --


def last_resume_worker(rank: int, world_size: int, dirpath: Path, trust_lightning: bool) -> dict[str, Any]:
    if trust_lightning:  # negative control (this forked rank only): read what Lightning resolved "last" to
        checkpointing.resume_path = Path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = resume_worker(rank, world_size, dirpath, "last")
    return {**result, "warnings": [str(w.message) for w in caught if "DynMo" in str(w.message)]}


def _last_incomplete_beside_an_older_complete_one(tmp_path: Path) -> Path:
    """A killed save's complete ``last.ckpt`` copied as ``epoch=0.ckpt``; then ``last.ckpt`` loses its
    manifest, as if an older release's delete-then-write save had been killed."""
    dirpath = _crash(tmp_path, "after_items", (1,))
    shutil.copytree(dirpath / "last.ckpt", dirpath / "epoch=0.ckpt")
    (dirpath / "last.ckpt" / MANIFEST_FILENAME).unlink()
    return dirpath


def test_ckpt_path_last_skips_an_incomplete_last_checkpoint_with_a_warning_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    dirpath = _last_incomplete_beside_an_older_complete_one(tmp_path)
    resumed = run_distributed(last_resume_worker, 2, tmp_path, timeout_s=120, args=(dirpath, False))

    (warned,) = resumed[0]["warnings"]  # the first active rank chooses, and says so
    assert re.search(
        r"skipping checkpoint '.*last.ckpt': it is incomplete .* resuming from '.*epoch=0.ckpt'", warned
    )
    expected = reference(replace(RUN, epochs=RESUMED_EPOCHS))["losses"][RUN.steps :]
    for rank, res in enumerate(resumed):
        diff = max(abs(a - b) for a, b in zip(res["losses"], expected, strict=True))
        assert len(res["losses"]) == len(expected) and diff < TOL, f"rank {rank} did not resume exactly"


def test_without_the_choice_ckpt_path_last_fails_on_the_incomplete_checkpoint(tmp_path: Path) -> None:
    # Negative control: reading what Lightning resolved "last" to fails on the missing manifest.
    dirpath = _last_incomplete_beside_an_older_complete_one(tmp_path)
    with pytest.raises(AssertionError, match=rf"last.ckpt' has no {re.escape(MANIFEST_FILENAME)}"):
        run_distributed(last_resume_worker, 2, tmp_path, timeout_s=120, args=(dirpath, True))
