"""What a stage costs: the load and memory of a contiguous run of layers on a given stage (private model).

Read :class:`StageModel` first. It turns per-layer records plus the optional extras, slowdowns and link
times into the two numbers every balancer compares: the *load* of stage ``s`` owning layers ``a..b-1``
and its *memory*.

Model (documented once, used by partition, diffusion and repack alike):

* load(a, b, s) = ``slowdown[s]`` x (sum of the layers' weights in the ``by`` view)
  + ``comm[s][b-1]`` if ``s`` is not the last stage (the time to send the boundary layer's activation
  over stage ``s``'s link; the *sending* stage pays it, as it cannot start its next op until the send is
  done)
  + ``slowdown[s]`` x (the first-stage extra's weight if ``s == 0``, the last-stage extra's if ``s`` is
  the last).
* memory(a, b, s) = sum of the layers' ``memory_bytes`` + the extras' ``memory_bytes`` on their stages.

Costs are expressed on a *reference* worker; a stage whose worker is slower (``slowdown[s] > 1``) takes
proportionally longer for the same layers, extras included. Loads are always evaluated as
``(slowdown * (W[b] - W[a]) + comm) + extra`` on prefix sums ``W``, so that the scalar and the vectorised
code paths round identically (the exact search relies on that); with every slowdown 1.0 and no
communication the value is exactly ``(W[b] - W[a]) + extra``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from lightning_dynmo.balancing.costs import layer_weights
from lightning_dynmo.balancing.placement import Placement

if TYPE_CHECKING:
    from lightning_dynmo.balancing.problem import BalanceProblem

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class StageModel:
    """Prefix sums and per-stage extras, slowdowns and link times for one problem with ``num_stages`` stages.

    Attributes:
        num_stages: Number of stages of the placements this model evaluates.
        prefix_load: ``W[i]`` = summed weight of layers ``0..i-1`` on the reference worker (length ``n + 1``).
        prefix_memory: ``M[i]`` = summed ``memory_bytes`` of layers ``0..i-1`` (length ``n + 1``).
        comm: ``comm[s][i]``: time for stage ``s`` to send layer ``i``'s output to stage ``s + 1``; the
            last row (the last stage sends nothing) is zeros. Shape ``(num_stages, n)``.
        extra_load: Fixed load added to each stage (first/last-stage extras, slowdown applied).
        extra_memory: Fixed bytes added to each stage, length ``num_stages``.
        caps: Memory capacity of each stage in bytes (``inf`` = unlimited), length ``num_stages``.
        slowdown: Time factor of each stage's worker against the reference, length ``num_stages``.
    """

    num_stages: int
    prefix_load: FloatArray
    prefix_memory: FloatArray
    comm: FloatArray
    extra_load: tuple[float, ...]
    extra_memory: tuple[float, ...]
    caps: tuple[float, ...]
    slowdown: tuple[float, ...] = ()

    _slowdown: FloatArray = field(init=False, repr=False)
    _extra_load: FloatArray = field(init=False, repr=False)
    _extra_memory: FloatArray = field(init=False, repr=False)
    _scaled: bool = field(init=False, repr=False)
    _linked: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.slowdown:
            object.__setattr__(self, "slowdown", (1.0,) * self.num_stages)
        # Array copies and flags for the vectorised paths, which diffusion calls thousands of times.
        object.__setattr__(self, "_slowdown", np.asarray(self.slowdown, dtype=np.float64))
        object.__setattr__(self, "_extra_load", np.asarray(self.extra_load, dtype=np.float64))
        object.__setattr__(self, "_extra_memory", np.asarray(self.extra_memory, dtype=np.float64))
        object.__setattr__(self, "_scaled", any(f != 1.0 for f in self.slowdown))
        object.__setattr__(self, "_linked", bool(np.any(self.comm)))

    @classmethod
    def build(cls, problem: BalanceProblem, num_stages: int) -> StageModel:
        """Build the model of ``problem`` over ``num_stages`` stages (``num_stages`` already checked).

        Memory caps, links (one row per link of exactly ``num_stages`` stages) and per-stage slowdowns
        are validated here, through the problem's helpers.
        """
        caps = problem.caps(num_stages)
        comm = problem.links(num_stages)
        factors = problem.stage_slowdown(num_stages)
        hardware, costs = problem.hardware, problem.costs
        weights = np.asarray(problem.weights(), dtype=np.float64)
        memory = np.asarray([float(c.memory_bytes) for c in costs], dtype=np.float64)
        extra_load = [0.0] * num_stages
        extra_memory = [0.0] * num_stages
        for stage, extra in ((0, hardware.first_stage_extra), (num_stages - 1, hardware.last_stage_extra)):
            if extra is not None:
                extra_load[stage] += factors[stage] * layer_weights([extra], problem.by)[0]
                extra_memory[stage] += float(extra.memory_bytes)
        comm_arr = np.zeros((num_stages, len(costs)))
        if comm is not None:
            comm_arr[: num_stages - 1] = np.asarray(comm, dtype=np.float64).reshape(
                num_stages - 1, len(costs)
            )
        return cls(
            num_stages=num_stages,
            prefix_load=np.concatenate(([0.0], np.cumsum(weights))),
            prefix_memory=np.concatenate(([0.0], np.cumsum(memory))),
            comm=comm_arr,
            extra_load=tuple(extra_load),
            extra_memory=tuple(extra_memory),
            caps=caps,
            slowdown=factors,
        )

    @property
    def num_layers(self) -> int:
        """Number of layers ``n``."""
        return len(self.prefix_load) - 1

    @property
    def homogeneous(self) -> bool:
        """Every stage runs at the reference speed and no link costs anything."""
        return not (self._scaled or self._linked)

    def comm_of(self, stage: int, end: int) -> float:
        """Send time paid by ``stage`` when it ends before layer ``end`` (0 for the last stage)."""
        return float(self.comm[stage, end - 1])

    def load(self, start: int, end: int, stage: int) -> float:
        """Load of ``stage`` owning layers ``start..end-1``."""
        w = self.prefix_load
        work = self.slowdown[stage] * float(w[end] - w[start])
        return (work + self.comm_of(stage, end)) + self.extra_load[stage]

    def loads_of(self, starts: IntArray, ends: IntArray, stages: IntArray) -> FloatArray:
        """Vectorised :meth:`load`: the load of ``stages[k]`` owning ``starts[k]..ends[k]-1`` (same rounding).

        Factors of 1.0 and zero links or extras are skipped, which leaves every value unchanged.
        """
        w = self.prefix_load
        loads: FloatArray = w[ends] - w[starts]
        if self._scaled:
            loads = self._slowdown[stages] * loads
        if self._linked:
            loads = loads + self.comm[stages, ends - 1]
        return loads + self._extra_load[stages]

    def memories_of(self, starts: IntArray, ends: IntArray, stages: IntArray) -> FloatArray:
        """Vectorised :meth:`memory`."""
        m = self.prefix_memory
        result: FloatArray = (m[ends] - m[starts]) + self._extra_memory[stages]
        return result

    def memory(self, start: int, end: int, stage: int) -> float:
        """Bytes ``stage`` needs when owning layers ``start..end-1``."""
        m = self.prefix_memory
        return float(m[end] - m[start]) + self.extra_memory[stage]

    def loads(self, placement: Placement) -> tuple[float, ...]:
        """The load of every stage of ``placement``."""
        b = placement.boundaries
        return tuple(self.load(b[s], b[s + 1], s) for s in range(self.num_stages))

    def memories(self, placement: Placement) -> tuple[float, ...]:
        """The memory of every stage of ``placement``."""
        b = placement.boundaries
        return tuple(self.memory(b[s], b[s + 1], s) for s in range(self.num_stages))

    def overflow(self, placement: Placement) -> tuple[float, int]:
        """The largest memory overflow (bytes over capacity, may be <= 0) and the stage where it happens."""
        over = [m - c for m, c in zip(self.memories(placement), self.caps, strict=True)]
        stage = max(range(len(over)), key=over.__getitem__)
        return over[stage], stage
