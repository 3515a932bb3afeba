"""Input checks shared by the balancers, the problem object and the policy configs (private).

Every public entry point validates its arguments here, so a bad value fails early with a message that
names the argument, the value, the rule and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.placement import Placement

#: Memory caps in bytes: ``None`` (unlimited), one number for all, or one per stage (a sequence); the
#: worker balancer also takes one per worker (a sequence indexed by worker id, or a mapping).
MemoryCapacity = float | int | Sequence[float | int] | Mapping[int, float] | None
#: Per worker, its slowdown factor: a sequence indexed by worker id, or a mapping keyed by it.
PerWorker = Sequence[float] | Mapping[int, float] | None
#: Send times: one number, one per layer (every link alike), or one row per link of one per layer.
CommTime = float | Sequence[float] | Sequence[Sequence[float]] | None


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


def stage_slowdown(value: object, num_stages: int, name: str = "worker_slowdown") -> tuple[float, ...]:
    """Normalise per-stage slowdown factors (``None``: every stage 1.0) to a per-stage tuple.

    A stage's slowdown is how many times longer its worker takes than the reference worker the layer
    costs are expressed in: 1.0 is the reference, 2.0 a worker half as fast.
    """
    if value is None:
        return (1.0,) * num_stages
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(
            f"{name}={value!r} must be None or one factor per stage (1.0 = the reference worker, 2.0 = "
            "half as fast; stage s runs on worker s)."
        )
    if len(value) != num_stages:
        raise ValueError(
            f"{name} has {len(value)} entries but there are {num_stages} stages; give one slowdown factor "
            "per stage."
        )
    factors = []
    for s, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(
                f"{name}[{s}]={v!r} must be a finite number > 0 (how many times longer the stage's worker "
                "takes than the reference: 1.0 for the reference, 2.0 for half as fast)."
            )
        factors.append(float(v))
    return tuple(factors)


def comm_rows(comm_time_s: CommTime, num_layers: int, num_stages: int, by: str) -> list[list[float]] | None:
    """Normalise send times to one row per stage boundary (``num_stages - 1`` rows of ``num_layers``).

    Entry ``[s][i]`` is the time for stage ``s`` to send layer ``i``'s output over its link to stage
    ``s + 1``. Accepted: ``None``; one number (every layer, every link); one number per layer (every
    link alike); one row per link, each with one number per layer (links differ).
    """
    if comm_time_s is None:
        return None
    if by != "time":
        raise ValueError(
            f"comm_time_s={_short(comm_time_s)} is given with by={by!r}; communication time only adds to "
            "time loads, so use by='time' or drop comm_time_s."
        )
    links = max(num_stages - 1, 0)
    if _is_number(comm_time_s):
        row = _layer_row([comm_time_s] * num_layers, num_layers, "comm_time_s")
        rows = [list(row) for _ in range(links)]
    elif isinstance(comm_time_s, Sequence) and not isinstance(comm_time_s, (str, bytes)):
        if len(comm_time_s) > 0 and all(_is_row(r) for r in comm_time_s):
            if len(comm_time_s) != links:
                raise ValueError(
                    f"comm_time_s has {len(comm_time_s)} rows but {num_stages} stages have {links} links; "
                    "give one row per link (row s: stage s -> s + 1), or one number per layer for all links."
                )
            rows = [_layer_row(r, num_layers, f"comm_time_s[{s}]") for s, r in enumerate(comm_time_s)]
        else:
            row = _layer_row(comm_time_s, num_layers, "comm_time_s")
            rows = [list(row) for _ in range(links)]
    else:
        raise ValueError(
            f"comm_time_s={comm_time_s!r} must be None, a number of seconds, one per layer, or one row per "
            "link."
        )
    return rows


def _layer_row(row: object, num_layers: int, name: str) -> list[float]:
    assert isinstance(row, Sequence)
    if len(row) != num_layers:
        raise ValueError(
            f"{name} has {len(row)} entries but there are {num_layers} layers; give one send time per layer "
            "(entry i = sending layer i's output), or a single number."
        )
    values = [float(v) if _is_number(v) else math.nan for v in row]
    bad = [v for v in values if math.isnan(v) or math.isinf(v) or v < 0]
    if bad:
        raise ValueError(f"{name} contains {bad[0]!r}; send times must be finite numbers >= 0 (seconds).")
    return values


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_row(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_extras(first_stage_extra: object, last_stage_extra: object) -> None:
    """Raise unless both pinned extras are ``LayerCost`` records or ``None``."""
    for name, extra in (("first_stage_extra", first_stage_extra), ("last_stage_extra", last_stage_extra)):
        if extra is not None and not isinstance(extra, LayerCost):
            raise ValueError(
                f"{name}={extra!r} must be a LayerCost (or None); describe the pinned part's time, "
                "parameters and memory with LayerCost(...)."
            )


def check_int(value: object, name: str, minimum: int, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= ``minimum`` (``hint``: the fix)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        fix = f"; {hint}" if hint else ""
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}{fix}.")


def check_positive(value: object, name: str, allow_zero: bool) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number > 0 (>= 0 with ``allow_zero``)."""
    rule = ">= 0" if allow_zero else "> 0"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        raise ValueError(f"{name}={value!r} must be a finite number {rule}.")
