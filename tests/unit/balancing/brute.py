"""Brute-force references for the balancing property tests: enumerate every placement (small n only)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

from lightning_dynmo.balancing import BalanceProblem, Hardware, LayerCost, Placement

_HARDWARE = {f for f in Hardware.__dataclass_fields__}


def problem_of(costs: Sequence[LayerCost], **kwargs: Any) -> tuple[BalanceProblem, dict[str, Any]]:
    """A :class:`BalanceProblem` from ``costs`` and the keywords that belong to it; the other keywords.

    For parametrised tests that mix problem keywords (``by``, :class:`Hardware` fields) with a
    balancer's own; call it inside ``pytest.raises`` when the problem itself is the bad input.
    """
    hardware = {k: kwargs.pop(k) for k in list(kwargs) if k in _HARDWARE}
    by = kwargs.pop("by", "time")
    return BalanceProblem(costs, by, Hardware(**hardware)), kwargs


def all_placements(num_layers: int, num_stages: int) -> Iterator[Placement]:
    """Every ordered, contiguous, non-empty placement of ``num_layers`` layers on ``num_stages`` stages."""
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        yield Placement((0, *cuts, num_layers))


def direct_loads(
    costs: Sequence[LayerCost],
    placement: Placement,
    by: str = "time",
    first: LayerCost | None = None,
    last: LayerCost | None = None,
    comm: Sequence[float] | Sequence[Sequence[float]] | None = None,
    slowdown: Sequence[float] | None = None,
) -> list[float]:
    """Stage loads summed directly from the records (independent of the library's prefix sums).

    ``comm`` is one send time per layer (every link alike) or one row per link; ``slowdown`` multiplies
    each stage's layers and extras.
    """

    def weight(c: LayerCost) -> float:
        return c.fwd_time_s + c.bwd_time_s if by == "time" else float(c.num_params)

    stages = placement.num_stages
    loads = []
    for s in range(stages):
        layers = placement.layers_of(s)
        work = sum(weight(costs[i]) for i in layers)
        if s == 0 and first is not None:
            work += weight(first)
        if s == stages - 1 and last is not None:
            work += weight(last)
        load = work * (slowdown[s] if slowdown is not None else 1.0)
        if comm is not None and s < stages - 1:
            row = comm[s] if isinstance(comm[0], Sequence) else comm
            load += row[layers[-1]]  # type: ignore[index]
        loads.append(load)
    return loads


def direct_memory(
    costs: Sequence[LayerCost],
    placement: Placement,
    first: LayerCost | None = None,
    last: LayerCost | None = None,
) -> list[float]:
    """Stage memory summed directly from the records."""
    stages = placement.num_stages
    mem = []
    for s in range(stages):
        total = float(sum(costs[i].memory_bytes for i in placement.layers_of(s)))
        if s == 0 and first is not None:
            total += first.memory_bytes
        if s == stages - 1 and last is not None:
            total += last.memory_bytes
        mem.append(total)
    return mem


def caps_list(caps: float | Sequence[float] | None, stages: int) -> list[float]:
    if caps is None:
        return [math.inf] * stages
    if isinstance(caps, (int, float)):
        return [float(caps)] * stages
    return [float(c) for c in caps]


def brute_optimum(
    costs: Sequence[LayerCost],
    num_stages: int,
    by: str = "time",
    caps: float | Sequence[float] | None = None,
    first: LayerCost | None = None,
    last: LayerCost | None = None,
    comm: Sequence[float] | Sequence[Sequence[float]] | None = None,
    slowdown: Sequence[float] | None = None,
) -> float | None:
    """The smallest bottleneck over all placements that fit memory (``None`` if none fits)."""
    limits = caps_list(caps, num_stages)
    best: float | None = None
    for p in all_placements(len(costs), num_stages):
        if any(m > c for m, c in zip(direct_memory(costs, p, first, last), limits, strict=True)):
            continue
        value = max(direct_loads(costs, p, by, first, last, comm, slowdown))
        best = value if best is None else min(best, value)
    return best


def assert_valid(placement: Placement, num_layers: int, num_stages: int | None = None) -> None:
    """Ordered, contiguous, covers all layers, no empty stage (re-checked independently of Placement)."""
    b = placement.boundaries
    assert b[0] == 0 and b[-1] == num_layers
    assert all(b[s] < b[s + 1] for s in range(len(b) - 1))
    assert [placement.stage_of(i) for i in range(num_layers)] == sorted(
        placement.stage_of(i) for i in range(num_layers)
    )
    if num_stages is not None:
        assert placement.num_stages == num_stages


def assert_fits(
    costs: Sequence[LayerCost], placement: Placement, caps: float | Sequence[float] | None
) -> None:
    limits = caps_list(caps, placement.num_stages)
    for s, (m, c) in enumerate(zip(direct_memory(costs, placement), limits, strict=True)):
        assert m <= c, f"stage {s} of {placement} needs {m} > capacity {c}"
