"""Share each rank's layer costs so every rank of a pipeline holds the records of all layers.

One ``all_reduce`` of a small float64 table (one row per layer, one column per ``LayerCost`` field
plus an "owned" count) replaces pickling objects: each layer's row is filled only by the rank that
owns it, so the sum is the table of all layers, and the "owned" column shows gaps and overlaps.
float64 holds the integer fields exactly (up to 2**53 bytes or parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple, fields

import torch
import torch.distributed as dist

from lightning_dynmo.balancing.costs import LayerCost

_FIELDS = [f.name for f in fields(LayerCost)]
_INT_FIELDS = {f.name for f in fields(LayerCost) if f.type in ("int", int)}


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
    for index in local:
        if not 0 <= index < num_layers:
            raise ValueError(
                f"local has layer {index}, outside 0..{num_layers - 1} (num_layers={num_layers}); "
                "key the costs by global layer index."
            )
    table = torch.zeros(num_layers, len(_FIELDS) + 1, dtype=torch.float64)
    for index, cost in local.items():
        table[index, :-1] = torch.tensor(astuple(cost), dtype=torch.float64)
        table[index, -1] = 1.0
    if dist.is_available() and dist.is_initialized():
        table = table.to(device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
        table = table.cpu()
    return _records(table)


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
    return [
        LayerCost(
            **{name: round(v) if name in _INT_FIELDS else v for name, v in zip(_FIELDS, row, strict=True)}
        )
        for row in table[:, :-1].tolist()
    ]
