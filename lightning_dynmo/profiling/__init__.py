"""Per-layer profiling inside real pipeline steps (torch only, no lightning).

- :class:`LayerProfiler`: forward/backward time and memory of the layers one rank owns, over a window.
- :func:`gather_layer_costs`: all ranks' records, identical on every rank of the pipeline group.
- :func:`measure_boundary_comm_s`: time to send each stage boundary's activation.
- :func:`inflight_microbatches`: how many micro-batches' activations a stage holds under a schedule.
- :class:`StageBusyTimer`: the cheap always-on per-rank busy time that feeds automatic triggering.
"""

from lightning_dynmo.profiling.comm import measure_boundary_comm_s
from lightning_dynmo.profiling.gather import gather_layer_costs
from lightning_dynmo.profiling.layer_timer import LayerTimer, StepLayerTime, module_has_hooks
from lightning_dynmo.profiling.memory import (
    LayerMemory,
    PeakMemory,
    inflight_microbatches,
    optimizer_state_bytes,
)
from lightning_dynmo.profiling.profiler import LayerProfile, LayerProfiler, ProfileResult
from lightning_dynmo.profiling.stage_timer import StageBusyTimer

__all__ = [
    "LayerMemory",
    "LayerProfile",
    "LayerProfiler",
    "LayerTimer",
    "PeakMemory",
    "ProfileResult",
    "StageBusyTimer",
    "StepLayerTime",
    "gather_layer_costs",
    "inflight_microbatches",
    "measure_boundary_comm_s",
    "module_has_hooks",
    "optimizer_state_bytes",
]
