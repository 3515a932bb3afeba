"""The per-rank layer profiler: hooks on, W warm-up steps, N measured steps, hooks off, results.

Read :class:`LayerProfiler` first. It drives a :class:`~lightning_dynmo.profiling.layer_timer.LayerTimer`
(times) and an :class:`~lightning_dynmo.profiling.memory.ActivationMeter` (saved activations) over a
window of steps and turns them into :class:`LayerProfile` records, then into ``LayerCost`` records
with :meth:`ProfileResult.layer_costs`. Hooks exist only while a window is open.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.profiling.clock import Mark, StepClock
from lightning_dynmo.profiling.layer_timer import LayerTimer, StepLayerTime
from lightning_dynmo.profiling.memory import (
    ActivationMeter,
    LayerMemory,
    PeakMemory,
    count_nonzero_params,
    peak_memory,
    reset_peak_memory,
    static_memory,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerProfile:
    """What one layer cost per training step: the median over the profiled steps.

    The median, not the mean: a step in which the OS or a neighbour process pre-empted us should not
    move layers.

    Attributes:
        fwd_time_s: Forward seconds per training step (all micro-batches).
        bwd_time_s: Backward seconds per training step, deferred weight gradients included.
        bwd_weight_time_s: The part of ``bwd_time_s`` spent in deferred weight-gradient passes.
        microbatches_per_step: Forward calls per step.
        num_params: Non-zero parameter entries.
        memory: The layer's memory, split by kind.
    """

    fwd_time_s: float
    bwd_time_s: float
    bwd_weight_time_s: float
    microbatches_per_step: float
    num_params: int
    memory: LayerMemory


@dataclass(frozen=True)
class ProfileResult:
    """A profiling window's results on one rank.

    Attributes:
        layers: One :class:`LayerProfile` per owned layer, by global layer index.
        num_steps: Steps measured.
        step_time_s: Mean wall (CPU) or device (CUDA) seconds per profiled step on this rank.
        hook_time_s: Mean CPU seconds per step spent inside the profiler's own hooks (its overhead).
        peak: The stage's measured peak memory over the window.
    """

    layers: Mapping[int, LayerProfile]
    num_steps: int
    step_time_s: float
    hook_time_s: float
    peak: PeakMemory

    def activations(self) -> dict[int, tuple[int, int]]:
        """``(saved-activation bytes, output bytes)`` per micro-batch of each layer, for reuse."""
        return {
            i: (p.memory.activation_bytes_per_microbatch, p.memory.output_bytes_per_microbatch)
            for i, p in self.layers.items()
        }

    def layer_costs(self, inflight_microbatches: int) -> dict[int, LayerCost]:
        """``LayerCost`` records of the owned layers.

        Args:
            inflight_microbatches: Micro-batches whose activations a stage holds at once; use the
                worst case over stages (stage 0: see ``inflight_microbatches``) so the figure stays
                valid whichever stage the balancer puts the layer on.
        """
        if inflight_microbatches < 1:
            raise ValueError(f"inflight_microbatches={inflight_microbatches} must be >= 1.")
        return {
            i: LayerCost(
                fwd_time_s=p.fwd_time_s,
                bwd_time_s=p.bwd_time_s,
                num_params=p.num_params,
                memory_bytes=p.memory.total_bytes(inflight_microbatches),
                activation_bytes=p.memory.output_bytes_per_microbatch,
            )
            for i, p in self.layers.items()
        }


class LayerProfiler:
    """Profile the layers one rank owns over a window of training steps.

    Args:
        layers: The rank's layers by global index (``strategy.local_layers``).
        warmup_steps: Steps run with hooks on but not recorded (the first step after a rebuild also
            runs the pipeline's shape inference, which must not be counted). Saved activations are
            metered on the window's first step only; with ``warmup_steps >= 1`` that step is not timed,
            so the meter's per-tensor hook never inflates a recorded forward time.
        profile_steps: Steps measured (per-layer figures are their median).
        device: The stage's device; ``cuda`` uses CUDA events and the CUDA peak-memory counter.
        optimizer: Read for per-layer optimizer-state bytes (optional).
        stages: This rank's ``PipelineStage`` objects; let deferred weight-gradient passes (zero-bubble
            schedules) be timed. Without them, such passes are not seen and backward is undercounted.
        microbatches_per_step: If given, a step in which a layer ran more forward calls than this
            (the first step of a freshly built pipeline also runs shape inference on micro-batch 0)
            has its times scaled down to this many calls.
        known_activations: ``(saved-activation bytes, output bytes)`` per micro-batch of layers metered
            in an earlier window (:meth:`ProfileResult.activations`). Those layers are not metered again:
            windows that follow each other (every-step profiling) then carry no meter hook at all.

    Example::

        profiler = LayerProfiler(layers, warmup_steps=1, profile_steps=3)
        profiler.start()
        while not profiler.done:
            profiler.begin_step(); run_one_training_step(); profiler.end_step()
        result = profiler.result()   # hooks are already gone
    """

    def __init__(
        self,
        layers: Mapping[int, nn.Module],
        *,
        warmup_steps: int = 1,
        profile_steps: int = 3,
        device: torch.device | str = "cpu",
        optimizer: torch.optim.Optimizer | None = None,
        stages: Sequence[Any] = (),
        microbatches_per_step: int | None = None,
        known_activations: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 (0 disables warm-up).")
        if profile_steps < 1:
            raise ValueError(f"profile_steps={profile_steps} must be >= 1 to measure anything.")
        if not layers:
            raise ValueError("layers is empty; pass the layers this rank owns, by global index.")
        if microbatches_per_step is not None and microbatches_per_step < 1:
            raise ValueError(f"microbatches_per_step={microbatches_per_step} must be >= 1 or None.")
        self._layers = dict(layers)
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self._device = torch.device(device)
        self._optimizer = optimizer
        self._stages = tuple(stages)
        self._microbatches = microbatches_per_step
        self._clock = StepClock(self._device)
        self._timer = LayerTimer(self._layers, self._clock)
        self._known = {i: a for i, a in (known_activations or {}).items() if i in self._layers}
        self._meter = ActivationMeter({i: m for i, m in self._layers.items() if i not in self._known})
        self._steps_seen = 0
        self._recorded: list[dict[int, StepLayerTime]] = []
        self._step_times_s: list[float] = []
        self._hook_times_s: list[float] = []
        self._step_start: Mark | None = None
        self._meter_hook_time0 = 0.0
        self._peak: PeakMemory | None = None

    @property
    def active(self) -> bool:
        """Whether hooks are attached."""
        return self._timer.attached

    @property
    def known_activations(self) -> dict[int, tuple[int, int]]:
        """The activation sizes this window was given rather than metered (see the constructor)."""
        return dict(self._known)

    @property
    def done(self) -> bool:
        """Whether the window is complete."""
        return len(self._recorded) >= self.profile_steps

    def start(self) -> None:
        """Attach the hooks and open the window."""
        if len(self._known) < len(self._layers):
            self._meter.attach()
        self._timer.attach(self._stages)
        reset_peak_memory(self._device)

    def stop(self) -> None:
        """Remove every hook (safe to call twice, and called by ``end_step`` once the window is done)."""
        self._timer.detach()
        self._meter.detach()

    def __enter__(self) -> LayerProfiler:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def begin_step(self) -> None:
        """Call right before a training step."""
        if not self.active:
            raise RuntimeError("LayerProfiler.begin_step() before start() (or after the window closed).")
        self._timer.begin_step()
        self._meter_hook_time0 = self._meter.hook_time_s
        self._step_start = self._clock.mark()

    def end_step(self) -> bool:
        """Call right after the step (after backward and any deferred weight pass); True once done."""
        if self._step_start is None:
            raise RuntimeError("LayerProfiler.end_step() without begin_step().")
        step_end = self._clock.mark()
        times = self._timer.end_step()  # synchronises once on CUDA, so step_end is resolved too
        self._steps_seen += 1
        if self._steps_seen == 1 and self.warmup_steps >= 1:
            # Saved-activation sizes depend only on shapes: one metered step is enough, and the meter's
            # pack hook runs inside each layer's forward, so it must not be there while times are taken.
            self._meter.detach()
        if self._steps_seen > self.warmup_steps:
            self._recorded.append(times)
            self._step_times_s.append(self._clock.elapsed_s(self._step_start, step_end))
            meter_time = self._meter.hook_time_s - self._meter_hook_time0
            self._hook_times_s.append(self._timer.hook_time_s + meter_time)
        self._step_start = None
        if self.done:
            self._peak = peak_memory(self._device)
            self.stop()
        return self.done

    def result(self) -> ProfileResult:
        """The window's per-layer medians and mean step time; raises if the window is not complete."""
        if not self.done:
            raise RuntimeError(
                f"profiling window incomplete: {len(self._recorded)} of {self.profile_steps} steps recorded."
            )
        n = len(self._recorded)
        layers = {i: self._layer_profile(i, n) for i in self._layers}
        assert self._peak is not None
        result = ProfileResult(
            layers=layers,
            num_steps=n,
            step_time_s=sum(self._step_times_s) / n,
            hook_time_s=sum(self._hook_times_s) / n,
            peak=self._peak,
        )
        log.debug("profiled %d layers over %d steps: %s", len(layers), n, result)
        return result

    def _normalised(self, t: StepLayerTime) -> StepLayerTime:
        m = self._microbatches
        if m is None or t.num_calls <= m:
            return t
        scale = m / t.num_calls
        return StepLayerTime(t.fwd_time_s * scale, t.bwd_time_s * scale, t.bwd_weight_time_s * scale, m)

    def _layer_profile(self, index: int, n: int) -> LayerProfile:
        steps = [self._normalised(r[index]) for r in self._recorded]
        params, grads, optim = static_memory(self._layers[index], self._optimizer)
        saved, output = self._known[index] if index in self._known else self._meter.per_microbatch(index)
        return LayerProfile(
            fwd_time_s=statistics.median(s.fwd_time_s for s in steps),
            bwd_time_s=statistics.median(s.bwd_time_s for s in steps),
            bwd_weight_time_s=statistics.median(s.bwd_weight_time_s for s in steps),
            microbatches_per_step=sum(s.num_calls for s in steps) / n,
            num_params=count_nonzero_params(self._layers[index]),
            memory=LayerMemory(
                param_bytes=params,
                grad_bytes=grads,
                optimizer_state_bytes=optim,
                activation_bytes_per_microbatch=saved,
                output_bytes_per_microbatch=output,
            ),
        )
