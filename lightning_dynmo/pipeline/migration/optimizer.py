"""Optimizer surgery for migration, in place: where a unit's parameters sit, drop them, insert them, sort.

Read in this order: :func:`optimizer_entries` (what the sender records for each parameter),
:func:`drop_from_optimizers` (the sender forgets them), :func:`insert_into_optimizers` (the receiver adds
them to the group :func:`~.param_groups.group_for` picks, with their full state) and
:func:`sort_param_groups` (a deterministic order inside every group).

Optimizers are edited in place because Lightning and LR schedulers hold the optimizer objects. Inside a
param_group, parameters end in a deterministic order: parameters that belong to no known unit first (in
their previous relative order), then unit parameters sorted by the natural order of the unit name
(``layers.2`` before ``layers.10``) and then by their position in the unit's ``named_parameters()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_dynmo.pipeline.migration.param_groups import group_for
from lightning_dynmo.pipeline.model.units import unit_sort_key

__all__ = [
    "OptimizerEntry",
    "drop_from_optimizers",
    "insert_into_optimizers",
    "optimizer_entries",
    "sort_param_groups",
]

#: ``(optimizer_index, group_index, param_name, state_or_None, group_hyperparameters)`` of one parameter.
OptimizerEntry = tuple[int, int, str, dict[str, Any] | None, dict[str, Any]]


def optimizer_entries(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[OptimizerEntry]:
    """Where each of the unit's parameters sits in the optimizers, with its state and group settings."""
    entries = []
    for param_name, param in module.named_parameters():
        for opt_index, optimizer in enumerate(optimizers):
            for group_index, group in enumerate(optimizer.param_groups):
                if any(p is param for p in group["params"]):
                    state = optimizer.state.get(param)
                    hyper = {k: v for k, v in group.items() if k != "params"}
                    entries.append(
                        (opt_index, group_index, param_name, dict(state) if state else None, hyper)
                    )
    return entries


def drop_from_optimizers(units: Mapping[str, nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> None:
    gone = {id(p) for unit in units.values() for p in unit.parameters()}
    if not gone:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"][:] = [p for p in group["params"] if id(p) not in gone]
        for p in [p for p in optimizer.state if id(p) in gone]:
            del optimizer.state[p]


def insert_into_optimizers(
    name: str,
    module: nn.Module,
    entries: list[OptimizerEntry],
    optimizers: Sequence[torch.optim.Optimizer],
    lr_schedulers: Sequence[Any],
) -> None:
    """Add received unit ``name``'s parameters to the groups their sender-side ``entries`` describe.

    Raises:
        ValueError: an entry names an optimizer this rank does not have, or no group can take it in
            (see :func:`~.param_groups.group_for`).
    """
    params = dict(module.named_parameters())
    for opt_index, group_index, param_name, state, hyper in entries:
        if opt_index >= len(optimizers):
            raise ValueError(
                f"Unit {name!r} parameter {param_name!r} was in optimizers[{opt_index}] on the sender, but "
                f"this rank has {len(optimizers)} optimizer(s). Every rank must build the same optimizers."
            )
        what = f"unit {name!r} parameter {param_name!r}"
        group = group_for(optimizers[opt_index], group_index, hyper, lr_schedulers, what)
        param = params[param_name]
        group["params"].append(param)
        if state is not None:
            optimizers[opt_index].state[param] = state


def sort_param_groups(known: Mapping[str, nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Deterministic order: foreign params first (stable), then unit params by (unit name, position)."""
    order: dict[int, tuple[Any, ...]] = {}
    for unit_name, unit in known.items():
        for position, param in enumerate(unit.parameters()):
            order.setdefault(id(param), (unit_sort_key(unit_name), position))
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = group["params"]
            foreign = [p for p in params if id(p) not in order]
            ours = sorted((p for p in params if id(p) in order), key=lambda p: order[id(p)])
            params[:] = foreign + ours
