"""Share each rank's layer costs so every rank of a pipeline holds the records of all layers.

One ``all_reduce`` of a small float64 table (one row per layer, then one per first/last-stage part, one
column per ``LayerCost`` field plus an "owned" count) replaces pickling objects: each row is filled only
by the rank that owns it, so the sum is the table of all layers and parts, and the "owned" column shows
gaps and overlaps. float64 holds the integer fields exactly (up to 2**53 bytes or parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple, dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from lightning_dynmo.balancing.costs import LayerCost

_FIELDS = [f.name for f in fields(LayerCost)]
_INT_FIELDS = {f.name for f in fields(LayerCost) if f.type in ("int", int)}
#: The pinned parts, in table order after the layers.
PART_NAMES = ("first", "last")


@dataclass(frozen=True)
class GatheredCosts:
    """Every layer's cost and the pinned parts', identical on every rank of the pipeline group.

    Attributes:
        layers: One record per layer, in layer order.
        first: The first-stage parts (embedding), or ``None`` when no rank profiled them.
        last: The last-stage parts (final norm, head and the loss), or ``None``.
    """

    layers: list[LayerCost]
    first: LayerCost | None = None
    last: LayerCost | None = None


def gather_layer_costs(
    local: Mapping[int, LayerCost],
    num_layers: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[LayerCost]:
    """All layers' costs on every rank of the pipeline group; a collective, call it on every rank.

    Args:
        local: The costs of the layers this rank owns, by global layer index.
        num_layers: Layers in the whole model; together the ranks must cover ``0 .. num_layers - 1``
            exactly once.
        group: The pipeline group; ``None`` means the default group. With one process and no
            initialised process group, ``local`` must already cover every layer.
        device: Where the exchanged table lives (the stage's device: NCCL needs a CUDA tensor).

    Returns:
        One :class:`LayerCost` per layer, in layer order, identical on every rank.

    Raises:
        ValueError: if a layer index is out of range, or a layer is covered by no rank or by two.
    """
    return gather_costs(local, num_layers, group, device).layers


def gather_costs(
    local: Mapping[int, LayerCost],
    num_layers: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    local_parts: Mapping[str, LayerCost] | None = None,
) -> GatheredCosts:
    """:func:`gather_layer_costs`, plus the first/last-stage parts the ranks profiled, in one collective.

    Args:
        local: The costs of the layers this rank owns, by global layer index.
        num_layers: Layers in the whole model.
        group: The pipeline group; ``None`` means the default group.
        device: Where the exchanged table lives.
        local_parts: The costs of the parts this rank runs, by name (``"first"``, ``"last"``).

    Raises:
        ValueError: as :func:`gather_layer_costs`; also for an unknown part name or a part two ranks
            profiled.
    """
    for index in local:
        if not 0 <= index < num_layers:
            raise ValueError(
                f"local has layer {index}, outside 0..{num_layers - 1} (num_layers={num_layers}); "
                "key the costs by global layer index."
            )
    parts = dict(local_parts or {})
    unknown = sorted(set(parts) - set(PART_NAMES))
    if unknown:
        raise ValueError(f"local_parts has {unknown}; the parts are named {PART_NAMES}.")
    table = torch.zeros(num_layers + len(PART_NAMES), len(_FIELDS) + 1, dtype=torch.float64)
    rows = {**local, **{num_layers + PART_NAMES.index(name): cost for name, cost in parts.items()}}
    for index, cost in rows.items():
        table[index, :-1] = torch.tensor(astuple(cost), dtype=torch.float64)
        table[index, -1] = 1.0
    if dist.is_available() and dist.is_initialized():
        table = table.to(device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
        table = table.cpu()
    layers = _records(table[:num_layers])
    first, last = (_part(table[num_layers + k], name) for k, name in enumerate(PART_NAMES))
    return GatheredCosts(layers, first, last)


def _part(row: torch.Tensor, name: str) -> LayerCost | None:
    owners = round(float(row[-1]))
    if owners == 0:
        return None
    if owners > 1:
        raise ValueError(
            f"the {name} parts were profiled by {owners} ranks of the pipeline group; only the rank running "
            f"the {'first' if name == 'first' else 'last'} stage may report them."
        )
    return _record(row[:-1].tolist())


def _records(table: torch.Tensor) -> list[LayerCost]:
    owners = table[:, -1].round().long().tolist()
    missing = [i for i, n in enumerate(owners) if n == 0]
    if missing:
        raise ValueError(
            f"no rank of the pipeline group reported layers {missing} (num_layers={len(owners)}); every "
            "stage must profile all the layers it owns."
        )
    twice = [i for i, n in enumerate(owners) if n > 1]
    if twice:
        raise ValueError(
            f"layers {twice} were profiled by more than one rank; every layer must be owned by exactly one "
            "stage of the pipeline group."
        )
    return [_record(row) for row in table[:, :-1].tolist()]


def _record(row: list[float]) -> LayerCost:
    values: dict[str, Any] = {
        name: round(v) if name in _INT_FIELDS else v for name, v in zip(_FIELDS, row, strict=True)
    }
    return LayerCost(**values)
