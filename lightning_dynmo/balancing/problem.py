"""The balancing problem: layer costs, their view and the hardware, validated once (pure Python).

Read :class:`BalanceProblem` first: every balancer entry point (``partition``, ``diffuse``, ``repack``,
``partition_workers``, ``decide``, ``predict``, ...) takes one, whole, as its first argument, and reads
what it needs through its helpers (weights, memory caps, links, per-stage slowdown) instead of checking
loose arguments itself. Then :func:`takes_problem`, the decorator that turns a call in the old shape
(``partition(costs, 4, first_stage_extra=...)``) into a ``TypeError`` naming the new place.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from lightning_dynmo.balancing._checks import comm_rows, memory_caps, stage_slowdown
from lightning_dynmo.balancing.costs import LayerCost, check_costs, check_view, layer_weights
from lightning_dynmo.balancing.hardware import Hardware, whole_backward_ratio


@dataclass(frozen=True)
class BalanceProblem:
    """What every balancer balances: one cost record per layer, the view they are weighed by, the hardware.

    Attributes:
        costs: One record per layer, in layer order, measured on (or scaled to) the reference worker.
        by: The cost view: ``"time"`` (forward + backward seconds) or ``"params"`` (parameter count).
        hardware: Pinned first/last-stage parts, worker slowdowns, links and memory caps.

    Raises:
        ValueError: if ``costs`` is empty or holds something else than a :class:`LayerCost`, ``by`` is
            not a view, or ``hardware`` is not a :class:`Hardware` (which checks its own fields).
    """

    costs: Sequence[LayerCost]
    by: str = "time"
    hardware: Hardware = field(default_factory=Hardware)

    def __post_init__(self) -> None:
        check_costs(self.costs)
        check_view(self.by)
        if not isinstance(self.hardware, Hardware):
            raise ValueError(
                f"hardware={self.hardware!r} is not a Hardware; describe the pinned parts, worker speeds, "
                "links and memory caps with Hardware(...)."
            )
        object.__setattr__(self, "costs", tuple(self.costs))  # frozen all the way down

    @functools.cached_property
    def whole_to_split(self) -> float:
        """A backward run whole against split, as these records show (1 in the ``"params"`` view).

        :func:`~lightning_dynmo.balancing.hardware.whole_backward_ratio` of ``costs``, computed once per
        problem: every step prediction of a search reads it.
        """
        return whole_backward_ratio(self.costs) if self.by == "time" else 1.0

    @property
    def num_layers(self) -> int:
        """Number of layers (cost records)."""
        return len(self.costs)

    def weights(self) -> list[float]:
        """Each layer's scalar weight under the view ``by``."""
        return layer_weights(self.costs, self.by)

    def caps(self, num_stages: int) -> tuple[float, ...]:
        """Per stage, its memory capacity in bytes (``inf``: unlimited)."""
        return memory_caps(self.hardware.memory_capacity_bytes, num_stages)

    def links(self, num_stages: int) -> list[list[float]] | None:
        """Send times as one row per link of exactly ``num_stages`` stages (``None``: free links)."""
        return comm_rows(self.hardware.comm_time_s, self.num_layers, num_stages, self.by)

    def stage_slowdown(self, num_stages: int) -> tuple[float, ...]:
        """Per stage, its worker's slowdown (stage ``s`` runs on worker ``s``; every stage needs one)."""
        return stage_slowdown(self.hardware.worker_slowdown, num_stages)

    def with_hardware(self, **changes: Any) -> BalanceProblem:
        """The same problem on hardware with ``changes`` (e.g. the first ``k`` stages' caps and links)."""
        return dataclasses.replace(self, hardware=dataclasses.replace(self.hardware, **changes))


#: Where each argument of the old balancer signatures lives now.
MOVED: dict[str, str] = {
    "costs": "BalanceProblem(costs), passed whole as the first argument",
    "by": "BalanceProblem(by=...)",
    "hardware": "BalanceProblem(hardware=...)",
    "memory_capacity_bytes": "Hardware(memory_capacity_bytes=...) in BalanceProblem",
    "first_stage_extra": "Hardware(first_stage_extra=...) in BalanceProblem",
    "last_stage_extra": "Hardware(last_stage_extra=...) in BalanceProblem",
    "comm_time_s": "Hardware(comm_time_s=...) in BalanceProblem",
    "stage_slowdown": "Hardware(worker_slowdown=...) in BalanceProblem (stage s runs on worker s)",
    "worker_slowdown": "Hardware(worker_slowdown=...) in BalanceProblem",
    "min_saving": "BalanceConfig(min_saving=...)",
}

P = ParamSpec("P")
R = TypeVar("R")


def takes_problem(entry: Callable[P, R]) -> Callable[P, R]:
    """Make ``entry`` refuse its old call shape with a ``TypeError`` that says where the argument went.

    ``entry`` takes a :class:`BalanceProblem` as its first argument; a keyword of its old signature that
    moved into the problem (see :data:`MOVED`), or anything else in the first place, fails before the
    call.
    """
    own = set(inspect.signature(entry).parameters)
    name = entry.__name__

    @functools.wraps(entry)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        for key in kwargs:
            if key in MOVED and key not in own:
                raise TypeError(f"{name}() got {key}=...: {key} moved to {MOVED[key]}.")
        problem = args[0] if args else kwargs.get("problem")
        if not isinstance(problem, BalanceProblem):
            raise TypeError(
                f"{name}() takes a BalanceProblem first, got {type(problem).__name__}; call "
                f"{name}(BalanceProblem(costs, by=..., hardware=Hardware(...)), ...)."
            )
        return entry(*args, **kwargs)

    return checked
