"""Distributed checkpoints of sharded units: save at one placement and shard count, load at another.

Each rank writes the local shards of the units it holds with ``torch.distributed.checkpoint`` (DCP) under
the single-process names of :mod:`lightning_dynmo.pipeline.checkpoint.sharded`::

    state_dict.<unit>.<key>                                 a parameter or buffer of a unit
    optimizer_states.<k>.state.<unit>.<parameter>.<name>    a per-parameter state value of optimizer k

A parameter's shards carry their place in the whole tensor (they are DTensors), so DCP stores every
shard once and a later load reads, for each rank, exactly the rows of its own shards, whatever placement
and data-parallel size wrote them. ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns
the directory into one ``torch.save`` file of whole tensors under the same keys.

What is not here yet: the optimizers' param_group hyper-parameters, LR schedulers and loop state (the
strategy's checkpoint carries them), and non-tensor optimizer state values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

__all__ = ["load_sharded_units", "save_sharded_units", "sharded_unit_items"]


def _parameter_names(units: Mapping[str, nn.Module]) -> dict[int, str]:
    return {
        id(p): f"{unit}.{name}" for unit, module in units.items() for name, p in module.named_parameters()
    }


def sharded_unit_items(
    units: Mapping[str, nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> dict[str, torch.Tensor]:
    """This rank's checkpoint items for ``units``: their parameters, buffers and optimizer state.

    Args:
        units: The units this rank holds, by global name (sharded or not).
        optimizers: This rank's optimizers; only the state of the units' parameters is taken.

    Raises:
        TypeError: an optimizer state value of these parameters is not a tensor.
    """
    items: dict[str, torch.Tensor] = {}
    for unit, module in units.items():
        for key, value in module.state_dict().items():
            items[f"state_dict.{unit}.{key}"] = value
    names = _parameter_names(units)
    for k, optimizer in enumerate(optimizers):
        for param, state in optimizer.state.items():
            name = names.get(id(param))
            if name is None:
                continue
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"optimizer {k} state {key!r} of {name!r} is a {type(value).__name__}, not a tensor; "
                        "sharded checkpoints carry tensor state only."
                    )
                items[f"optimizer_states.{k}.state.{name}.{key}"] = value
    return items


def save_sharded_units(
    checkpoint_dir: str | Path,
    units: Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write every rank's units and their optimizer state to ``checkpoint_dir``; collective over ``group``.

    Args:
        checkpoint_dir: A directory every rank can reach (created if missing).
        units: The units this rank holds, by global name.
        optimizers: This rank's optimizers (the same number on every rank).
        group: The ranks taking part (all active ranks); ``None`` means the default group.
    """
    dcp_save(sharded_unit_items(units, optimizers), checkpoint_id=str(checkpoint_dir), process_group=group)


def load_sharded_units(
    checkpoint_dir: str | Path,
    units: Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Fill this rank's ``units`` and their optimizer state from ``checkpoint_dir``, in place; collective.

    The units must be built and sharded for the new placement, and their parameters already in
    ``optimizers`` (param_groups as the caller wants them); each parameter's state is created here with
    the keys, shapes and dtypes the checkpoint lists for it (a sharded value takes the parameter's layout),
    then read.

    Args:
        checkpoint_dir: The directory :func:`save_sharded_units` wrote, at any placement and shard count.
        units: The units this rank holds now, by global name.
        optimizers: This rank's optimizers.
        group: The ranks taking part; ``None`` means the default group.

    Raises:
        KeyError: on every rank, when a unit's parameter or buffer is missing from the checkpoint on some
            rank (that rank's message names it).
    """
    listed = FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    items = dict(sharded_unit_items(units, ()))
    missing = [k for k in items if k not in listed]
    # Agree first, so that a rank missing keys fails together with its peers instead of leaving them in DCP.
    flag = torch.tensor([1 if missing else 0], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    if missing:
        raise KeyError(
            f"checkpoint {str(checkpoint_dir)!r} lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            "it was saved from another model or with other unit names."
        )
    if int(flag) > 0:
        raise KeyError(
            f"checkpoint {str(checkpoint_dir)!r} lacks items of {int(flag)} other rank(s)' units (their "
            "errors name them); it was saved from another model or with other unit names."
        )
    params = {f"{unit}.{name}": p for unit, module in units.items() for name, p in module.named_parameters()}
    created: list[tuple[torch.optim.Optimizer, torch.Tensor, str, str]] = []
    for k, optimizer in enumerate(optimizers):
        held = {id(p) for group_ in optimizer.param_groups for p in group_["params"]}
        for name, param in params.items():
            if id(param) not in held:
                continue
            prefix = f"optimizer_states.{k}.state.{name}."
            for key, meta in listed.items():
                if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
                    continue
                dtype = meta.properties.dtype
                if tuple(meta.size) == tuple(param.shape) and isinstance(param, DTensor):
                    value: torch.Tensor = torch.zeros_like(param, dtype=dtype)
                else:
                    value = torch.zeros(tuple(meta.size), dtype=dtype, device=_local_device(param))
                items[key] = value
                created.append((optimizer, param, key[len(prefix) :], key))
    dcp_load(items, checkpoint_id=str(checkpoint_dir), process_group=group)
    with torch.no_grad():
        for unit, module in units.items():
            for key, tensor in module.state_dict().items():
                loaded = items[f"state_dict.{unit}.{key}"]
                if loaded is not tensor:
                    tensor.copy_(loaded)
    for optimizer, owner, state_key, key in created:
        optimizer.state[owner][state_key] = items[key]


def _local_device(param: torch.Tensor) -> torch.device:
    return param.to_local().device if isinstance(param, DTensor) else param.device
