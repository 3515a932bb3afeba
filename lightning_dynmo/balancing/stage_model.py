"""What a stage costs: the load and memory of a contiguous run of layers on a given stage (private model).

Read :class:`StageModel` first. It turns per-layer records plus the optional extras into the two numbers
every balancer compares: the *load* of stage ``s`` owning layers ``a..b-1`` and its *memory*.

Model (documented once, used by partition, diffusion and repack alike):

* load(a, b, s) = sum of the layers' weights (``by`` view)
  + ``comm[b-1]`` if ``s`` is not the last stage (the send time of the boundary layer's activation is
  paid by the *sending* stage, which cannot start its next op until the send is done)
  + the first-stage extra's weight if ``s == 0`` + the last-stage extra's weight if ``s`` is the last.
* memory(a, b, s) = sum of the layers' ``memory_bytes`` + the extras' ``memory_bytes`` on their stages.

Loads are always evaluated as ``((W[b] - W[a]) + comm) + extra`` on prefix sums ``W`` so that the scalar
and the vectorised code paths round identically (the exact search relies on that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lightning_dynmo.balancing.costs import LayerCost, layer_weights
from lightning_dynmo.balancing.placement import Placement

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class StageModel:
    """Prefix sums and per-stage extras for one balancing problem with ``num_stages`` stages.

    Attributes:
        num_stages: Number of stages of the placements this model evaluates.
        prefix_load: ``W[i]`` = summed weight of layers ``0..i-1`` (length ``n + 1``).
        prefix_memory: ``M[i]`` = summed ``memory_bytes`` of layers ``0..i-1`` (length ``n + 1``).
        comm: Send time of each layer's output when it ends a non-last stage (length ``n``).
        extra_load: Fixed load added to each stage (first/last-stage extras), length ``num_stages``.
        extra_memory: Fixed bytes added to each stage, length ``num_stages``.
        caps: Memory capacity of each stage in bytes (``inf`` = unlimited), length ``num_stages``.
    """

    num_stages: int
    prefix_load: FloatArray
    prefix_memory: FloatArray
    comm: FloatArray
    extra_load: tuple[float, ...]
    extra_memory: tuple[float, ...]
    caps: tuple[float, ...]

    @classmethod
    def build(
        cls,
        costs: Sequence[LayerCost],
        num_stages: int,
        by: str,
        caps: tuple[float, ...],
        first_stage_extra: LayerCost | None = None,
        last_stage_extra: LayerCost | None = None,
        comm: Sequence[float] | None = None,
    ) -> StageModel:
        """Build the model from validated inputs (see ``partition`` for the meaning of each)."""
        weights = np.asarray(layer_weights(costs, by), dtype=np.float64)
        memory = np.asarray([float(c.memory_bytes) for c in costs], dtype=np.float64)
        extra_load = [0.0] * num_stages
        extra_memory = [0.0] * num_stages
        for stage, extra in ((0, first_stage_extra), (num_stages - 1, last_stage_extra)):
            if extra is not None:
                extra_load[stage] += layer_weights([extra], by)[0]
                extra_memory[stage] += float(extra.memory_bytes)
        comm_arr = np.zeros(len(costs)) if comm is None else np.asarray(comm, dtype=np.float64)
        return cls(
            num_stages=num_stages,
            prefix_load=np.concatenate(([0.0], np.cumsum(weights))),
            prefix_memory=np.concatenate(([0.0], np.cumsum(memory))),
            comm=comm_arr,
            extra_load=tuple(extra_load),
            extra_memory=tuple(extra_memory),
            caps=caps,
        )

    @property
    def num_layers(self) -> int:
        """Number of layers ``n``."""
        return len(self.prefix_load) - 1

    def comm_of(self, stage: int, end: int) -> float:
        """Send time paid by ``stage`` when it ends before layer ``end`` (0 for the last stage)."""
        return 0.0 if stage == self.num_stages - 1 else float(self.comm[end - 1])

    def load(self, start: int, end: int, stage: int) -> float:
        """Load of ``stage`` owning layers ``start..end-1``."""
        w = self.prefix_load
        return (float(w[end] - w[start]) + self.comm_of(stage, end)) + self.extra_load[stage]

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
