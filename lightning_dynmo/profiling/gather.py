"""Share each rank's layer costs so every rank of a pipeline holds the records of all layers."""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from lightning_dynmo.balancing.costs import LayerCost


def gather_layer_costs(
    local: Mapping[int, LayerCost], num_layers: int, group: dist.ProcessGroup | None = None
) -> list[LayerCost]:
    """All-gather per-layer costs over the pipeline group; a collective, call it on every rank.

    Args:
        local: The costs of the layers this rank owns, by global layer index.
        num_layers: Layers in the whole model; together the ranks must cover ``0 .. num_layers - 1``
            exactly once.
        group: The pipeline group; ``None`` means the default group. With one process and no
            initialised process group, ``local`` must already cover every layer.

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
    parts: list[dict[int, LayerCost]] = [dict(local)]
    if dist.is_available() and dist.is_initialized():
        gathered: list[dict[int, LayerCost] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, dict(local), group=group)
        parts = [p or {} for p in gathered]
    return _merge(parts, num_layers)


def _merge(parts: list[dict[int, LayerCost]], num_layers: int) -> list[LayerCost]:
    merged: dict[int, LayerCost] = {}
    for rank, part in enumerate(parts):
        for index, cost in part.items():
            if index in merged:
                raise ValueError(
                    f"layer {index} was profiled by two ranks (the second is group rank {rank}); every "
                    "layer must be owned by exactly one stage of the pipeline group."
                )
            merged[index] = cost
    missing = sorted(set(range(num_layers)) - set(merged))
    if missing:
        raise ValueError(
            f"no rank of the pipeline group reported layers {missing} (num_layers={num_layers}); every "
            "stage must profile all the layers it owns."
        )
    return [merged[i] for i in range(num_layers)]
