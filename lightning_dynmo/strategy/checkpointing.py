"""What a rank of :class:`~lightning_dynmo.DynMoStrategy` contributes to a Lightning checkpoint, and repairs.

:class:`CheckpointParts` gathers the model (a one-file save, on global rank 0) or keeps this rank's
units (a sharded save), and writes them; :func:`choose_resume_path` repairs what a killed save left and
skips an incomplete ``last*.ckpt``; :func:`load` reads a checkpoint and sets one saved between epochs to
resume at the next epoch's start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.plugins import TorchCheckpointIO
from torch import nn

from lightning_dynmo.pipeline import (
    CHECKPOINT_KEY,
    read_checkpoint,
    resume_path,
    save_sharded,
    staged_file_save,
    state_to_save,
)
from lightning_dynmo.strategy.collectives import Guard
from lightning_dynmo.strategy.loop_state import start_next_epoch_afresh
from lightning_dynmo.strategy.state import RankState

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


class CheckpointParts:
    """What this rank contributes to a Lightning checkpoint and reads back of one.

    Lightning asks for the model's state first and each optimizer's state after it; both come from one
    gathering (:func:`~lightning_dynmo.pipeline.state_to_save`), so the optimizer states are held here
    between the two calls and dropped once the checkpoint is written.

    Args:
        sharded: ``DynMoStrategy(save_distributed_checkpoint=...)``: each rank writes its units (``True``), or
            global rank 0 writes one gathered file.
    """

    def __init__(self, sharded: bool) -> None:
        self.sharded = sharded
        self._optimizer_states: list[Any] | None = None

    def model_state(
        self,
        ranks: RankState,
        guard: Guard,
        units: Callable[[], Mapping[str, nn.Module]],
        optimizers: Sequence[Any],
        global_rank: int,
    ) -> dict[str, Any]:
        """This rank's ``units()`` (sharded), or the model gathered on global rank 0 (``{}`` elsewhere and
        on a released rank)."""
        self._optimizer_states = None
        if ranks.released:
            return {}
        grid = ranks.require_grid()
        dst = grid.pipeline_ranks(0)[0] if grid.data_parallel_rank(global_rank) == 0 else None
        with guard("checkpoint saving (gathering the model and optimizer state)"):
            model, self._optimizer_states = state_to_save(
                units(), list(optimizers), self.sharded, dst, ranks.pipeline_group
            )
        return model

    def optimizer_state(self, optimizer: Any, optimizers: Sequence[Any]) -> dict[str, Any]:
        """This optimizer's state keyed by parameter name, gathered by :meth:`model_state`."""
        raw = getattr(optimizer, "_optimizer", optimizer)
        if self._optimizer_states is None:
            return {}
        index = next(k for k, opt in enumerate(optimizers) if opt is raw)
        return self._optimizer_states[index]  # type: ignore[no-any-return]

    def save(
        self,
        ranks: RankState,
        guard: Guard,
        checkpoint: dict[str, Any],
        filepath: Any,
        save_file: Callable[[dict[str, Any], Any], None],
        layout: Callable[[], dict[str, Any]],
        is_global_zero: bool,
    ) -> None:
        """Each active rank writes its units (sharded), or global rank 0 one gathered file with ``save_file``.

        ``layout()``: the pipeline's layout record (:func:`~lightning_dynmo.pipeline.layout_of`), which
        global rank 0 puts into the checkpoint.
        """
        if ranks.released:
            return
        if is_global_zero:
            checkpoint[CHECKPOINT_KEY] = layout()
        if self.sharded:
            with guard("checkpoint saving (each rank writing its units)"):
                save_sharded(
                    filepath, checkpoint, group=ranks.active_group, coordinator=ranks.active_ranks[0]
                )
        elif is_global_zero:
            with staged_file_save(filepath) as target:
                save_file(checkpoint, target)
        self._optimizer_states = None


def choose_resume_path(ranks: RankState, guard: Guard, global_rank: int, checkpoint_path: Any) -> Any:
    """The checkpoint to read for ``checkpoint_path`` (:func:`~lightning_dynmo.pipeline.resume_path`), chosen
    on the first active rank (it may repair what a killed save left) and shared with the others; a path
    that is not local (a URL) passes unchanged."""
    if not isinstance(checkpoint_path, str | Path):
        return checkpoint_path
    box: list[Any] = [None]
    if global_rank == ranks.active_ranks[0]:
        try:
            box[0] = resume_path(checkpoint_path)
        except FileNotFoundError as err:
            box[0] = err
    if dist.is_initialized():
        with guard("choosing the checkpoint to resume from"):
            dist.broadcast_object_list(box, src=ranks.active_ranks[0], group=ranks.active_group)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def load(
    ranks: RankState,
    guard: Guard,
    units: Mapping[str, nn.Module],
    tie_aliases: Mapping[str, str],
    with_optimizer: bool,
    checkpoint_path: Any,
    weights_only: bool | None,
    read_file: Callable[[Any, bool | None], dict[str, Any]],
) -> dict[str, Any]:
    """A verified checkpoint (this rank's share of a directory), or what ``read_file`` reads of another.

    One saved between epochs is set to resume at the next epoch's start (:mod:`.loop_state`).
    """
    with guard("checkpoint loading"):
        loaded = read_checkpoint(
            checkpoint_path, units, with_optimizer, tie_aliases, ranks.active_group, weights_only
        )
    checkpoint = loaded if loaded is not None else read_file(checkpoint_path, weights_only)
    start_next_epoch_afresh(checkpoint)  # e.g. ModelCheckpoint's last.ckpt of on_train_end
    return checkpoint
