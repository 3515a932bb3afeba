"""The units of a contract-abiding model (blocks and first/last parts), by global name: list, detach, attach.

A unit is what moves, saves and initialises as one piece: ``layers.<i>`` for each block, and each
first-stage and last-stage part by its attribute name (``tok_emb``, ``head``). A rank holds the units it
owns; the others are removed from the model (blocks deleted from ``layers``, parts set to ``None``).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from lightning_dynmo.pipeline.model.contract import ModelSpec

__all__ = ["attach_unit", "detach_unit", "pipeline_units", "unit_of_key", "unit_sort_key"]


def pipeline_units(model: nn.Module, spec: ModelSpec) -> dict[str, nn.Module]:
    """The units ``model`` holds now, by global name, in pipeline order (first parts, blocks, last parts)."""
    layers = model.get_submodule("layers")
    units: dict[str, nn.Module] = {}
    for name in spec.first_parts:
        part = getattr(model, name, None)
        if part is not None:
            units[name] = part
    units.update({f"layers.{k}": block for k, block in layers.named_children()})
    for name in spec.last_parts:
        part = getattr(model, name, None)
        if part is not None:
            units[name] = part
    return units


def detach_unit(model: nn.Module, unit: str) -> None:
    """Remove ``unit`` from ``model`` (a block leaves ``layers``; a part becomes ``None``)."""
    prefix, _, index = unit.partition(".")
    if prefix == "layers" and index.isdigit():
        del model.get_submodule("layers")[index]  # type: ignore[operator]
    else:
        setattr(model, unit, None)


def attach_unit(model: nn.Module, unit: str, module: nn.Module) -> None:
    """Put ``module`` into ``model`` as ``unit``; blocks stay in global index order (a stage runs them so)."""
    prefix, _, index = unit.partition(".")
    if prefix == "layers" and index.isdigit():
        layers = model.get_submodule("layers")
        assert isinstance(layers, nn.ModuleDict)
        items = sorted([*layers.items(), (index, module)], key=lambda kv: int(kv[0]))
        layers.clear()
        layers.update(dict(items))
    else:
        setattr(model, unit, module)


def unit_of_key(key: str) -> str:
    """The unit a model ``state_dict`` key belongs to: ``"layers.7.fc1.weight"`` -> ``"layers.7"``."""
    head, _, rest = key.partition(".")
    if head == "layers":
        index, _, _ = rest.partition(".")
        return f"layers.{index}"
    return head


def unit_sort_key(name: str) -> tuple[Any, ...]:
    """Natural sort key of a unit or parameter name: ``layers.2`` sorts before ``layers.10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
