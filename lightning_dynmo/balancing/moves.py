"""The one move type (a unit changing owner) and the layer moves that turn one placement into another.

Migration executes moves in the order given (global layer order), which every rank computes
identically from the two placements, so no extra coordination is needed to agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from lightning_dynmo.balancing.placement import Placement

__all__ = ["LayerMove", "Move", "UnitMove", "plan_moves"]

UnitT = TypeVar("UnitT", int, str)


@dataclass(frozen=True)
class Move(Generic[UnitT]):
    """One unit changing owner: ``unit`` leaves owner ``src`` for owner ``dst``.

    The same move at two levels: a balancer plans a :data:`LayerMove` (``unit`` a global layer index,
    owners the stages of the old and the new placement); the runtime executes a :data:`UnitMove`
    (``unit`` a unit name such as ``"layers.7"``, ``"embed"`` or ``"head"``, owners GLOBAL ranks).
    """

    unit: UnitT
    src: int
    dst: int


#: A balancer's move: layer ``unit`` leaves stage ``src`` (old placement) for stage ``dst`` (new one).
LayerMove = Move[int]
#: A runtime move: unit ``unit`` (e.g. ``"layers.7"``) leaves GLOBAL rank ``src`` for GLOBAL rank ``dst``.
UnitMove = Move[str]


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
