"""DynMoCallback: notice that the model changed, measure it, rebalance it, and say what it gained.

Read in this order: the constructor (every knob), then the per-step cycle:

1. ``on_train_batch_start``: apply a decision taken at the end of the previous step (migration happens
   at a step boundary, on every rank), then ask the trigger whether to start a profiling window, then
   start the step's timers.
2. ``on_train_batch_end``: close the step's timers; if the profiling window is complete, gather every
   layer's cost over the pipeline, decide once on the first active rank and broadcast the decision;
   then one small all-gather shares what every rank saw in the step (dynamism events, busy time,
   step time, the cost of a rebalance it just did), so every rank feeds its trigger the same inputs
   and takes the same decisions; finally log.

Everything that decides is in :mod:`lightning_dynmo.balancing.policy` (pure); everything that measures
is in :mod:`lightning_dynmo.profiling` (torch only). This module wires them to Lightning and logs.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torchmetrics.aggregation import MeanMetric
from typing_extensions import override

from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.gain import GainMeter, MeasuredGain, StepPhase
from lightning_dynmo.balancing.hardware import Hardware, scaled, to_reference, worker_slowdown
from lightning_dynmo.balancing.headroom import StageLoadAverage
from lightning_dynmo.balancing.metrics import imbalance
from lightning_dynmo.balancing.microbatches import RetuneOptions
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.policy import (
    BalanceConfig,
    RebalanceDecision,
    decide,
    pipeline_layout,
    resume_plan,
    smooth_costs,
    validate_policy,
)
from lightning_dynmo.balancing.trigger import RebalanceTrigger, TriggerConfig
from lightning_dynmo.callback.control_plane import (
    PositionIndex,
    busy_per_position,
    exchange_events,
    keep_recent,
)
from lightning_dynmo.events import DynamismEvent, EventBus, default_bus
from lightning_dynmo.pipeline import (
    RemoteFailure,
    part_modules,
    retune_candidates,
)
from lightning_dynmo.profiling import (
    LayerProfiler,
    StageBusyTimer,
    inflight_microbatches,
    measure_boundary_comm_s,
)
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.profiling.gather import gather_costs
from lightning_dynmo.profiling.speed import time_reference_workload

log = logging.getLogger(__name__)

# Columns of the per-step all-gather.
_EVENTS, _BUSY, _STEP, _COST = range(4)

#: Every-step windows reuse a layer's activation sizes measured on this rank at most this many steps ago.
ACTIVATION_REFRESH_STEPS = 100
#: Workers whose reference workload runs within this fraction of the fastest count as equally fast.
SPEED_TOLERANCE = 0.05
#: skip_balanced by time: after a decision kept the placement, every-step windows are skipped while no
#: stage's share of the averaged busy time moves by more than this fraction of the busiest stage's share.
SKIP_DRIFT = 0.05


class DynMoCallback(Callback):
    """Profiles, rebalances and reports a pipeline trained with :class:`~lightning_dynmo.DynMoStrategy`.

    Args:
        balancer: ``"partition"`` (exact min-max split; with several stages per rank it balances the
            ranks, :func:`~lightning_dynmo.balancing.partition_workers`), ``"diffusion"`` (iterative
            neighbour moves) or ``"static"`` (never move layers; the callback then only measures and logs).
        cost: What the balancer weighs: ``"time"`` (profiled forward + backward seconds) or
            ``"params"`` (parameter counts).
        every_n_steps: Rebalance every ``n`` optimizer steps; ``None`` disables it.
        on_events: Rebalance at the step after a dynamism event
            (:func:`lightning_dynmo.events.notify_dynamism` on any rank). ``None`` means on for
            ``partition``/``diffusion``, off for ``static``.
        every_step: Rebalance at every step (MoE, MoD), with the profiling window below.
        skip_balanced: With ``every_step`` (and without ``repack``), skip a step's profiling window and
            decision when it cannot change the placement. By ``time``: while the measured per-stage busy
            times, averaged with the ``cost_smoothing`` weight, leave less than ``min_gain`` to gain (no
            placement of the same stages beats ``1 - mean / max`` of the stage loads,
            :mod:`lightning_dynmo.balancing.headroom`); the average restarts at each new placement and
            dynamism event. Also by ``time``, after a decision kept the placement: while no stage's share
            of the averaged busy time moved by more than ``SKIP_DRIFT`` (5%) of the busiest stage's share
            since that decision (whole layers may leave more than ``min_gain`` of headroom that no
            placement recovers; the same loads lead to the same decision). By ``params``: after a
            decision kept the placement, until the next dynamism event (parameter counts change only
            with one). A skipped step costs only the always-on busy timer.
        auto: Rebalance when the measured imbalance of per-stage busy times stays above
            ``auto_threshold`` for ``auto_patience_steps`` steps and the predicted saving over
            ``auto_horizon_steps`` steps exceeds the measured cost of a rebalance; then wait
            ``auto_cooldown_steps`` steps.
        repack: Try to re-pack the layers onto fewer stages within ``max_slowdown``.
        target_num_stages: With ``repack``, the stage count to re-pack onto (``None``: automatic).
        max_slowdown: With ``repack``, the largest accepted predicted step-time increase (fraction).
        memory_capacity_bytes: Per-stage memory cap for the balancer: one number or one per stage.
            ``None`` uses the device's total memory on GPU and no cap on CPU.
        profile_warmup_steps: Steps profiled but not counted at the start of a window; ``None``: 1, or
            0 with ``every_step`` (the extra shape-inference pass of a rebuilt pipeline is scaled away).
        profile_steps: Steps measured per window, layer costs being their per-layer medians; ``None``:
            3, or 1 with ``every_step`` (a window per step: profile, decide, migrate, repeat). Every-step
            windows re-meter saved activations only every ``ACTIVATION_REFRESH_STEPS`` steps (and for a
            layer new on the rank); their sizes follow shapes, and the meter costs a hook per tensor.
        min_gain: A new placement is applied only if predicted at least this much faster (fraction).
        auto_threshold: See ``auto``.
        auto_patience_steps: See ``auto``.
        auto_horizon_steps: See ``auto``.
        auto_cooldown_steps: See ``auto``.
        rebalance_cost_prior_s: The cost assumed for a rebalance before one has been measured.
        cost_smoothing: Weight of the history in an exponential moving average of each layer's measured
            times across profiling windows, in ``[0, 1)``. ``None``: 0.8 with ``every_step`` (one step's
            routing is a noisy sample: act on what persists), 0 otherwise (after an event or a period
            the fresh measurement is the truth). Windows opened by a dynamism event always start fresh.
        measure_comm: Time each stage boundary's activation transfer, link by link, in every window
            (every-step windows reuse the last measurement) and feed it to the balancer: the sending
            stage pays it (single-stage schedules only).
        measure_speed: Time one fixed reference workload on every rank in each window and balance for
            the measured worker speeds: a layer moved to a slower worker costs more there (see
            :mod:`lightning_dynmo.profiling.speed` for why a reference workload). Workers within
            ``SPEED_TOLERANCE`` of the fastest count as equal.
        speed_probe: The reference workload ``(device, dtype) -> seconds`` for ``measure_speed``; ``None``:
            :func:`~lightning_dynmo.profiling.speed.time_reference_workload` (an MLP forward and
            backward). Every rank must run the same work.
        retune_microbatches: With ``repack`` and ``cost="time"``: when a re-pack is applied, re-tune the
            micro-batch count for the smaller pipeline (a divisor of the batch the schedule accepts,
            chosen by the simulator with the measured fixed cost per op and the memory caps; see
            :mod:`lightning_dynmo.balancing.microbatches`). Training stays exactly the same.
        event_bus: The bus to listen on (default: the process-wide bus).
        clock: Seconds from an arbitrary origin; tests inject a fake one.

    The history (``events``, ``rebalances``) keeps the most recent
    :data:`~lightning_dynmo.callback.control_plane.MAX_HISTORY` records each; ``dropped_history`` counts
    the others. Resuming from a checkpoint restores the history and, when the run has the same pipeline
    (schedule, ranks, stages), the saved placement. On another pipeline (other devices or schedule) the
    run keeps its own initial placement and rebalances it after profiling its first steps, without
    re-packing then (:func:`~lightning_dynmo.balancing.policy.resume_plan`); ranks are never released at
    start-up.

    Logged through the Trainer's loggers, at the steps they write (``Trainer(log_every_n_steps=...)``;
    the running means cover every step, and decision metrics appear at the next written step):
    ``dynmo/imbalance`` and ``dynmo/bubble_ratio``
    (measured from per-rank busy times), their running means ``..._avg``, ``dynmo/step_time_s``,
    ``dynmo/stage{s}/busy_s``, ``dynmo/active_workers``, with ``every_step`` ``dynmo/skipped_windows``
    (cumulative, see ``skip_balanced``); after each decision
    ``dynmo/simulated_bubble_ratio``, ``dynmo/predicted_gain``, ``dynmo/profiling_s``, ``dynmo/decision_s``,
    ``dynmo/migration_s``, ``dynmo/overhead_s`` (cumulative), ``dynmo/stage{s}/num_layers``,
    ``dynmo/peak_memory_bytes`` (CUDA: peak allocated in the window; CPU: the process's peak RSS); and
    ``dynmo/measured_gain`` once the new placement has run ``profile_steps`` steps (against the steps
    right before the rebalance, see :mod:`lightning_dynmo.balancing.gain`). One log line per rebalance
    gives the old and new placement text with predicted and then measured gain.
    """

    def __init__(
        self,
        *,
        balancer: str = "partition",
        cost: str = "time",
        every_n_steps: int | None = None,
        on_events: bool | None = None,
        every_step: bool = False,
        skip_balanced: bool = True,
        auto: bool = False,
        repack: bool = False,
        target_num_stages: int | None = None,
        max_slowdown: float = 0.05,
        memory_capacity_bytes: float | Sequence[float] | None = None,
        profile_warmup_steps: int | None = None,
        profile_steps: int | None = None,
        min_gain: float = 0.02,
        auto_threshold: float = 0.10,
        auto_patience_steps: int = 5,
        auto_horizon_steps: int = 500,
        auto_cooldown_steps: int = 50,
        rebalance_cost_prior_s: float = 1.0,
        cost_smoothing: float | None = None,
        measure_comm: bool = True,
        measure_speed: bool = False,
        speed_probe: Callable[[torch.device, torch.dtype], float] | None = None,
        retune_microbatches: bool = False,
        event_bus: EventBus | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if profile_warmup_steps is None:
            profile_warmup_steps = 0 if every_step else 1
        if profile_steps is None:
            profile_steps = 1 if every_step else 3
        if not isinstance(profile_warmup_steps, int) or profile_warmup_steps < 0:
            raise ValueError(f"profile_warmup_steps={profile_warmup_steps!r} must be an integer >= 0.")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"profile_steps={profile_steps!r} must be an integer >= 1.")
        self.balance = BalanceConfig(
            balancer=balancer,
            cost=cost,
            memory_capacity_bytes=memory_capacity_bytes,
            repack=repack,
            target_num_stages=target_num_stages,
            max_slowdown=max_slowdown,
            min_gain=min_gain,
        )
        self.triggers = TriggerConfig(
            every_n_steps=every_n_steps,
            on_events=(balancer != "static") if on_events is None else on_events,
            every_step=every_step,
            auto=auto,
            auto_threshold=auto_threshold,
            auto_patience_steps=auto_patience_steps,
            auto_horizon_steps=auto_horizon_steps,
            auto_cooldown_steps=auto_cooldown_steps,
            rebalance_cost_prior_s=rebalance_cost_prior_s,
        )
        validate_policy(self.balance, self.triggers)
        self.cost_smoothing = (0.8 if every_step else 0.0) if cost_smoothing is None else cost_smoothing
        smooth_costs(None, [], self.cost_smoothing)  # validates the weight now, not at the first window
        if not isinstance(skip_balanced, bool):
            raise ValueError(f"skip_balanced={skip_balanced!r} must be True or False.")
        self.skip_balanced = skip_balanced
        self._stage_loads = StageLoadAverage(self.cost_smoothing)
        self.skipped_windows = 0  # every-step windows skipped by skip_balanced (this run)
        self._params_settled = False  # by params: the last decision kept the placement, no event since
        self.profile_warmup_steps = profile_warmup_steps
        self.profile_steps = profile_steps
        self.measure_comm = measure_comm
        self.measure_speed = measure_speed
        self.retune_microbatches = retune_microbatches
        self._speed_probe = speed_probe or time_reference_workload
        self._bus = event_bus or default_bus()
        self._clock = clock
        self._trigger = RebalanceTrigger(self.triggers, clock)
        # History (kept in checkpoints) and current state.
        self.events: list[DynamismEvent] = []  # the most recent (control_plane.MAX_HISTORY), as rebalances
        self.rebalances: list[dict[str, Any]] = []
        self.dropped_history = {"events": 0, "rebalances": 0}  # records dropped by the cap
        self.placement: str | None = None
        self.overhead_s = 0.0
        self.last_costs: list[LayerCost] | None = None  # on the reference worker (see measure_speed)
        self.last_hardware: Hardware | None = None  # the parts, speeds and links of the last decision
        self._layout: dict[str, Any] | None = None  # the pipeline ``placement`` is for
        self._restored_placement: str | None = None
        self._restored_layout: dict[str, Any] | None = None
        self._resume_window = False  # resumed on another pipeline: profile and rebalance at once
        # Per-run state.
        self._unsubscribe: Callable[[], None] | None = None
        self._new_events: list[DynamismEvent] = []
        self._profiler: LayerProfiler | None = None
        self._window_reason = ""
        self._pending: RebalanceDecision | None = None
        self._pending_costs: dict[str, float] = {}
        self._link_s_per_byte: list[float] | None = None
        # Per local layer or part: (saved-activation bytes, output bytes, step metered); see
        # _known_activations.
        self._activations: dict[int | str, tuple[int, int, int]] = {}
        self._cost_to_share = 0.0
        self._positions: PositionIndex | None = None
        self._last_checked_step = -1
        self._busy: StageBusyTimer | None = None
        self._step_start = 0.0
        self._gain = GainMeter(
            warmup_steps=profile_warmup_steps, measure_steps=profile_steps, history=max(profile_steps, 3)
        )
        self._gain_record: dict[str, Any] | None = None  # the rebalance record the meter is following
        self._step_phase: StepPhase = "quiet"
        self._window_busy_s: list[float] = []  # this rank's busy seconds in the window's measured steps
        self._window_batch: Any = None  # the batch of the step that closes a window, while it closes
        self._window_steps = 0
        self._queued_metrics: dict[str, float] = {}
        self._averages = {
            # The values are agreed across ranks before they are fed, so no sync: torchmetrics would sync
            # over WORLD, which after a re-pack includes ranks that have left.
            name: MeanMetric(sync_on_compute=False)
            for name in ("imbalance", "bubble_ratio", "step_time_s")
        }

    # -- Lightning hooks ----------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

        if not isinstance(trainer.strategy, DynMoStrategy):
            raise TypeError(
                "DynMoCallback drives a DynMoStrategy, but the Trainer uses "
                f"{type(trainer.strategy).__name__}; pass Trainer(strategy=DynMoStrategy(...)) "
                "(or strategy='dynmo')."
            )
        if self._unsubscribe is None:
            self._unsubscribe = self._bus.subscribe(self._new_events.append)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        self._resolve_memory_capacity(strategy.root_device)
        layouts = _repack_layouts(strategy)
        self.balance.check_pipeline(strategy.num_stages, None if layouts is None else list(layouts))
        self._busy = StageBusyTimer(StepClock(strategy.root_device))
        layout = _layout_of(strategy)
        saved = self._restored_placement
        plan = resume_plan(saved, self._restored_layout, layout, self.balance.balancer)
        if plan == "restore" and saved != str(strategy.placement):
            log.info("DynMo: restoring placement %s from the checkpoint", saved)
            strategy.apply_placement(saved)
        elif plan == "repartition":
            log.info(
                "DynMo: the checkpoint's placement %s was for another pipeline (%s); this run (%s) starts "
                "at %s and rebalances it after profiling its first steps",
                saved,
                self._restored_layout,
                layout,
                strategy.placement,
            )
            self._resume_window = True
        self._restored_placement = self._restored_layout = None
        self.placement, self._layout = str(strategy.placement), layout

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        if strategy.stage_index is None:
            return  # a released rank takes no part
        just_applied = self._pending is not None
        if just_applied:
            self._apply_pending(trainer)
            if strategy.is_released:
                return  # this re-pack released the rank: it leaves fit at this batch
        assert self._busy is not None
        self._busy.watch(strategy.pipeline_stages)  # before a window wraps the same stages (LIFO)
        step = trainer.global_step
        if self._profiler is None and step != self._last_checked_step:
            self._last_checked_step = step
            reason = "resume" if self._resume_window else self._trigger.check(step)
            self._resume_window = False
            if reason == "every_step" and self._nothing_to_gain():
                reason = None
                self.skipped_windows += 1
            # Right after a rebalance the trigger has not recorded it yet (that happens once the ranks
            # agree on its cost, at this step's end): its auto cooldown would not hold yet.
            if reason is not None and not (just_applied and reason == "auto"):
                self._open_window(trainer, reason)
        self._busy.begin_step()
        self._step_phase = "quiet"
        if self._profiler is not None:
            self._profiler.begin_step()
            self._window_steps += 1
            self._step_phase = "warmup" if self._window_steps <= self.profile_warmup_steps else "profiled"
        self._step_start = self._clock()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        if strategy.stage_index is None:
            return
        step_s = self._clock() - self._step_start
        assert self._busy is not None
        busy_s = self._busy.end_step()
        if self._step_phase == "profiled" and busy_s is not None:
            self._window_busy_s.append(busy_s)
        if self._profiler is not None and self._profiler.end_step():
            self._window_batch = batch  # its size bounds the micro-batch counts a re-tune may pick
            self._close_window(trainer)
            self._window_batch = None
        self._share_step(trainer, pl_module, busy_s, step_s)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._busy is not None:
            self._busy.unwatch()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "layout": self._layout,
            "events": [e.to_dict() for e in self.events],
            "rebalances": [dict(r) for r in self.rebalances],
            "trigger": self._trigger.state_dict(),
            "overhead_s": self.overhead_s,
            "dropped_history": dict(self.dropped_history),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.placement = state_dict["placement"]
        self._restored_placement = state_dict["placement"]
        self._restored_layout = state_dict.get("layout")
        self.events = [DynamismEvent.from_dict(e) for e in state_dict["events"]]
        self.rebalances = [dict(r) for r in state_dict["rebalances"]]
        self._trigger.load_state_dict(state_dict["trigger"])
        self.overhead_s = float(state_dict["overhead_s"])
        self.dropped_history = dict(state_dict.get("dropped_history", {"events": 0, "rebalances": 0}))
        self.dropped_history["events"] += keep_recent(self.events)
        self.dropped_history["rebalances"] += keep_recent(self.rebalances)

    # -- profiling window -----------------------------------------------------------------------------

    def _nothing_to_gain(self) -> bool:
        """Whether this step's every-step window cannot change the placement (``skip_balanced``).

        Every rank reads the same all-gathered loads and the same broadcast decisions, so every rank
        skips the same steps.
        """
        if not self.skip_balanced or self.balance.repack:
            return False  # a re-pack is judged on its slowdown, not on the imbalance
        if self.balance.cost == "params":
            return self._params_settled
        room = self._stage_loads.headroom
        if room is None:
            return False
        drift = self._stage_loads.drift  # set while the last decision kept the placement on these loads
        return room < self.balance.min_gain or (drift is not None and drift < SKIP_DRIFT)

    def _open_window(self, trainer: pl.Trainer, reason: str) -> None:
        strategy = trainer.strategy
        self._window_reason = reason
        self._profiler = LayerProfiler(
            strategy.local_layers,
            warmup_steps=self.profile_warmup_steps,
            profile_steps=self.profile_steps,
            device=strategy.root_device,
            optimizer=trainer.optimizers[0] if trainer.optimizers else None,
            stages=strategy.pipeline_stages,
            microbatches_per_step=strategy.num_microbatches,
            known_activations=self._known_activations(strategy.local_layers, trainer.global_step, reason),
            parts=part_modules([stage.submod for stage in strategy.pipeline_stages]),
        )
        self._profiler.start()
        self._window_steps = 0
        self._window_busy_s = []
        self._gain.window_opened()
        log.debug("DynMo: profiling window opened at step %d (%s)", trainer.global_step, reason)

    def _known_activations(
        self, layers: Mapping[int, Any], step: int, reason: str
    ) -> dict[int | str, tuple[int, int]]:
        """Activation sizes an every-step window can reuse instead of metering them again.

        Saved-activation sizes follow shapes, not routing, so back-to-back every-step windows reuse what
        an earlier window on this rank measured for the same layer, for up to
        ``ACTIVATION_REFRESH_STEPS`` steps: they then run without the meter's per-tensor hook (which
        would also sit inside the timed forward, as those windows have no warm-up step). Windows opened
        for any other reason (an event, a period, ``auto``) meter every layer.
        """
        if reason != "every_step":
            return {}
        return {
            i: (saved, output)
            for i, (saved, output, metered_at) in self._activations.items()
            if (i in layers or isinstance(i, str)) and step - metered_at < ACTIVATION_REFRESH_STEPS
        }

    def _close_window(self, trainer: pl.Trainer) -> None:
        assert self._profiler is not None
        result = self._profiler.result()
        known = self._profiler.known_activations
        self._profiler = None
        for i, (saved, output) in result.activations().items():
            if i not in known:
                self._activations[i] = (saved, output, trainer.global_step)
        strategy = trainer.strategy
        start = self._clock()
        placement = strategy.placement
        costs, hardware = self._measure(trainer, result)
        self.last_costs, self.last_hardware = costs, hardware
        retune = self._retune_options(trainer, result) if self._retunes else None
        decision = self._decide_once(strategy, costs, placement, hardware, trainer.global_step, retune)
        self._pending = decision
        self._pending_costs = {
            "profiling_s": result.hook_time_s * (result.num_steps + self.profile_warmup_steps),
            "decision_s": self._clock() - start,
        }
        # This rank's measured peak beside the model's per-layer memory (loggers record rank 0's).
        self._queued_metrics["dynmo/peak_memory_bytes"] = float(result.peak.peak_bytes)

    def _measure(self, trainer: pl.Trainer, result: Any) -> tuple[list[LayerCost], Hardware]:
        """Every layer's and part's cost on the reference worker, the worker speeds and the links.

        Collectives over the pipeline group (costs, links) and the active ranks (speeds): every rank.
        """
        strategy = trainer.strategy
        placement, schedule = strategy.placement, strategy.schedule_name
        stages, microbatches = strategy.num_stages, strategy.num_microbatches
        inflight = inflight_microbatches(schedule, 0, stages, microbatches)
        parts = result.part_costs(
            {"first": inflight, "last": inflight_microbatches(schedule, stages - 1, stages, microbatches)}
        )
        gathered = gather_costs(
            result.layer_costs(inflight),
            placement.num_layers,
            strategy.pipeline_group,
            strategy.root_device,
            local_parts=parts,
        )
        costs, first, last = gathered.layers, gathered.first, gathered.last
        slowdown = self._worker_slowdown(trainer) if self.measure_speed else None
        if slowdown is not None:
            workers = _stage_workers(strategy, placement) or list(range(stages))
            costs = to_reference(costs, placement, workers, slowdown)
            first = None if first is None else scaled(first, 1.0 / slowdown[workers[0]])
            last = None if last is None else scaled(last, 1.0 / slowdown[workers[-1]])
        fresh = self._window_reason == "event"
        previous = None if fresh else self.last_costs
        costs = smooth_costs(previous, costs, self.cost_smoothing)
        before = None if fresh or self.last_hardware is None else self.last_hardware
        first = _smooth_part(None if before is None else before.first_stage_extra, first, self.cost_smoothing)
        last = _smooth_part(None if before is None else before.last_stage_extra, last, self.cost_smoothing)
        comm = self._link_times(strategy, costs, placement) if self.measure_comm else None
        self._queue_hardware_metrics(slowdown, comm, placement, strategy.pipeline_size)
        return costs, Hardware(first, last, slowdown, comm)

    @property
    def _retunes(self) -> bool:
        return self.retune_microbatches and self.balance.repack and self.balance.cost == "time"

    def _retune_options(self, trainer: pl.Trainer, result: Any) -> RetuneOptions:
        """The micro-batch counts each re-pack may run, and the measured fixed cost of an op; a collective.

        An op's fixed cost is a rank's busy time in the window's measured steps beyond its own units'
        work and the profiler's hooks, per forward or backward op; the slowest rank's (clamped at 0).
        """
        strategy = trainer.strategy
        batch_size = int(trainer.lightning_module.pipeline_batch(self._window_batch)[0].shape[0])
        units = [*result.layers.values(), *result.parts.values()]
        work_s = sum(p.fwd_time_s + p.bwd_time_s for p in units) + result.hook_time_s
        busy_s = statistics.median(self._window_busy_s) if self._window_busy_s else work_s
        ops = 2 * strategy.num_microbatches * len(strategy.stage_indices)
        mine = torch.tensor(
            [max(0.0, busy_s - work_s) / ops], dtype=torch.float64, device=strategy.root_device
        )
        per_op_s = float(_all_gather_rows(mine, strategy)[:, 0].max())
        schedule, spr = _schedule_spec(strategy), len(strategy.stage_indices)
        layouts = _repack_layouts(strategy)
        stage_counts = list(layouts) if layouts is not None else list(range(1, strategy.num_stages + 1))
        counts = {k: retune_candidates(schedule, k // spr, batch_size) for k in stage_counts}
        self._queued_metrics["dynmo/per_op_s"] = per_op_s
        return RetuneOptions(counts=counts, per_op_s=per_op_s)

    def _worker_slowdown(self, trainer: pl.Trainer) -> list[float] | None:
        """Per pipeline rank, its slowdown against the fastest (``None``: all alike); a collective."""
        strategy = trainer.strategy
        params = list(trainer.lightning_module.parameters())
        dtype = params[0].dtype if params else torch.get_default_dtype()
        seconds = float(self._speed_probe(strategy.root_device, dtype))
        mine = torch.tensor([seconds], dtype=torch.float64, device=strategy.root_device)
        times = _all_gather_rows(mine, strategy)[:, 0].tolist()
        positions = [strategy.pipeline_rank_of(r) for r in strategy.active_ranks]
        return worker_slowdown(times, positions, SPEED_TOLERANCE)

    def _queue_hardware_metrics(
        self, slowdown: list[float] | None, comm: list[list[float]] | None, placement: Placement, ranks: int
    ) -> None:
        if self.measure_speed:
            for rank, factor in enumerate(slowdown or [1.0] * ranks):
                self._queued_metrics[f"dynmo/rank{rank}/slowdown"] = factor
        for link, row in enumerate(comm or []):
            self._queued_metrics[f"dynmo/link{link}/send_s"] = row[placement.layers_of(link)[-1]]

    def _decide_once(
        self,
        strategy: Any,
        costs: list[LayerCost],
        placement: Placement,
        hardware: Hardware,
        trainer_step: int,
        retune: RetuneOptions | None = None,
    ) -> RebalanceDecision:
        # Rank 0 of the active ranks decides; everyone gets the same decision (or the same error).
        source = strategy.active_ranks[0]
        outcome: Any = None
        failure: Exception | None = None
        if strategy.global_rank == source:
            try:
                # After a resume onto another pipeline: re-partition it, never release ranks at once.
                resumed: dict[str, Any] = (
                    {"repack": False, "target_num_stages": None} if self._window_reason == "resume" else {}
                )
                config = dataclasses.replace(
                    self.balance, min_saving=self._min_saving(trainer_step), **resumed
                )
                outcome = decide(
                    config.problem(costs, hardware),
                    placement,
                    config,
                    strategy.num_microbatches,
                    strategy.schedule_name,
                    stage_workers=_stage_workers(strategy, placement),
                    repack_layouts=_repack_layouts(strategy) if self.balance.repack else None,
                    retune=retune,
                )
            except ValueError as err:
                outcome = f"{err}"
            except Exception as err:  # a bug: the others must not wait in the broadcast for a decision
                what = f"the rebalance decision at step {trainer_step}"
                failure, outcome = err, RemoteFailure.of(err, source, what)
                err.add_note(f"DynMo: raised on rank {source} during {what}; every rank stops with it.")
        outcome = strategy.broadcast(outcome, src=source)
        if failure is not None:
            raise failure
        if isinstance(outcome, RemoteFailure):
            outcome.raise_here()
        if isinstance(outcome, str):
            raise ValueError(f"DynMo could not decide a placement: {outcome}")
        assert isinstance(outcome, RebalanceDecision)
        return outcome

    def _min_saving(self, step: int) -> float:
        """Predicted per-step saving a migration must bring: its expected cost over the steps it lasts.

        The expected cost is the mean measured migration time (nothing before the first migration).
        A placement is expected to last ``every_n_steps``, or ``auto_horizon_steps`` for events and
        ``auto``; with ``every_step``, as long as the current one has lasted so far: right after a
        migration the bar is high (noise does not move layers back and forth), and it falls while a
        placement stays.
        """
        if self.balance.cost != "time":
            return 0.0  # the params view has no seconds to compare with
        migrations = [r for r in self.rebalances if r["applied"]]
        if not migrations:
            return 0.0
        if self.triggers.every_step:
            lasts = step - migrations[-1]["step"]
        elif self.triggers.every_n_steps is not None:
            lasts = self.triggers.every_n_steps
        else:
            lasts = self.triggers.auto_horizon_steps
        return statistics.mean(r["migration_s"] for r in migrations) / max(lasts, 1)

    def _link_times(
        self, strategy: Any, costs: list[LayerCost], placement: Placement
    ) -> list[list[float]] | None:
        """Per link, per layer: seconds to send that layer's output over the link (one row per link).

        Each link's seconds per byte are measured with the boundary's activation in every window but
        the every-step ones (they reuse the last measurement, as long as the pipeline has not changed).
        """
        if len(strategy.stage_indices) != 1 or strategy.pipeline_size < 2:
            return None  # virtual stages share ranks: a rank-pair stream does not measure them
        links = placement.num_stages - 1
        stale = self._link_s_per_byte is None or len(self._link_s_per_byte) != links
        if stale or self._window_reason != "every_step":
            last_layers = [placement.layers_of(s)[-1] for s in range(links)]
            sizes = [costs[i].activation_bytes for i in last_layers]
            seconds = measure_boundary_comm_s(sizes, strategy.pipeline_group, strategy.root_device)
            self._link_s_per_byte = [t / max(b, 1) for t, b in zip(seconds, sizes, strict=True)]
        assert self._link_s_per_byte is not None
        return [[c.activation_bytes * per_byte for c in costs] for per_byte in self._link_s_per_byte]

    # -- applying a decision --------------------------------------------------------------------------

    def _apply_pending(self, trainer: pl.Trainer) -> None:
        decision, costs = self._pending, self._pending_costs
        assert decision is not None
        self._pending = None
        strategy = trainer.strategy
        migration_s = 0.0
        if decision.apply:
            self._stage_loads.restart()
            start = self._clock()
            count = decision.num_microbatches
            retuned = {} if count is None else {"num_microbatches": count}  # only a re-tune passes a count
            strategy.apply_placement(decision.proposed, **retuned)
            migration_s = self._clock() - start
        total = costs["profiling_s"] + costs["decision_s"] + migration_s
        self._cost_to_share = total
        self.overhead_s += total
        self.placement, self._layout = str(strategy.placement), _layout_of(strategy)
        record = {
            "step": trainer.global_step,
            "reason": self._window_reason,
            "old": str(decision.current),
            "new": str(decision.proposed),
            "applied": decision.apply,
            "why": decision.reason,
            "predicted_gain": decision.predicted_gain,
            "measured_gain": None,
            "num_microbatches": strategy.num_microbatches,
            **costs,
            "migration_s": migration_s,
        }
        self.rebalances.append(record)
        self.dropped_history["rebalances"] += keep_recent(self.rebalances)
        self._params_settled = not decision.apply  # read only by params (skip_balanced)
        if not decision.apply:
            self._stage_loads.mark()  # by time: skip while the loads stay where this decision saw them
        self._log_decision(trainer, decision, record)
        if decision.apply and self._gain.rebalanced():
            self._gain_record = record

    def _log_decision(self, trainer: pl.Trainer, decision: RebalanceDecision, record: dict[str, Any]) -> None:
        what = "rebalance" if decision.apply else "kept placement"
        line = (
            f"DynMo {what} at step {record['step']} ({record['reason']}): "
            f"{record['old']} -> {record['new']}; "
            f"predicted step {decision.predicted_step_before:.4g} -> {decision.predicted_step_after:.4g} "
            f"({decision.predicted_gain:+.1%}); {decision.reason}; profiling {record['profiling_s']:.3f} s, "
            f"decision {record['decision_s']:.3f} s, migration {record['migration_s']:.3f} s"
        )
        if trainer.global_rank == trainer.strategy.active_ranks[0]:
            log.log(logging.INFO if decision.apply else logging.DEBUG, line)
        metrics = {
            "dynmo/simulated_bubble_ratio": decision.bubble_ratio_after
            if decision.apply
            else decision.bubble_ratio_before,
            "dynmo/predicted_gain": decision.predicted_gain if decision.apply else 0.0,
            "dynmo/profiling_s": record["profiling_s"],
            "dynmo/decision_s": record["decision_s"],
            "dynmo/migration_s": record["migration_s"],
            "dynmo/overhead_s": self.overhead_s,
        }
        placement = trainer.strategy.placement
        metrics.update({f"dynmo/stage{s}/num_layers": float(n) for s, n in enumerate(placement.sizes)})
        self._queued_metrics.update(metrics)

    # -- the per-step exchange --------------------------------------------------------------------------

    def _share_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, busy_s: float | None, step_s: float
    ) -> None:
        strategy = trainer.strategy
        mine = torch.tensor(
            [float(bool(self._new_events)), -1.0 if busy_s is None else busy_s, step_s, self._cost_to_share],
            dtype=torch.float64,
            device=strategy.root_device,
        )
        self._cost_to_share = 0.0
        rows = _all_gather_rows(mine, strategy)
        if rows[:, _EVENTS].any():
            self._exchange_events(strategy)
            self._trigger.notify_event()
            self._params_settled = False  # a dynamism event may change what the balancer reads
        if rows[:, _COST].max() > 0:
            self._trigger.record_rebalance(trainer.global_step, float(rows[:, _COST].max()))
        step_max = float(rows[:, _STEP].max())
        self._follow_measured_gain(trainer, step_max, cost_changed=bool(rows[:, _EVENTS].any()))
        if (rows[:, _BUSY] >= 0).all():
            self._positions = self._positions or PositionIndex(strategy.pipeline_rank_of)
            positions = self._positions.of(strategy.active_ranks)
            stage_busy = busy_per_position(rows[:, _BUSY], positions, strategy.pipeline_size)
            if rows[:, _EVENTS].any():
                self._stage_loads.restart()  # the model changed in this step: its loads are stale
            else:
                self._stage_loads.update(stage_busy)
            if self.triggers.auto and self._profiler is None and self._pending is None:
                self._trigger.observe(stage_busy)  # a window's steps carry hooks and end in a rebalance
            self._log_step(trainer, stage_busy, step_max)

    def _exchange_events(self, strategy: Any) -> None:
        # Only when some rank had an event: one all-gather, then every rank keeps every distinct event.
        mine = [e.to_dict() for e in self._new_events]
        self._new_events.clear()
        with strategy.guard("the dynamism event exchange"):
            shared = exchange_events(mine, strategy.active_group, len(strategy.active_ranks))
        self.events.extend(DynamismEvent.from_dict(e) for e in shared)
        self.dropped_history["events"] += keep_recent(self.events)

    def _follow_measured_gain(self, trainer: pl.Trainer, step_s: float, cost_changed: bool) -> None:
        measured = self._gain.observe(step_s, self._step_phase)
        if cost_changed:
            self._gain.cost_changed()  # after observing: this step ran (mostly) before the change
        if measured is not None and self._gain_record is not None:
            self._report_measured_gain(trainer, self._gain_record, measured)
            self._gain_record = None

    def _report_measured_gain(
        self, trainer: pl.Trainer, record: dict[str, Any], measured: MeasuredGain
    ) -> None:
        record["measured_gain"] = measured.gain
        if trainer.global_rank == trainer.strategy.active_ranks[0]:
            log.info(
                "DynMo rebalance at step %d (%s -> %s): measured step time %.4g s -> %.4g s (%+.1f%%), "
                "predicted %+.1f%%",
                record["step"],
                record["old"],
                record["new"],
                measured.before_s,
                measured.after_s,
                100 * measured.gain,
                100 * record["predicted_gain"],
            )
        self._queued_metrics["dynmo/measured_gain"] = measured.gain

    def _log_step(self, trainer: pl.Trainer, stage_busy: list[float], step_s: float) -> None:
        measured_imbalance = imbalance(stage_busy)
        bubble = max(0.0, 1.0 - sum(stage_busy) / (len(stage_busy) * step_s)) if step_s > 0 else 0.0
        values = {"imbalance": measured_imbalance, "bubble_ratio": bubble, "step_time_s": step_s}
        for name, value in values.items():
            self._averages[name].update(value)
        if not _loggers_write_now(trainer):
            return  # self.log costs about a millisecond per metric: hand them over only when written
        metrics = {f"dynmo/{k}": v for k, v in values.items()}
        for name in values:
            metrics[f"dynmo/{name}_avg"] = float(self._averages[name].compute())
        metrics.update({f"dynmo/stage{s}/busy_s": b for s, b in enumerate(stage_busy)})
        metrics["dynmo/active_workers"] = float(len(trainer.strategy.active_ranks))
        metrics["dynmo/overhead_s"] = self.overhead_s
        if self.triggers.every_step:
            metrics["dynmo/skipped_windows"] = float(self.skipped_windows)
        # Metrics of the decisions and windows since the last written step (the latest value of each).
        metrics.update(self._queued_metrics)
        self._queued_metrics.clear()
        _log(trainer, metrics)

    def _resolve_memory_capacity(self, device: torch.device) -> None:
        if self.balance.memory_capacity_bytes is None and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            self.balance = dataclasses.replace(self.balance, memory_capacity_bytes=float(total))


def _smooth_part(previous: LayerCost | None, measured: LayerCost | None, weight: float) -> LayerCost | None:
    """:func:`smooth_costs` for one pinned part (absent on either side: the measurement)."""
    if previous is None or measured is None:
        return measured
    return smooth_costs([previous], [measured], weight)[0]


def _schedule_spec(strategy: Any) -> Any:
    from lightning_dynmo.pipeline.step.schedule import resolve_schedule

    return resolve_schedule(strategy.schedule_name)


def _stage_workers(strategy: Any, placement: Placement) -> list[int] | None:
    """The pipeline rank of every placement stage when ranks run several (virtual) stages, else None."""
    if placement.num_stages == strategy.pipeline_size:
        return None
    from lightning_dynmo.pipeline.placement.layout import stage_to_pipeline_rank

    style = strategy.stage_style
    return [
        stage_to_pipeline_rank(s, placement.num_stages, strategy.pipeline_size, style)
        for s in range(placement.num_stages)
    ]


def _layout_of(strategy: Any) -> dict[str, Any]:
    return pipeline_layout(strategy.schedule_name, strategy.pipeline_size, strategy.num_stages)


def _repack_layouts(strategy: Any) -> dict[int, list[int]] | None:
    """The pipelines a re-pack may propose when ranks run several stages (``None``: any stage count)."""
    stages_per_rank = strategy.num_stages // strategy.pipeline_size
    if stages_per_rank == 1:
        return None
    from lightning_dynmo.pipeline.placement.release import repack_layouts

    return repack_layouts(
        strategy.schedule_name,
        strategy.stage_style,
        strategy.pipeline_size,
        stages_per_rank,
        strategy.num_microbatches,
    )


def _all_gather_rows(row: torch.Tensor, strategy: Any) -> torch.Tensor:
    """One row per active rank, in ``strategy.active_ranks`` order (a plain collective, no autograd)."""
    if not (dist.is_available() and dist.is_initialized()) or len(strategy.active_ranks) == 1:
        return row.reshape(1, -1).cpu()
    rows = [torch.empty_like(row) for _ in strategy.active_ranks]
    dist.all_gather(rows, row, group=strategy.active_group)
    return torch.stack(rows).cpu()


def _loggers_write_now(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's loggers write at this step (every ``log_every_n_steps``, Lightning decides)."""
    return bool(trainer.loggers) and bool(trainer._logger_connector.should_update_logs)


def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    # Values are agreed across ranks already; Lightning's loggers record rank 0's.
    module = trainer.lightning_module
    for name, value in metrics.items():
        module.log(name, float(value), on_step=True, on_epoch=False)
