"""ShardedCheckpointModule: a LightningModule that ``load_from_checkpoint`` also builds from a directory.

``DynMoStrategy`` saves sharded checkpoints by default: a directory (``epoch=0-step=4.ckpt/``) in which
each rank wrote its own units (:mod:`lightning_dynmo.pipeline.checkpoint.sharded`). Lightning's
``load_from_checkpoint`` opens its path as one file, which fails on a directory before any hook of the
module runs, so the directory is read here first (every item verified, gathered in memory as
:func:`~lightning_dynmo.pipeline.export_full_checkpoint` would write it) and handed to Lightning. A file
(an exported one, or one saved with ``DynMoStrategy(save_distributed_checkpoint=False)``) goes to
Lightning unchanged.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import IO, Any, Self

import lightning.pytorch as pl
import torch

from lightning_dynmo.pipeline.checkpoint.sharded import is_sharded_checkpoint, read_full_checkpoint

__all__ = ["ShardedCheckpointModule"]


class ShardedCheckpointModule(pl.LightningModule):
    """A LightningModule that ``load_from_checkpoint`` also builds from a sharded checkpoint directory.

    :class:`~lightning_dynmo.models.GPT` and :class:`~lightning_dynmo.models.huggingface.HuggingFaceCausalLM`
    derive from it; derive your own pipelined model from it for the same.
    """

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path | IO[Any],
        map_location: Any = None,
        hparams_file: str | Path | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Self:
        """Lightning's ``load_from_checkpoint``, from a file or a sharded checkpoint directory.

        Raises:
            ValueError: ``checkpoint_path`` is a directory that is not a sharded checkpoint.
            CheckpointCorruptError: a part of the directory is damaged or its save did not finish.
        """
        if isinstance(checkpoint_path, str | Path) and Path(checkpoint_path).is_dir():
            who = f"{cls.__name__}.load_from_checkpoint"
            checkpoint_path = _gathered(Path(checkpoint_path), who, weights_only)
        loaded: Self = super().load_from_checkpoint(
            checkpoint_path, map_location, hparams_file, strict, weights_only, **kwargs
        )
        return loaded


def _gathered(directory: Path, who: str, weights_only: bool | None) -> IO[bytes]:
    if not is_sharded_checkpoint(directory):
        raise ValueError(
            f"{who}: {str(directory)!r} is a directory but not a sharded checkpoint (no .metadata or "
            "checksum manifest); pass the directory DynMoStrategy saved (e.g. epoch=0-step=4.ckpt/), or a "
            "file written by lightning_dynmo.pipeline.export_full_checkpoint."
        )
    buffer = io.BytesIO()
    # Lightning reads the buffer as it reads a file.
    torch.save(read_full_checkpoint(directory, who=who, weights_only=weights_only), buffer)
    buffer.seek(0)
    return buffer
