"""The per-rank layer profiler: hooks on, W warm-up steps, N measured steps, hooks off, results.

Read :class:`LayerProfiler` first. It drives a :class:`~lightning_dynmo.profiling.layer_timer.LayerTimer`
(times) and an :class:`~lightning_dynmo.profiling.memory.ActivationMeter` (saved activations) over a
window of steps and turns them into :class:`LayerProfile` records, then into ``LayerCost`` records
with :meth:`ProfileResult.layer_costs`. Hooks exist only while a window is open.

The first-stage parts (``"first"``: embedding) and last-stage parts (``"last"``: final norm, head and the
loss) are profiled the same way when given (:func:`~lightning_dynmo.pipeline.part_modules`): a part
made of several modules (the head, then the loss the schedule calls on its output) is their sum.
"""

from __future__ import annotations

import dataclasses
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
from lightning_dynmo.profiling.update import UpdateTimer

log = logging.getLogger(__name__)

#: A profiled unit: a block by global index, or a part by name (``"first"``, ``"last"``).
Unit = int | str


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
        update_time_s: The layer's share of the optimizer update per step
            (:class:`~lightning_dynmo.profiling.update.UpdateTimer`: by its entries with a gradient).
    """

    fwd_time_s: float
    bwd_time_s: float
    bwd_weight_time_s: float
    microbatches_per_step: float
    num_params: int
    memory: LayerMemory
    update_time_s: float = 0.0


@dataclass(frozen=True)
class ProfileResult:
    """A profiling window's results on one rank.

    Attributes:
        layers: One :class:`LayerProfile` per owned layer, by global layer index.
        num_steps: Steps measured.
        step_time_s: Mean wall (CPU) or device (CUDA) seconds per profiled step on this rank.
        hook_time_s: Mean CPU seconds per step spent inside the profiler's own hooks (its overhead).
        peak: The stage's measured peak memory over the window.
        parts: One :class:`LayerProfile` per first/last-stage part this rank ran, by name.
        update_time_s: Median seconds per profiled step of this rank's optimizer update, as measured
            (its shares are the layers' and parts' ``update_time_s``); 0 without an optimizer.
    """

    layers: Mapping[int, LayerProfile]
    num_steps: int
    step_time_s: float
    hook_time_s: float
    peak: PeakMemory
    parts: Mapping[str, LayerProfile] = dataclasses.field(default_factory=dict)
    update_time_s: float = 0.0

    def activations(self) -> dict[Unit, tuple[int, int]]:
        """``(saved-activation bytes, output bytes)`` per micro-batch of each layer and part, for reuse."""
        profiles: dict[Unit, LayerProfile] = {index: profile for index, profile in self.layers.items()}
        profiles.update(self.parts)
        return {
            key: (p.memory.activation_bytes_per_microbatch, p.memory.output_bytes_per_microbatch)
            for key, p in profiles.items()
        }

    def part_costs(self, inflight: Mapping[str, int]) -> dict[str, LayerCost]:
        """``LayerCost`` records of the parts this rank ran (``"first"``, ``"last"``).

        Args:
            inflight: Micro-batches whose activations the part's stage holds at once, by part (the
                first parts are always on stage 0, the last on the last stage).
        """
        return {name: _cost(p, inflight[name]) for name, p in self.parts.items()}

    def layer_costs(self, inflight_microbatches: int) -> dict[int, LayerCost]:
        """``LayerCost`` records of the owned layers.

        Args:
            inflight_microbatches: Micro-batches whose activations a stage holds at once; use the
                worst case over stages (stage 0: see ``inflight_microbatches``) so the figure stays
                valid whichever stage the balancer puts the layer on.
        """
        return {i: _cost(p, inflight_microbatches) for i, p in self.layers.items()}


def _cost(profile: LayerProfile, inflight_microbatches: int) -> LayerCost:
    if inflight_microbatches < 1:
        raise ValueError(f"inflight_microbatches={inflight_microbatches} must be >= 1.")
    return LayerCost(
        fwd_time_s=profile.fwd_time_s,
        bwd_time_s=profile.bwd_time_s,
        bwd_weight_time_s=min(profile.bwd_weight_time_s, profile.bwd_time_s),
        num_params=profile.num_params,
        memory_bytes=profile.memory.total_bytes(inflight_microbatches),
        activation_bytes=profile.memory.output_bytes_per_microbatch,
        update_time_s=profile.update_time_s,
    )


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
        optimizer: Read for per-layer optimizer-state bytes, and its update timed (its step post-hook,
            registered while the window is open; the update's start is :meth:`before_update`).
            Optional: without it no update is timed.
        stages: This rank's ``PipelineStage`` objects; let deferred weight-gradient passes (zero-bubble
            schedules) be timed. Without them, such passes are not seen and backward is undercounted.
        microbatches_per_step: If given, a step in which a layer ran more forward calls than this
            (the first step of a freshly built pipeline also runs shape inference on micro-batch 0)
            has its times scaled down to this many calls.
        known_activations: ``(saved-activation bytes, output bytes)`` per micro-batch of layers (and
            parts) metered in an earlier window (:meth:`ProfileResult.activations`). Those are not
            metered again: windows that follow each other (every-step profiling) then carry no meter
            hook at all.
        parts: The modules that run this rank's first-stage and last-stage parts, by part name
            (:func:`~lightning_dynmo.pipeline.part_modules`); each part is profiled as the sum of
            its modules.

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
        known_activations: Mapping[Unit, tuple[int, int]] | None = None,
        parts: Mapping[str, Sequence[nn.Module]] | None = None,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 (0 disables warm-up).")
        if profile_steps < 1:
            raise ValueError(f"profile_steps={profile_steps} must be >= 1 to measure anything.")
        if not layers and not parts:
            raise ValueError("layers is empty; pass the layers this rank owns, by global index.")
        if microbatches_per_step is not None and microbatches_per_step < 1:
            raise ValueError(f"microbatches_per_step={microbatches_per_step} must be >= 1 or None.")
        self._layers = dict(layers)
        # Every timed module by key: layers by index, part modules as (part name, position).
        parts = parts or {}
        self._part_keys = {name: [(name, k) for k in range(len(mods))] for name, mods in parts.items()}
        self._units: dict[Any, nn.Module] = dict(self._layers)
        for name, mods in parts.items():
            self._units.update({(name, k): m for k, m in enumerate(mods)})
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self._device = torch.device(device)
        self._optimizer = optimizer
        self._stages = tuple(stages)
        self._microbatches = microbatches_per_step
        self._clock = StepClock(self._device)
        self._timer = LayerTimer(self._units, self._clock)
        self._update = UpdateTimer(self._units, optimizer, self._clock)
        self._update_shares: list[dict[Any, float]] = []
        self._update_times_s: list[float] = []
        known = known_activations or {}
        self._known = {key: a for key, a in known.items() if key in self._layers or key in self._part_keys}
        metered = [k for k in self._units if (k[0] if isinstance(k, tuple) else k) not in self._known]
        self._meter = ActivationMeter({k: self._units[k] for k in metered})
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
    def known_activations(self) -> dict[Unit, tuple[int, int]]:
        """The activation sizes this window was given rather than metered (see the constructor)."""
        return dict(self._known)

    @property
    def done(self) -> bool:
        """Whether the window is complete."""
        return len(self._recorded) >= self.profile_steps

    def start(self) -> None:
        """Attach the hooks and open the window."""
        if len(self._known) < len(self._layers) + len(self._part_keys):
            self._meter.attach()
        self._timer.attach(self._stages)
        self._update.attach()
        reset_peak_memory(self._device)

    def stop(self) -> None:
        """Remove every hook (safe to call twice, and called by ``end_step`` once the window is done)."""
        self._timer.detach()
        self._meter.detach()
        self._update.detach()

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

    def before_update(self) -> None:
        """Call when the optimizer is about to update (the step's forward and backward are done)."""
        self._update.before_update()

    def end_step(self) -> bool:
        """Call right after the step (after backward and any deferred weight pass); True once done."""
        if self._step_start is None:
            raise RuntimeError("LayerProfiler.end_step() without begin_step().")
        step_end = self._clock.mark()
        times = self._timer.end_step()  # synchronises once on CUDA, so step_end is resolved too
        update_s, update_shares = self._update.end_step()  # its marks came before step_end
        self._steps_seen += 1
        if self._steps_seen == 1 and self.warmup_steps >= 1:
            # Saved-activation sizes depend only on shapes: one metered step is enough, and the meter's
            # pack hook runs inside each layer's forward, so it must not be there while times are taken.
            self._meter.detach()
        if self._steps_seen > self.warmup_steps:
            self._recorded.append(times)
            self._update_shares.append(update_shares)
            self._update_times_s.append(update_s)
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
        parts = {name: self._part_profile(name, keys, n) for name, keys in self._part_keys.items()}
        assert self._peak is not None
        result = ProfileResult(
            layers=layers,
            num_steps=n,
            step_time_s=sum(self._step_times_s) / n,
            hook_time_s=sum(self._hook_times_s) / n,
            peak=self._peak,
            parts=parts,
            update_time_s=statistics.median(self._update_times_s),
        )
        log.debug("profiled %d layers over %d steps: %s", len(layers), n, result)
        return result

    def _normalised(self, t: StepLayerTime) -> StepLayerTime:
        m = self._microbatches
        if m is None or t.num_calls <= m:
            return t
        scale = m / t.num_calls
        return StepLayerTime(t.fwd_time_s * scale, t.bwd_time_s * scale, t.bwd_weight_time_s * scale, m)

    def _part_profile(self, name: str, keys: Sequence[Any], n: int) -> LayerProfile:
        """A part's profile: the sum of its modules' (the head, then the loss), per step and medians."""
        profiles = [self._layer_profile(key, n, self._known.get(name)) for key in keys]
        saved = sum(p.memory.activation_bytes_per_microbatch for p in profiles)
        output = profiles[-1].memory.output_bytes_per_microbatch
        if name in self._known:  # the part's known figures are its totals, not its modules'
            saved, output = self._known[name]
        return LayerProfile(
            fwd_time_s=sum(p.fwd_time_s for p in profiles),
            bwd_time_s=sum(p.bwd_time_s for p in profiles),
            bwd_weight_time_s=sum(p.bwd_weight_time_s for p in profiles),
            microbatches_per_step=profiles[0].microbatches_per_step,
            num_params=sum(p.num_params for p in profiles),
            update_time_s=sum(p.update_time_s for p in profiles),
            memory=LayerMemory(
                param_bytes=sum(p.memory.param_bytes for p in profiles),
                grad_bytes=sum(p.memory.grad_bytes for p in profiles),
                optimizer_state_bytes=sum(p.memory.optimizer_state_bytes for p in profiles),
                activation_bytes_per_microbatch=saved,
                output_bytes_per_microbatch=output,
            ),
        )

    def _layer_profile(self, index: Any, n: int, known: tuple[int, int] | None = None) -> LayerProfile:
        steps = [self._normalised(r[index]) for r in self._recorded]
        params, grads, optim = static_memory(self._units[index], self._optimizer)
        if known is None and index in self._known:
            known = self._known[index]
        saved, output = known if known is not None else self._meter.per_microbatch(index)
        return LayerProfile(
            fwd_time_s=statistics.median(s.fwd_time_s for s in steps),
            bwd_time_s=statistics.median(s.bwd_time_s for s in steps),
            bwd_weight_time_s=statistics.median(s.bwd_weight_time_s for s in steps),
            microbatches_per_step=sum(s.num_calls for s in steps) / n,
            num_params=count_nonzero_params(self._units[index]),
            update_time_s=statistics.median(u[index] for u in self._update_shares),
            memory=LayerMemory(
                param_bytes=params,
                grad_bytes=grads,
                optimizer_state_bytes=optim,
                activation_bytes_per_microbatch=saved,
                output_bytes_per_microbatch=output,
            ),
        )
