"""The layer moves that turn one placement into another.

Migration executes these in the order given (global layer order), which every rank computes
identically from the two placements, so no extra coordination is needed to agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dynmo.balancing.placement import Placement


@dataclass(frozen=True)
class LayerMove:
    """Layer ``layer`` leaves stage ``from_stage`` (old placement) for ``to_stage`` (new placement)."""

    layer: int
    from_stage: int
    to_stage: int


def plan_moves(old: Placement, new: Placement) -> tuple[LayerMove, ...]:
    """Every layer whose owning stage differs between ``old`` and ``new``, in global layer order.

    The placements may have different numbers of stages (re-packing); stage indices refer to each
    placement's own stages.

    Raises:
        ValueError: if either argument is not a Placement or they cover different numbers of layers.
    """
    for name, value in (("old", old), ("new", new)):
        if not isinstance(value, Placement):
            raise ValueError(f"{name}={value!r} is not a Placement; build one with Placement.from_string().")
    if old.num_layers != new.num_layers:
        raise ValueError(
            f"old={old} covers {old.num_layers} layers but new={new} covers {new.num_layers}; both "
            "placements must describe the same model."
        )
    before, after = old.layer_to_stage(), new.layer_to_stage()
    return tuple(
        LayerMove(layer, src, dst)
        for layer, (src, dst) in enumerate(zip(before, after, strict=True))
        if src != dst
    )
