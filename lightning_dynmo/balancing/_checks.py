"""Input checks shared by the balancers (private).

Every public balancer validates its arguments here first, so a bad value fails early with a message
that names the argument, the value, the rule and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_dynmo.balancing.placement import Placement

MemoryCapacity = float | int | Sequence[float | int] | None


def check_num_stages(num_stages: object, num_layers: int, name: str = "num_stages") -> int:
    """Return ``num_stages`` if it is an integer in ``1..num_layers``, else raise ``ValueError``."""
    if not isinstance(num_stages, int) or isinstance(num_stages, bool):
        raise ValueError(f"{name}={num_stages!r} must be an integer number of pipeline stages >= 1.")
    if num_stages < 1:
        raise ValueError(f"{name}={num_stages} must be >= 1: a pipeline needs at least one stage.")
    if num_stages > num_layers:
        raise ValueError(
            f"{name}={num_stages} exceeds the number of layers ({num_layers}): every stage needs at least "
            f"one layer, so use at most {num_layers} stages."
        )
    return num_stages


def _check_number(value: object, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a number.")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be a number >= 0 (NaN and negative values are not allowed).")
    return float(value)


def memory_caps(
    capacity: MemoryCapacity, num_stages: int, name: str = "memory_capacity_bytes"
) -> tuple[float, ...]:
    """Normalise a memory capacity (``None``, one number, or one number per stage) to a per-stage tuple.

    ``None`` means unlimited (``inf`` for every stage).
    """
    if capacity is None:
        return (math.inf,) * num_stages
    if isinstance(capacity, (int, float)) and not isinstance(capacity, bool):
        return (_check_number(capacity, name),) * num_stages
    if not isinstance(capacity, Sequence) or isinstance(capacity, str):
        raise ValueError(f"{name}={capacity!r} must be None, a number of bytes, or one number per stage.")
    if len(capacity) != num_stages:
        raise ValueError(
            f"{name} has {len(capacity)} entries but there are {num_stages} stages; give one capacity per "
            "stage, or a single number for all stages."
        )
    return tuple(_check_number(c, f"{name}[{s}]") for s, c in enumerate(capacity))


def check_placement(placement: object, num_layers: int, name: str = "current") -> Placement:
    """Return ``placement`` as a :class:`Placement` covering ``num_layers`` layers (strings are parsed)."""
    if isinstance(placement, str):
        placement = Placement.from_string(placement)
    if not isinstance(placement, Placement):
        raise ValueError(
            f"{name}={placement!r} is not a Placement; pass Placement.from_string('0-3|4-7') or a string."
        )
    if placement.num_layers != num_layers:
        raise ValueError(
            f"{name}={placement} covers {placement.num_layers} layers but costs has {num_layers} records; "
            "pass exactly one LayerCost per layer of the placement."
        )
    return placement


def check_positive_int(value: object, name: str) -> int:
    """Return ``value`` if it is an integer >= 1, else raise ``ValueError``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1.")
    return value


def check_fraction(value: object, name: str) -> float:
    """Return ``value`` if it is a finite number >= 0, else raise ``ValueError``."""
    number = _check_number(value, name)
    if math.isinf(number):
        raise ValueError(f"{name}={value!r} must be finite.")
    return number
