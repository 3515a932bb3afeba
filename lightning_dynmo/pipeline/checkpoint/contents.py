"""Placement-independent Lightning checkpoints: the pieces of a checkpoint DynMo writes and reads.

A DynMo checkpoint is a directory in which each rank wrote its own units (the default, see
:mod:`~lightning_dynmo.pipeline.checkpoint.sharded`) or, with
``DynMoStrategy(save_distributed_checkpoint=False)``, one file gathered on global rank 0. Both carry
checksums, verified before anything is loaded (:mod:`.checksums`). Read from a directory, or exported to
a file, it is an ordinary Lightning checkpoint whose

* ``"state_dict"`` has exactly the keys of the single-process model's ``state_dict()``
  (``layers.7.fc1.weight``, ``tok_emb.weight``, ...), gathered from every stage, so plain
  ``model.load_state_dict(ckpt["state_dict"])`` works on one device;
* ``"optimizer_states"`` holds, per optimizer, the state keyed by those parameter names
  (:class:`~lightning_dynmo.pipeline.checkpoint.state.OptimizerFullState`) instead of torch's positional ids;
* ``"dynmo"`` records how the run was laid out when saving (:func:`layout_record`), for humans and
  tools; loading does not need it, because every rank loads the units it owns under its *own* placement.

Read in this order: :func:`layout_record`, :func:`state_to_save` (what a rank contributes to a save),
:func:`read_checkpoint` (a verified read, of this rank's share only for a directory),
:func:`full_state_from_checkpoint` (rebuild the :class:`~lightning_dynmo.pipeline.checkpoint.state.FullState`
that :func:`~lightning_dynmo.pipeline.load_local_state` takes), then the small helpers.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.pipeline.checkpoint.atomic import repair, staging_path, swap_in
from lightning_dynmo.pipeline.checkpoint.checksums import crc32_records, load_torch_file
from lightning_dynmo.pipeline.checkpoint.sharded import (
    is_sharded_checkpoint,
    load_sharded_part,
)
from lightning_dynmo.pipeline.checkpoint.state import (
    FULL_STATE_FORMAT,
    FullState,
    gather_full_state,
    local_full_state,
)
from lightning_dynmo.pipeline.model.units import unit_of_key

__all__ = [
    "CHECKPOINT_KEY",
    "LAYOUT_FORMAT",
    "full_state_from_checkpoint",
    "layout_of",
    "layout_record",
    "read_checkpoint",
    "staged_file_save",
    "state_to_save",
    "unit_of_key",
]

#: Key of the layout record in a checkpoint.
CHECKPOINT_KEY = "dynmo"
LAYOUT_FORMAT = "lightning_dynmo.layout/1"


def layout_record(
    placement: str, pipeline_size: int, data_parallel_size: int, schedule: str, active_ranks: tuple[int, ...]
) -> dict[str, Any]:
    """What a checkpoint stores about the layout it was saved from (plain types only)."""
    return {
        "format": LAYOUT_FORMAT,
        "placement": placement,
        "pipeline_size": pipeline_size,
        "data_parallel_size": data_parallel_size,
        "schedule": schedule,
        "active_ranks": list(active_ranks),
    }


class RunLayout(Protocol):
    """What :func:`layout_of` reads (``DynMoStrategy`` has these properties)."""

    @property
    def placement(self) -> Any: ...
    @property
    def pipeline_size(self) -> int: ...
    @property
    def data_parallel_size(self) -> int: ...
    @property
    def schedule_name(self) -> str: ...
    @property
    def active_ranks(self) -> tuple[int, ...]: ...


def layout_of(run: RunLayout) -> dict[str, Any]:
    """:func:`layout_record` of a running strategy."""
    return layout_record(
        str(run.placement), run.pipeline_size, run.data_parallel_size, run.schedule_name, run.active_ranks
    )


def state_to_save(
    units: Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    sharded: bool,
    gather_to: int | None,
    group: dist.ProcessGroup | None,
) -> tuple[dict[str, Any], list[Any] | None]:
    """This rank's contribution to a checkpoint: (model state, optimizer states), single-process keys.

    Sharded: the rank's own units, live tensors (the save writes them at once). Gathered: collective over
    ``group`` when ``gather_to`` is a global rank (the whole model there, ``({}, None)`` elsewhere);
    ``gather_to=None`` (a replica that does not take part) returns ``({}, None)`` without communicating.
    """
    if sharded:
        part = local_full_state(units, optimizers, copy=False)
        return part["model"], list(part["optimizer"])
    if gather_to is None:
        return {}, None
    full = gather_full_state(units, optimizers, dst=gather_to, group=group)
    return ({}, None) if full is None else (full["model"], list(full["optimizer"]))


def read_checkpoint(
    path: Any,
    units: Mapping[str, nn.Module],
    with_optimizers: bool,
    aliases: Mapping[str, str],
    group: dist.ProcessGroup | None,
    weights_only: bool | None,
) -> dict[str, Any] | None:
    """A checkpoint verified against its checksums: this rank's share of a directory (collective over
    ``group``; ``aliases`` as in :func:`~.sharded.load_sharded_part`), or a whole
    local file; ``None`` for anything else (e.g. a remote URL, left to Lightning).

    Raises:
        CheckpointCorruptError: naming the file and the damaged entry.
    """
    if is_sharded_checkpoint(path):
        return load_sharded_part(
            Path(path),
            units,
            with_optimizers=with_optimizers,
            aliases=aliases,
            group=group,
            weights_only=weights_only,
        )
    if isinstance(path, str | Path) and Path(path).is_file():
        loaded = load_torch_file(path, weights_only=weights_only)
        assert isinstance(loaded, dict)
        return loaded
    return None


@contextmanager
def staged_file_save(path: Any) -> Generator[Any, None, None]:
    """Around a gathered (one-file) save: yields where to write, and torch computes the records' CRC-32
    (what :func:`~.checksums.load_torch_file` verifies).

    For a local path the file is written to a staged sibling that replaces what is at ``path`` (an older
    file or checkpoint directory) only once it is complete (:mod:`.atomic`); a remote URL is written in
    place by Lightning's checkpoint IO.
    """
    with crc32_records():
        if not isinstance(path, str | Path) or "://" in str(path):
            yield path
            return
        target = Path(path)
        repair(target)
        staged = staging_path(target, uuid.uuid4().hex)
        try:
            yield staged
        except BaseException:
            staged.unlink(missing_ok=True)  # the previous checkpoint at ``path`` is untouched
            raise
        swap_in(staged, target)


def full_state_from_checkpoint(checkpoint: Mapping[str, Any], *, with_optimizer: bool) -> FullState:
    """Rebuild the placement-independent full state from a checkpoint DynMo wrote.

    Args:
        checkpoint: A loaded Lightning checkpoint.
        with_optimizer: Include ``"optimizer_states"`` (resuming training) or not (weights only).

    Raises:
        ValueError: if the checkpoint has no model state, or (``with_optimizer``) its optimizer states are
            not keyed by parameter name, i.e. it was not written by ``DynMoStrategy``.
    """
    model = checkpoint.get("state_dict")
    if not isinstance(model, Mapping) or not model:
        raise ValueError(
            f"checkpoint['state_dict'] is {type(model).__name__} with {len(model or ())} entries; a DynMo "
            "checkpoint holds the whole model's state. Save it with trainer.save_checkpoint under "
            "DynMoStrategy (on every rank)."
        )
    optimizers: list[Any] = []
    if with_optimizer:
        optimizers = list(checkpoint.get("optimizer_states", []))
        for k, state in enumerate(optimizers):
            if not (isinstance(state, Mapping) and "param_group_of" in state and "state" in state):
                keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
                raise ValueError(
                    f"checkpoint['optimizer_states'][{k}] has keys {keys}, not the parameter-name keyed "
                    "format DynMoStrategy writes ('param_groups', 'param_group_of', 'state'); it was "
                    "probably saved without DynMoStrategy. Resume its weights only (load_state_dict) or "
                    "save it with DynMoStrategy."
                )
    units = list(dict.fromkeys(unit_of_key(k) for k in model))
    return FullState(format=FULL_STATE_FORMAT, units=units, model=dict(model), optimizer=optimizers)
