"""What a rank of :class:`~lightning_dynmo.DynMoStrategy` contributes to a Lightning checkpoint, and repairs.

:func:`module_state_dict` gathers the model (a one-file save, on global rank 0) or keeps this rank's units
(a sharded save); :func:`choose_resume_path` repairs what a killed save left and skips an incomplete
``last*.ckpt``; :func:`load` reads a checkpoint and sets one saved between epochs to resume at the next
epoch's start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.plugins import TorchCheckpointIO

from lightning_dynmo.pipeline import (
    CHECKPOINT_KEY,
    layout_of,
    read_checkpoint,
    resume_path,
    save_sharded,
    staged_file_save,
    state_to_save,
)
from lightning_dynmo.strategy.loop_state import start_next_epoch_afresh

if TYPE_CHECKING:
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

log = logging.getLogger(__name__)


# Sharded saves write through torch.distributed.checkpoint on every rank, never through Lightning's
# CheckpointIO (as in Lightning's ModelParallelStrategy and FSDPStrategy): what it would be given is refused.
_SHARDED_WRITES = (
    "sharded checkpoints do not use the CheckpointIO (each rank writes its own units with "
    "torch.distributed.checkpoint)"
)


def check_checkpoint_io(checkpoint_io: Any, sharded: bool) -> None:
    """Refuse a custom CheckpointIO plugin when checkpoints are sharded: it would be silently ignored.

    Raises:
        TypeError: naming the plugin and the alternatives.
    """
    if not sharded or checkpoint_io is None or type(checkpoint_io) is TorchCheckpointIO:
        return  # TorchCheckpointIO is what a sharded save's files amount to: nothing is lost
    raise TypeError(
        f"DynMoStrategy got the CheckpointIO plugin {type(checkpoint_io).__name__}, but {_SHARDED_WRITES}, "
        "so it would be silently ignored. Remove it from Trainer(plugins=...) / DynMoStrategy(checkpoint_io="
        "...), or save one gathered file through it with DynMoStrategy(save_distributed_checkpoint=False)."
    )


def check_storage_options(storage_options: Any, sharded: bool) -> None:
    """Refuse ``storage_options`` for a sharded save (Lightning passes them to the CheckpointIO only).

    Raises:
        TypeError: naming the value and the alternatives.
    """
    if sharded and storage_options is not None:
        raise TypeError(
            f"DynMoStrategy.save_checkpoint(..., storage_options={storage_options!r}) is not supported: "
            f"{_SHARDED_WRITES}. Leave storage_options out, or save one gathered file through the "
            "CheckpointIO with DynMoStrategy(save_distributed_checkpoint=False)."
        )


def module_state_dict(strategy: DynMoStrategy) -> dict[str, Any]:
    strategy._saved_optimizer_states = None
    if strategy._released:
        return {}
    dst = strategy._require_grid().pipeline_ranks(0)[0] if strategy.data_parallel_rank == 0 else None
    with strategy.guard("checkpoint saving (gathering the model and optimizer state)"):
        model, strategy._saved_optimizer_states = state_to_save(
            strategy._local_units(),
            list(strategy.optimizers),
            strategy._save_distributed_checkpoint,
            dst,
            strategy._pipeline_group,
        )
    return model


def choose_resume_path(strategy: DynMoStrategy, checkpoint_path: Any) -> Any:
    """The checkpoint to read for ``checkpoint_path`` (:func:`~lightning_dynmo.pipeline.resume_path`), chosen
    on the first active rank (it may repair what a killed save left) and shared with the others; a path
    that is not local (a URL) passes unchanged."""
    if not isinstance(checkpoint_path, str | Path):
        return checkpoint_path
    box: list[Any] = [None]
    if strategy.global_rank == strategy._active_ranks[0]:
        try:
            box[0] = resume_path(checkpoint_path)
        except FileNotFoundError as err:
            box[0] = err
    if dist.is_initialized():
        with strategy.guard("choosing the checkpoint to resume from"):
            dist.broadcast_object_list(box, src=strategy._active_ranks[0], group=strategy._active_group)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def optimizer_state(strategy: DynMoStrategy, optimizer: Any) -> dict[str, Any]:
    """This optimizer's state keyed by parameter name, gathered by :func:`module_state_dict`."""
    raw = getattr(optimizer, "_optimizer", optimizer)
    if strategy._saved_optimizer_states is None:
        return {}
    index = next(k for k, opt in enumerate(strategy.optimizers) if opt is raw)
    return strategy._saved_optimizer_states[index]  # type: ignore[no-any-return]


def save(
    strategy: DynMoStrategy,
    checkpoint: dict[str, Any],
    filepath: Any,
    save_file: Callable[[dict[str, Any], Any], None],
) -> None:
    """Each active rank writes its units (sharded), or global rank 0 one gathered file with ``save_file``."""
    if strategy._released:
        return
    if strategy.is_global_zero:
        checkpoint[CHECKPOINT_KEY] = layout_of(strategy)
    if strategy._save_distributed_checkpoint:
        with strategy.guard("checkpoint saving (each rank writing its units)"):
            save_sharded(
                filepath, checkpoint, group=strategy._active_group, coordinator=strategy._active_ranks[0]
            )
    elif strategy.is_global_zero:
        with staged_file_save(filepath) as target:
            save_file(checkpoint, target)
    strategy._saved_optimizer_states = None


def load(
    strategy: DynMoStrategy,
    checkpoint_path: Any,
    weights_only: bool | None,
    read_file: Callable[[Any, bool | None], dict[str, Any]],
) -> dict[str, Any]:
    """A verified checkpoint (this rank's share of a directory), or what ``read_file`` reads of another.

    One saved between epochs is set to resume at the next epoch's start (:mod:`.loop_state`).
    """
    with strategy.guard("checkpoint loading"):
        units, aliases = strategy._local_units(), strategy._ties.aliases
        loaded = read_checkpoint(
            checkpoint_path, units, bool(strategy.optimizers), aliases, strategy._active_group, weights_only
        )
    checkpoint = loaded if loaded is not None else read_file(checkpoint_path, weights_only)
    start_next_epoch_afresh(checkpoint)  # e.g. ModelCheckpoint's last.ckpt of on_train_end
    return checkpoint
