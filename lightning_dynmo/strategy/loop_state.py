"""Lightning's loop counters of a checkpoint saved between epochs, set to resume at the next epoch's start.

Lightning 2.6 resumes such a checkpoint with a truncated epoch. ``ModelCheckpoint(save_last=True)`` writes
``last.ckpt`` in ``on_train_end`` when nothing was saved at the last epoch's end (e.g. ``save_top_k=0``,
the application's default), and ``trainer.save_checkpoint`` after ``fit`` saves the same state: the fit
loop counts the epoch as completed, yet the epoch loop still holds that epoch's batch counters
(``current.ready`` = its batches, ``is_last_batch``). The resumed fit loop starts the next epoch with
them, so its data fetcher ends that epoch after one batch and the following epoch begins early: every
later batch differs from an uninterrupted run's. :func:`start_next_epoch_afresh` resets those per-epoch
counters as Lightning does when an epoch starts; the totals (which count steps and batches across
epochs) are kept.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

__all__ = ["start_next_epoch_afresh"]

#: The epoch loop's progress trackers that Lightning resets when an epoch starts (``reset_on_run``).
_PER_EPOCH = (
    "epoch_loop.batch_progress",
    "epoch_loop.scheduler_progress",
    "epoch_loop.automatic_optimization.optim_progress",
)


def start_next_epoch_afresh(checkpoint: MutableMapping[str, Any]) -> bool:
    """Reset the finished epoch's counters of a checkpoint saved between epochs; ``True`` if it was one.

    A checkpoint is "between epochs" when the fit loop's epoch progress is complete at every stage (ready,
    started, processed and completed agree: saved after ``on_train_epoch_end``) and its epoch loop had
    reached the epoch's last batch. Any other checkpoint (saved mid-epoch, or in an epoch-end hook, which
    Lightning resumes correctly) is left as it is.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(fit_loop, MutableMapping) or not _between_epochs(fit_loop):
        return False
    for key in _PER_EPOCH:
        if key in fit_loop:
            _zero_current(fit_loop[key])
    fit_loop["epoch_loop.batch_progress"]["is_last_batch"] = False
    return True


def _between_epochs(fit_loop: MutableMapping[str, Any]) -> bool:
    epochs = fit_loop.get("epoch_progress", {}).get("total", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    counts = {epochs.get(stage) for stage in ("ready", "started", "processed", "completed")}
    epoch_done = len(counts) == 1 and isinstance(epochs.get("completed"), int) and epochs["completed"] > 0
    return epoch_done and batches.get("is_last_batch") is True


def _zero_current(progress: MutableMapping[str, Any]) -> None:
    """Zero every ``current`` counter of a (nested) progress state dict: the epoch's, not the totals."""
    for name, value in progress.items():
        if name == "current" and isinstance(value, MutableMapping):
            for counter in value:
                value[counter] = 0
        elif isinstance(value, MutableMapping):
            _zero_current(value)
