"""Per-layer profiling inside real pipeline steps (torch only, no lightning).

- :mod:`.profiler`: :class:`LayerProfiler`, forward/backward time and memory of a rank's layers over a
  window (hooks on, warm-up steps, measured steps, hooks off).
- :mod:`.layer_timer`: per-layer forward and backward time measured inside a real schedule step.
- :mod:`.update`: the optimizer update's own clock in a window, shared among the units by the parameter
  entries that got a gradient.
- :mod:`.clock`: time stamps for profiling hooks that never stall the device.
- :mod:`.memory`: the per-layer memory model and the measured per-stage peak
  (:func:`inflight_microbatches`: how many micro-batches' activations a stage holds under a schedule).
- :mod:`.gather`: :func:`gather_layer_costs`, all ranks' records, identical on every rank of the pipeline.
- :mod:`.comm`: :func:`measure_boundary_comm_s`, the time to send each stage boundary's activation.
- :mod:`.speed`: how fast each rank computes, from one fixed reference workload.
- :mod:`.stage_timer`: :class:`StageBusyTimer`, the cheap always-on per-rank busy time behind automatic
  triggering.
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
