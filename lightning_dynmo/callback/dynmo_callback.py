"""DynMoCallback: notice that the model changed, measure it, rebalance it, and say what it gained.

Read in this order: the constructor (every knob; the grouped ones in
:mod:`~lightning_dynmo.callback.config`), then the per-step cycle:

1. ``on_train_batch_start``: apply a decision taken at the end of the previous step (migration happens
   at a step boundary, on every rank), then ask the trigger whether to start a profiling window
   (:mod:`.window`), then start the step's timers.
2. ``on_train_batch_end``: close the step's timers; if the profiling window is complete, assemble every
   layer's cost over the pipeline (:mod:`.measure`), decide once on the first active rank and broadcast
   the decision; then one small exchange of rows shares what every rank saw in the step (dynamism
   events, busy time, step time, the cost of a rebalance it just did), so every rank feeds its trigger
   the same inputs and takes the same decisions; finally log. Decisions and their measured gain go to
   :mod:`.history`.

Everything that decides is in :mod:`lightning_dynmo.balancing.policy` (pure); everything that measures
is in :mod:`lightning_dynmo.profiling` (torch only). This module wires them to Lightning and logs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.gain import GainMeter, MeasuredGain, StepPhase
from lightning_dynmo.balancing.hardware import Hardware
from lightning_dynmo.balancing.metrics import imbalance
from lightning_dynmo.balancing.microbatches import RetuneOptions
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.policy import (
    BalanceConfig,
    RebalanceDecision,
    decide,
    decision_shapes,
    resume_plan,
    validate_policy,
)
from lightning_dynmo.balancing.trigger import RebalanceTrigger, TriggerConfig
from lightning_dynmo.balancing.trust import PredictionTrust
from lightning_dynmo.callback.averages import StepAverages
from lightning_dynmo.callback.config import (
    AutoConfig,
    ProfilingConfig,
    RepackConfig,
    refuse_moved_keywords,
    switched,
)
from lightning_dynmo.callback.control_plane import EventInbox, PositionIndex, exchange_events, exchange_rows
from lightning_dynmo.callback.decision import DecisionRunner
from lightning_dynmo.callback.history import DecisionRecord, RebalanceHistory, WindowOverhead
from lightning_dynmo.callback.measure import CostMeter
from lightning_dynmo.callback.window import ProfilingWindow, window_reason
from lightning_dynmo.events import DynamismEvent, EventBus, default_bus
from lightning_dynmo.pipeline import schedule_order
from lightning_dynmo.profiling import ProfileResult, StageBusyTimer
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy
from lightning_dynmo.strategy.view import PipelineView

log = logging.getLogger(__name__)

# Columns of the per-step rows (control_plane.exchange_rows); _EVENTS: the byte length of the new events.
# _READY: the deciding rank has a background decision's outcome to broadcast. _MID_STEP: one of the rank's
# events came while its stages computed (control_plane.EventInbox).
_EVENTS, _BUSY, _STEP, _COST, _SIGTERM, _READY, _MID_STEP = range(7)


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
            decision when it cannot change the placement (by ``time``, after a first decision, also an
            event's, judged on the step after it). By ``time``: while the per-stage busy times, averaged
            with the ``profiling.cost_smoothing`` weight (restarted at each new placement and event),
            leave less than ``min_gain`` to gain: no placement beats ``1 - mean / max`` of the loads, nor
            brings the busiest rank below a rank that runs only end stages of one layer each (in ZBV's
            V, the first rank; :mod:`lightning_dynmo.balancing.headroom`). After a decision kept the
            placement: while no stage's share of the averaged busy time moved by more than
            ``SKIP_DRIFT`` (5%) of the busiest stage's share since (whole layers may leave headroom that
            no placement recovers; the same loads lead to the same decision); after one moved layers,
            while the shares stay that close to the ones it predicted, or, once its measured gain
            confirmed it (``trust``'s ``delivered_share``), to the ones it achieved. A window also waits
            for one step's loads (at the start, after a move, after an event that came while the stages
            computed; one published before they computed, as the dynamism callbacks publish at a step's
            first batch, is judged on its own step). By ``params``: after a decision kept the placement,
            until the next dynamism event (parameter counts change only with one). A skipped step costs
            only the always-on busy timer.
        auto: ``True`` or an :class:`~lightning_dynmo.callback.config.AutoConfig`: rebalance when the
            measured imbalance of per-stage busy times stays above ``threshold`` for ``patience_steps``
            steps and the predicted saving over ``horizon_steps`` steps exceeds the measured cost of a
            rebalance; then wait ``cooldown_steps`` steps. ``False``: off.
        repack: ``True`` or a :class:`~lightning_dynmo.callback.config.RepackConfig`: try to re-pack the
            layers onto fewer stages (``target_num_stages``) within ``max_slowdown``, optionally re-tuning
            the micro-batch count. ``False``: off.
        memory_capacity_bytes: Per-stage memory cap for the balancer: one number or one per stage.
            ``None`` uses the device's total memory on GPU and no cap on CPU.
        min_gain: A new placement is applied only if predicted at least this much faster (fraction);
            more once moves have missed their predictions (see ``trust`` below).
        profiling: How windows measure and decide (:class:`~lightning_dynmo.callback.config.ProfilingConfig`:
            warm-up and measured steps, cost smoothing, link and worker-speed measurement, the search in
            the background).
        event_bus: The bus to listen on (default: the process-wide bus).
        clock: Seconds from an arbitrary origin; tests inject a fake one.

    Raises:
        TypeError: a flat constructor's keyword of earlier versions (``auto_threshold=``, ``profile_steps=``,
            ...): the message names its new place (:data:`~lightning_dynmo.callback.config.MOVED_KEYWORDS`).

    The history (``events``, ``rebalances``) keeps the most recent
    :data:`~lightning_dynmo.callback.control_plane.MAX_HISTORY` records each; ``dropped_history`` counts the
    others. Resuming from a checkpoint restores the history and, when the run has the same pipeline (schedule,
    ranks, stages), the saved placement. On another pipeline (other devices or schedule) the run keeps its own
    initial placement and rebalances it after profiling its first steps, without re-packing then
    (:func:`~lightning_dynmo.balancing.policy.resume_plan`); ranks are never released at start-up.

    Logged through the Trainer's loggers, at the steps they write (``Trainer(log_every_n_steps=...)``; the
    running means cover every step, and decision metrics appear at the next written step): ``dynmo/imbalance``
    and ``dynmo/bubble_ratio`` (measured from per-rank busy times), their running means ``..._avg``,
    ``dynmo/step_time_s``, ``dynmo/stage{s}/busy_s``, ``dynmo/active_workers``, with ``every_step``
    ``dynmo/skipped_windows`` (cumulative, see ``skip_balanced``); after each decision
    ``dynmo/simulated_bubble_ratio``, ``dynmo/predicted_gain``, ``dynmo/profiling_s``, ``dynmo/decision_s``,
    ``dynmo/migration_s``, ``dynmo/overhead_s`` (cumulative), ``dynmo/stage{s}/num_layers``,
    ``dynmo/peak_memory_bytes`` (CUDA: peak allocated in the window; CPU: the process's peak RSS); and
    ``dynmo/measured_gain`` once the new placement has run ``profiling.steps`` steps (against the steps right
    before the rebalance, see :mod:`lightning_dynmo.balancing.gain`). One log line per rebalance gives the old
    and new placement text with predicted and then measured gain.

    ``trust`` (a :class:`~lightning_dynmo.balancing.trust.PredictionTrust`, attribute) compares each move's
    measured gain with its prediction: after 2 moves in a row that delivered less than half of it, a move
    must be predicted faster by ``min_gain`` plus their mean shortfall; after 3, DynMo stops moving for
    the rest of the job. Each change is said in one log line. To change the rules, assign
    ``callback.trust = PredictionTrust(TrustConfig(...))`` before training.
    """

    @refuse_moved_keywords
    def __init__(
        self,
        *,
        balancer: str = "partition",
        cost: str = "time",
        every_n_steps: int | None = None,
        on_events: bool | None = None,
        every_step: bool = False,
        skip_balanced: bool = True,
        auto: bool | AutoConfig = False,
        repack: bool | RepackConfig = False,
        memory_capacity_bytes: float | Sequence[float] | None = None,
        min_gain: float = 0.02,
        profiling: ProfilingConfig = ProfilingConfig(),  # noqa: B008  # frozen: safe to share
        event_bus: EventBus | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        auto_config = switched("auto", auto, AutoConfig())
        repack_config = switched("repack", repack, RepackConfig())
        self.balance = BalanceConfig(
            balancer=balancer,
            cost=cost,
            memory_capacity_bytes=memory_capacity_bytes,
            repack=repack_config is not None,
            target_num_stages=None if repack_config is None else repack_config.target_num_stages,
            max_slowdown=(repack_config or RepackConfig()).max_slowdown,
            min_gain=min_gain,
        )
        self.triggers = TriggerConfig(
            every_n_steps=every_n_steps,
            on_events=(balancer != "static") if on_events is None else on_events,
            every_step=every_step,
            auto=auto_config,
        )
        validate_policy(self.balance, self.triggers)
        if not isinstance(skip_balanced, bool):
            raise ValueError(f"skip_balanced={skip_balanced!r} must be True or False.")
        self.skip_balanced = skip_balanced
        self.trust = PredictionTrust()
        self.profiling = profiling.resolved(every_step)
        self.retune_microbatches = repack_config is not None and repack_config.retune_microbatches
        self._decisions = DecisionRunner(self.profiling.background_decisions)
        assert self.profiling.warmup_steps is not None and self.profiling.steps is not None
        assert self.profiling.cost_smoothing is not None
        self._bus = event_bus or default_bus()
        self._clock = clock
        self._trigger = RebalanceTrigger(self.triggers, clock)
        self._window = ProfilingWindow(
            warmup_steps=self.profiling.warmup_steps,
            steps=self.profiling.steps,
            smoothing=self.profiling.cost_smoothing,
            # a re-pack is judged on its slowdown, not on the imbalance
            skip=skip_balanced and not self.balance.repack,
            by_params=self.balance.cost == "params",
            min_gain=min_gain,
        )
        self._queued_metrics: dict[str, float] = {}
        self._meter = CostMeter(self.profiling, self._queued_metrics)
        steps = self.profiling.steps
        self._gain = GainMeter(
            warmup_steps=self.profiling.warmup_steps, measure_steps=steps, history=max(steps, 3)
        )
        self._history = RebalanceHistory(self._gain)  # kept in checkpoints
        self.placement: Placement | None = None
        self._layout: dict[str, Any] | None = None  # the pipeline ``placement`` is for
        self._restored_placement: str | None = None
        self._restored_layout: dict[str, Any] | None = None
        self._resume_window = False  # resumed on another pipeline: profile and rebalance at once
        # Per-run state.
        self._unsubscribe: Callable[[], None] | None = None
        self._inbox = EventInbox()
        self._pending: RebalanceDecision | None = None
        self._pending_overhead = WindowOverhead()  # what the pending decision's window cost
        self._pending_per_op_s = 0.0  # the runtime's cost per action its predictions included
        self._cost_to_share = 0.0
        self._positions: PositionIndex | None = None
        self._last_checked_step = -1
        self._busy: StageBusyTimer | None = None
        self._step_start = 0.0
        self._step_phase: StepPhase = "quiet"
        self._averages = StepAverages(("imbalance", "bubble_ratio", "step_time_s"))

    # -- what users and tests read ------------------------------------------------------------------

    @property
    def events(self) -> list[DynamismEvent]:
        """The most recent dynamism events (every rank's, agreed)."""
        return self._history.events

    @property
    def rebalances(self) -> list[DecisionRecord]:
        """The most recent decisions, applied or kept."""
        return self._history.rebalances

    @property
    def dropped_history(self) -> dict[str, int]:
        """Events and decisions dropped by the history's cap."""
        return self._history.dropped

    @property
    def overhead_s(self) -> float:
        """Profiling, decision and migration seconds of every decision so far."""
        return self._history.overhead_s

    @property
    def skipped_windows(self) -> int:
        """Windows (every-step and event) skipped by ``skip_balanced`` (this run)."""
        return self._window.skipped

    @property
    def last_costs(self) -> list[LayerCost] | None:
        """The costs of the last decision, on the reference worker (see ``measure_speed``)."""
        return self._meter.last_costs

    @property
    def last_hardware(self) -> Hardware | None:
        """The parts, speeds and links of the last decision."""
        return self._meter.last_hardware

    # -- Lightning hooks ----------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, DynMoStrategy):
            raise TypeError(
                "DynMoCallback drives a DynMoStrategy, but the Trainer uses "
                f"{type(trainer.strategy).__name__}; pass Trainer(strategy=DynMoStrategy(...)) "
                "(or strategy='dynmo')."
            )
        if self._unsubscribe is None:
            self._unsubscribe = self._bus.subscribe(self._inbox.add)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = _strategy(trainer)
        view = strategy.pipeline_view()
        self._resolve_memory_capacity(view.root_device)
        layouts = view.repack_layouts()
        self.balance.check_pipeline(view.num_stages, None if layouts is None else list(layouts))
        self._busy = busy = StageBusyTimer(StepClock(view.root_device))
        self._inbox.computing = lambda: busy.ran
        if view.global_rank == view.active_ranks[0]:
            self._decisions.warm()  # the deciding rank's helper process, if any, starts while training does
        saved = self._restored_placement
        plan = resume_plan(saved, self._restored_layout, view.layout, self.balance.balancer)
        if plan == "restore" and saved is not None and saved != str(view.placement):
            log.info("DynMo: restoring placement %s from the checkpoint", saved)
            strategy.apply_placement(saved)
            view = strategy.pipeline_view()
        elif plan == "repartition":
            log.info(
                "DynMo: the checkpoint's placement %s was for another pipeline (%s); this run (%s) starts "
                "at %s and rebalances it after profiling its first steps",
                saved,
                self._restored_layout,
                view.layout,
                view.placement,
            )
            self._resume_window = True
        self._restored_placement = self._restored_layout = None
        self.placement, self._layout = view.placement, view.layout

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        view = _strategy(trainer).pipeline_view()
        if view.stage_index is None:
            return  # a released rank takes no part
        just_applied = self._pending is not None
        if just_applied:
            view = self._apply_pending(trainer)  # the pipeline after it
            if view.is_released:
                return  # this re-pack released the rank: it leaves fit at this batch
        assert self._busy is not None
        self._busy.watch(view.pipeline_stages)  # before a window wraps the same stages (LIFO)
        step = trainer.global_step
        if not self._window.is_open and not self._decisions.in_flight and step != self._last_checked_step:
            self._last_checked_step = step
            sizes, workers = view.placement.sizes, view.stage_workers(view.placement)
            reason = window_reason(self._window, self._trigger, step, sizes, self._resume_window, workers)
            self._resume_window = False
            if self._window.news and view.global_rank == view.active_ranks[0]:
                log.info(self._window.news)
            if self.trust.stopped and reason not in (None, "resume"):
                reason = None  # predictions kept missing: no more windows, no more moves
            # Right after a rebalance the trigger has not recorded it yet (that happens once the ranks
            # agree on its cost, at this step's end): its auto cooldown would not hold yet.
            if reason is not None and not (just_applied and reason == "auto"):
                self._open_window(trainer, view, reason)
        self._busy.begin_step()
        self._step_phase = self._window.begin_step()
        self._step_start = self._clock()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self._window.before_update()  # a window times the update, to its step post-hook

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        view = _strategy(trainer).pipeline_view()
        if view.stage_index is None:
            return
        step_s = self._clock() - self._step_start
        assert self._busy is not None
        # Outside a window no device synchronise: on a GPU the busy time reported is the previous step's.
        busy_s = self._busy.end_step(wait=self._window.is_open)
        if self._window.end_step(self._step_phase, busy_s):
            self._close_window(trainer, view, batch)  # decides only: the pipeline stays as viewed
        self._share_step(trainer, view, busy_s, step_s)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._window.stop()
        self._decisions.close()
        if self._busy is not None:
            self._busy.unwatch()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "placement": None if self.placement is None else str(self.placement),
            "layout": self._layout,
            **self._history.state_dict(),
            "trigger": self._trigger.state_dict(),
            "trust": self.trust.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["placement"]
        self.placement = None if saved is None else Placement.from_string(saved)
        self._restored_placement = saved
        self._restored_layout = state_dict.get("layout")
        self._history.load_state_dict(state_dict)
        self._trigger.load_state_dict(state_dict["trigger"])
        if "trust" in state_dict:  # checkpoints from before the trust gate have none
            self.trust.load_state_dict(state_dict["trust"])

    # -- a window: open, close, decide ----------------------------------------------------------------

    def _open_window(self, trainer: pl.Trainer, view: PipelineView, reason: str) -> None:
        self._window.open(view, next(iter(trainer.optimizers), None), trainer.global_step, reason)
        self._gain.window_opened()
        log.debug("DynMo: profiling window opened at step %d (%s)", trainer.global_step, reason)

    def _close_window(self, trainer: pl.Trainer, view: PipelineView, batch: Any) -> None:
        result = self._window.close(trainer.global_step)
        start = self._clock()
        costs, hardware = self._meter.measure(
            view, result, self._window.reason, _param_dtype(trainer), trainer.global_step
        )
        retune = self._retune_options(trainer, view, result, batch) if self._retunes else None
        self._pending_overhead = WindowOverhead(
            profiling_s=result.hook_time_s * (result.num_steps + self._window.warmup_steps),
            decision_s=self._clock() - start,
        )
        # This rank's measured peak beside the model's per-layer memory (loggers record rank 0's).
        self._queued_metrics["dynmo/peak_memory_bytes"] = float(result.peak.peak_bytes)
        self._decide_once(trainer, view, costs, hardware, retune)

    def _decide_once(
        self,
        trainer: pl.Trainer,
        view: PipelineView,
        costs: list[LayerCost],
        hardware: Hardware,
        retune: RetuneOptions | None,
    ) -> None:
        """Rank 0 of the active ranks decides (``self._decisions``: at once, taken here by every rank in
        one broadcast; or in its helper process, taken at a later step's exchange)."""
        start, source, step = self._clock(), view.active_ranks[0], trainer.global_step
        prepare = None
        if view.global_rank == source:
            prepare = functools.partial(self._decision_call, view, costs, hardware, step, retune)
        self._decisions.start(prepare, source, f"the rebalance decision at step {step}")
        self._charge_decision(start)
        if not self._decisions.background:
            self._finish_decision(trainer, view)

    @property
    def _retunes(self) -> bool:
        return self.retune_microbatches and self.balance.repack and self.balance.cost == "time"

    def _retune_options(
        self, trainer: pl.Trainer, view: PipelineView, result: ProfileResult, batch: Any
    ) -> RetuneOptions:
        # The batch that closes the window: its size bounds the micro-batch counts a re-tune may pick.
        module: Any = trainer.lightning_module  # pipeline_batch is the model contract's, not Lightning's
        batch_size = int(module.pipeline_batch(batch)[0].shape[0])
        return self._meter.retune_options(view, result, batch_size, self._window.busy_s)

    def _decision_call(
        self,
        view: PipelineView,
        costs: list[LayerCost],
        hardware: Hardware,
        step: int,
        retune: RetuneOptions | None,
    ) -> tuple[Callable[[], RebalanceDecision], float]:
        """On the deciding rank: the one call of :func:`~lightning_dynmo.balancing.policy.decide` (pure,
        picklable) and the runtime's cost per action its predictions include."""
        timed = self.balance.cost == "time"  # seconds per action add to seconds only
        measured_s = self._history.quiet_step_s() if timed else None
        per_op_s = self._meter.per_action_s(view, self.balance.problem(costs, hardware), measured_s)
        hardware = dataclasses.replace(hardware, per_op_s=per_op_s)
        # After a resume onto another pipeline: re-partition it, never release ranks at once.
        resumed: dict[str, Any] = (
            {"repack": False, "target_num_stages": None} if self._window.reason == "resume" else {}
        )
        balance = dataclasses.replace(
            self.balance,
            min_gain=self.trust.required_gain(self.balance.min_gain),
            min_saving=self._min_saving(step),
            **resumed,
        )
        m, layouts = view.num_microbatches, view.repack_layouts() if self.balance.repack else None
        order = schedule_order(view.schedule_name)  # predict steps from the schedule's own action lists
        if self._decisions.background:  # the helper has no torch to build them: they travel computed
            order = order.tabled(decision_shapes(view.num_stages, m, balance, layouts, retune))
        problem, workers = balance.problem(costs, hardware), view.stage_workers(view.placement)
        call = functools.partial(decide, problem, view.placement, balance, m, order, stage_workers=workers)
        return functools.partial(call, repack_layouts=layouts, retune=retune), per_op_s

    def _finish_decision(self, trainer: pl.Trainer, view: PipelineView) -> None:
        """Every active rank: take the decision (one broadcast); it is applied at the next step's start."""
        start, step = self._clock(), trainer.global_step
        guard = _strategy(trainer).guard(f"the rebalance decision's broadcast at step {step}", control=True)
        decision, per_op_s = self._decisions.finish(view.active_ranks, view.control_group, guard)
        assert isinstance(decision, RebalanceDecision)
        self._pending, self._pending_per_op_s = decision, per_op_s
        self._charge_decision(start)

    def _charge_decision(self, since: float) -> None:
        """Add the seconds since ``since`` to what the pending decision cost the ranks."""
        spent = self._pending_overhead.decision_s + self._clock() - since
        self._pending_overhead = dataclasses.replace(self._pending_overhead, decision_s=spent)

    def _min_saving(self, step: int) -> float:
        """Predicted per-step saving a migration must bring: the mean measured migration time (nothing
        before the first) over the steps a placement lasts (``TriggerConfig.placement_lifetime``)."""
        if self.balance.cost != "time":
            return 0.0  # the params view has no seconds to compare with
        return self._history.min_saving(step, self.triggers.placement_lifetime)

    # -- applying a decision --------------------------------------------------------------------------

    def _apply_pending(self, trainer: pl.Trainer) -> PipelineView:
        """Apply the pending decision (or record that it kept the placement); the pipeline after it."""
        decision, overhead = self._pending, self._pending_overhead
        assert decision is not None
        self._pending = None
        strategy = _strategy(trainer)
        migration_s = 0.0
        if decision.apply:
            start = self._clock()
            count = decision.num_microbatches
            retuned = {} if count is None else {"num_microbatches": count}  # only a re-tune passes a count
            strategy.apply_placement(decision.proposed, **retuned)
            migration_s = self._clock() - start
        view = strategy.pipeline_view()
        record = DecisionRecord(
            step=trainer.global_step,
            reason=self._window.reason,
            old=str(decision.current),
            new=str(decision.proposed),
            applied=decision.apply,
            why=decision.reason,
            predicted_gain=decision.predicted_gain,
            num_microbatches=view.num_microbatches,
            per_op_s=self._pending_per_op_s,
            profiling_s=overhead.profiling_s,
            decision_s=overhead.decision_s,
            migration_s=migration_s,
        )
        self._cost_to_share = record.overhead_s
        self.placement, self._layout = view.placement, view.layout
        self._window.decided(decision.apply, decision.worker_loads_after)
        self._history.add(record)
        self._log_decision(trainer, view, decision, record)
        return view

    def _log_decision(
        self, trainer: pl.Trainer, view: PipelineView, decision: RebalanceDecision, record: DecisionRecord
    ) -> None:
        what = "rebalance" if decision.apply else "kept placement"
        line = (
            f"DynMo {what} at step {record.step} ({record.reason}): {record.old} -> {record.new}; "
            f"predicted step {decision.predicted_step_before:.4g} -> {decision.predicted_step_after:.4g} "
            f"({decision.predicted_gain:+.1%}, {1e3 * record.per_op_s:.3g} ms per action); "
            f"{decision.reason}; profiling {record.profiling_s:.3f} s, decision {record.decision_s:.3f} s, "
            f"migration {record.migration_s:.3f} s"
        )
        if trainer.global_rank == view.active_ranks[0]:
            log.log(logging.INFO if decision.apply else logging.DEBUG, line)
        metrics = {
            "dynmo/simulated_bubble_ratio": decision.bubble_ratio_after
            if decision.apply
            else decision.bubble_ratio_before,
            "dynmo/predicted_gain": decision.predicted_gain if decision.apply else 0.0,
            "dynmo/profiling_s": record.profiling_s,
            "dynmo/decision_s": record.decision_s,
            "dynmo/migration_s": record.migration_s,
            "dynmo/overhead_s": self.overhead_s,
        }
        metrics.update({f"dynmo/stage{s}/num_layers": float(n) for s, n in enumerate(view.placement.sizes)})
        self._queued_metrics.update(metrics)

    # -- the per-step exchange --------------------------------------------------------------------------

    def _share_step(
        self, trainer: pl.Trainer, view: PipelineView, busy_s: float | None, step_s: float
    ) -> None:
        # The strategy's SIGTERM flag rides along: the next batch start then needs no collective of its own.
        busy = -1.0 if busy_s is None else busy_s
        sigterm = 0.0 if view.sigterm is None else view.sigterm.flag
        events, mid_step = self._inbox.take()  # their length rides in the row
        # Alone, the row never leaves the host (on a GPU, no copy to the device and back, no synchronise).
        alone = len(view.active_ranks) == 1
        mine = torch.tensor(
            [len(events), busy, step_s, self._cost_to_share, sigterm, self._decisions.ready(), mid_step],
            dtype=torch.float64,
            device=torch.device("cpu") if alone else view.root_device,
        )
        self._cost_to_share = 0.0
        with _strategy(trainer).guard("the callback's per-step exchange", control=True):
            rows = exchange_rows(mine, view.active_ranks, view.control_group)
        lows, tops = (column.tolist() for column in torch.aminmax(rows, dim=0))  # one op for every column
        if view.sigterm is not None:
            view.sigterm.settle(tops[_SIGTERM] > 0)
        if tops[_READY] > 0:
            self._finish_decision(trainer, view)  # a background decision: applied at the next step's start
        event = tops[_EVENTS] > 0
        if event:
            self._exchange_events(trainer, view, events, rows[:, _EVENTS])
            self._trigger.notify_event()
            self._window.event_seen()
        if tops[_COST] > 0:
            self._trigger.record_rebalance(trainer.global_step, tops[_COST])
        step_max = tops[_STEP]
        self._follow_measured_gain(trainer, view, step_max, cost_changed=event)
        if lows[_BUSY] >= 0:
            self._positions = self._positions or PositionIndex(view.pipeline_rank_of)
            stage_busy = self._positions.means(rows[:, _BUSY], view.active_ranks, view.pipeline_size)
            self._window.observe_loads(stage_busy, event, shown=event and tops[_MID_STEP] == 0)
            quiet = not self._window.is_open and self._pending is None and not self._decisions.in_flight
            if self.triggers.auto is not None and quiet:
                self._trigger.observe(stage_busy)  # a window's steps carry hooks and end in a rebalance
            self._log_step(trainer, view, stage_busy, step_max)

    def _exchange_events(
        self, trainer: pl.Trainer, view: PipelineView, mine: bytes, sizes: torch.Tensor
    ) -> None:
        # Only when some rank had an event: one row exchange, then every rank keeps every distinct event.
        lengths = [int(n) for n in sizes.tolist()]
        with _strategy(trainer).guard("the dynamism event exchange", control=True):
            shared = exchange_events(mine, lengths, view.active_ranks, view.control_group, view.root_device)
        self._history.add_events([DynamismEvent.from_dict(e) for e in shared])

    def _follow_measured_gain(
        self, trainer: pl.Trainer, view: PipelineView, step_s: float, cost_changed: bool
    ) -> None:
        followed = self._history.observe_step(step_s, self._step_phase, cost_changed)
        if followed is not None:
            self._report_measured_gain(trainer, view, *followed)

    def _report_measured_gain(
        self, trainer: pl.Trainer, view: PipelineView, record: DecisionRecord, measured: MeasuredGain
    ) -> None:
        if trainer.global_rank == view.active_ranks[0]:
            log.info(
                "DynMo rebalance at step %d (%s -> %s): measured step time %.4g s -> %.4g s (%+.1f%%), "
                "predicted %+.1f%%",
                record.step,
                record.old,
                record.new,
                measured.before_s,
                measured.after_s,
                100 * measured.gain,
                100 * record.predicted_gain,
            )
        self._queued_metrics["dynmo/measured_gain"] = measured.gain
        if self.trust.delivered(record.predicted_gain, measured.gain):
            self._window.move_confirmed()  # the shares it achieved replace the predicted ones as the mark
        verdict = self.trust.observe(record.predicted_gain, measured.gain)  # the same on every rank
        if verdict is not None and trainer.global_rank == view.active_ranks[0]:
            log.info(verdict)

    def _log_step(
        self, trainer: pl.Trainer, view: PipelineView, stage_busy: list[float], step_s: float
    ) -> None:
        measured_imbalance = imbalance(stage_busy)
        bubble = max(0.0, 1.0 - sum(stage_busy) / (len(stage_busy) * step_s)) if step_s > 0 else 0.0
        values = {"imbalance": measured_imbalance, "bubble_ratio": bubble, "step_time_s": step_s}
        self._averages.update(values)
        if not _loggers_write_now(trainer):
            return  # self.log costs about a millisecond per metric: hand them over only when written
        metrics = {f"dynmo/{k}": v for k, v in values.items()}
        metrics.update({f"dynmo/{name}_avg": mean for name, mean in self._averages.compute().items()})
        metrics.update({f"dynmo/stage{s}/busy_s": b for s, b in enumerate(stage_busy)})
        metrics["dynmo/active_workers"] = float(len(view.active_ranks))
        metrics["dynmo/overhead_s"] = self.overhead_s
        if self.triggers.every_step or self.triggers.on_events:
            metrics["dynmo/skipped_windows"] = float(self.skipped_windows)
        # Metrics of the decisions and windows since the last written step (the latest value of each).
        metrics.update(self._queued_metrics)
        self._queued_metrics.clear()
        _log(trainer, metrics)

    def _resolve_memory_capacity(self, device: torch.device) -> None:
        if self.balance.memory_capacity_bytes is None and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            self.balance = dataclasses.replace(self.balance, memory_capacity_bytes=float(total))


def _strategy(trainer: pl.Trainer) -> DynMoStrategy:
    """The Trainer's strategy, a DynMoStrategy (``setup`` refused any other; tests pass stand-ins)."""
    return cast(DynMoStrategy, trainer.strategy)


def _param_dtype(trainer: pl.Trainer) -> torch.dtype:
    params = list(trainer.lightning_module.parameters())
    return params[0].dtype if params else torch.get_default_dtype()


def _loggers_write_now(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's loggers write at this step (every ``log_every_n_steps``, Lightning decides)."""
    return bool(trainer.loggers) and bool(trainer._logger_connector.should_update_logs)


def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    # Values are agreed across ranks already; Lightning's loggers record rank 0's.
    module = trainer.lightning_module
    for name, value in metrics.items():
        module.log(name, float(value), on_step=True, on_epoch=False)
