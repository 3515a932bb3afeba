"""DynMoCallback's measured gain, driven hook by hook with an injected clock (no pipeline, no process group).

The profiling window is real (a ``LayerProfiler`` on one ``nn.Linear`` that each scripted step runs);
only the decision is scripted, so the test follows the callback's own bookkeeping of step phases,
dynamism events and rebalances.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_dynmo.balancing import Hardware, LayerCost
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.policy import RebalanceDecision
from lightning_dynmo.balancing.trust import PredictionTrust, TrustConfig
from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.callback.history import WindowOverhead
from lightning_dynmo.events import DynamismEvent
from lightning_dynmo.pipeline import resolve_schedule
from lightning_dynmo.profiling import StageBusyTimer
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.strategy.view import PipelineView


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedDecision(DynMoCallback):
    """The window closes with a scripted decision instead of gathering costs over a process group: move
    between ``0-1`` and ``0-0|1-1`` (the stand-in strategy takes any placement), predicted 10% faster."""

    def _close_window(self, trainer: Any, view: Any, batch: Any) -> None:
        assert self._window.is_open
        self._window.profiler = None
        current = trainer.strategy.placement
        other = "0-0|1-1" if str(current) != "0-0|1-1" else "0-1"
        self._pending = RebalanceDecision(
            apply=True,
            current=current,
            proposed=Placement.from_string(other),
            predicted_step_before=1.0,
            predicted_step_after=0.9,
            bubble_ratio_before=0.0,
            bubble_ratio_after=0.0,
            imbalance_before=0.0,
            imbalance_after=0.0,
            reason="scripted",
        )
        self._pending_overhead = WindowOverhead(profiling_s=0.0, decision_s=0.0)


def _setup(clock: FakeClock, **callback_kwargs: Any) -> tuple[ScriptedDecision, Any, nn.Linear]:
    layer = nn.Linear(4, 4)
    strategy = SimpleNamespace(
        stage_index=0,
        is_released=False,
        pipeline_stages=[],
        local_layers={0: layer},
        root_device=torch.device("cpu"),
        num_microbatches=1,
        active_ranks=(0,),
        global_rank=0,
        placement=Placement.from_string("0-1"),
        schedule_name="1F1B",
        pipeline_size=1,
        num_stages=1,
        applied=[],
    )

    def apply_placement(placement: Placement) -> None:
        strategy.applied.append(str(placement))
        strategy.placement = placement

    strategy.apply_placement = apply_placement
    strategy.pipeline_view = lambda: PipelineView(
        placement=strategy.placement,
        schedule=resolve_schedule(strategy.schedule_name),
        num_microbatches=strategy.num_microbatches,
        pipeline_size=strategy.pipeline_size,
        stage_index=strategy.stage_index,
        stage_indices=(0,),
        is_first_stage=True,
        is_released=strategy.is_released,
        global_rank=strategy.global_rank,
        active_ranks=strategy.active_ranks,
        pipeline_rank_of=lambda rank: rank,
        local_layers=strategy.local_layers,
        pipeline_stages=strategy.pipeline_stages,
        root_device=strategy.root_device,
        pipeline_group=None,
        active_group=None,
        control_group=None,
        data_parallel_group=None,
        data_parallel_size=1,
        has_tied_parameters=False,
    )
    strategy.broadcast = lambda obj, src=0: obj
    strategy.guard = lambda what, control=False: contextlib.nullcontext()
    strategy.active_group = None
    trainer = SimpleNamespace(strategy=strategy, global_step=0, global_rank=0, optimizers=[], loggers=[])
    profiling = ProfilingConfig(warmup_steps=1, steps=3, measure_comm=False)
    callback = ScriptedDecision(profiling=profiling, clock=clock, **callback_kwargs)
    callback._busy = StageBusyTimer(StepClock(torch.device("cpu")))
    return callback, trainer, layer


def _step(callback: DynMoCallback, trainer: Any, layer: nn.Linear, clock: FakeClock, seconds: float) -> None:
    callback.on_train_batch_start(trainer, None, None, trainer.global_step)  # type: ignore[arg-type]
    layer(torch.randn(2, 4)).sum().backward()
    clock.now += seconds
    callback.on_train_batch_end(trainer, None, None, None, trainer.global_step)  # type: ignore[arg-type]
    trainer.global_step += 1


@pytest.mark.parametrize("forget_the_event", [False, True])
def test_measured_gain_is_against_the_steps_right_before_the_rebalance(forget_the_event: bool) -> None:
    # 4 steps of 1.0 s; an early exit in step 3 makes steps 0.9 s; the event opens a window (1 warm-up +
    # 3 profiled steps), the rebalance follows, and the new placement runs 0.8 s steps after a 5 s rebuild.
    clock = FakeClock()
    callback, trainer, layer = _setup(clock)
    if forget_the_event:
        callback._gain.cost_changed = lambda: None  # type: ignore[method-assign]  # the bug as it was
    for step in range(4):
        if step == 3:
            callback._inbox.add(DynamismEvent("custom", (1,), step, "early exit"))
        _step(callback, trainer, layer, clock, 1.0)
    assert not callback._window.is_open and callback._trigger._pending_event
    for seconds in (3.0, 0.9, 0.9, 0.9):  # the window: warm-up, then three measured steps
        _step(callback, trainer, layer, clock, seconds)
    assert callback._pending is not None
    for seconds in (5.0, 0.8, 0.8, 0.8):
        _step(callback, trainer, layer, clock, seconds)
    assert trainer.strategy.applied == ["0-0|1-1"]
    (record,) = callback.rebalances
    expected = 1 - 0.8 / 1.0 if forget_the_event else 1 - 0.8 / 0.9
    assert record.measured_gain == pytest.approx(expected)
    assert callback._queued_metrics["dynmo/measured_gain"] == pytest.approx(expected)


def _run_periodic(
    callback: DynMoCallback, trainer: Any, layer: nn.Linear, clock: FakeClock, steps: int
) -> None:
    for _ in range(steps):  # every step 1 s, whatever the placement: no move delivers its predicted 10%
        _step(callback, trainer, layer, clock, 1.0)


def test_moves_that_keep_missing_their_prediction_stop_dynmo_moving(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    callback, trainer, layer = _setup(clock, every_n_steps=10)
    with caplog.at_level("INFO", logger="lightning_dynmo"):
        _run_periodic(callback, trainer, layer, clock, 100)
    # windows at steps 10, 20, 30 moved, each measured 0% against a predicted 10%; then no more moves
    assert len(trainer.strategy.applied) == 3
    assert [r.measured_gain for r in callback.rebalances] == [pytest.approx(0.0)] * 3
    assert callback.trust.stopped and not callback._window.is_open
    lines = [
        r.getMessage() for r in caplog.records if "DynMo" in r.getMessage() and "trust" in r.getMessage()
    ]
    assert any("trusts its step model less: 2 moves in a row missed" in line for line in lines), lines
    stop = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DynMo stops moving layers")]
    assert stop == [
        "DynMo stops moving layers: 3 moves in a row measured less than 50% of their predicted gain (last: "
        "predicted +10.0%, measured +0.0%); the placement stays as it is."
    ]
    # the state survives a checkpoint
    restored, _, _ = _setup(FakeClock(), every_n_steps=10)
    restored.load_state_dict(callback.state_dict())
    assert restored.trust.stopped


def test_without_the_trust_gate_dynmo_keeps_moving_back_and_forth() -> None:
    # Negative control: the same run with the gate switched off moves at every window.
    clock = FakeClock()
    callback, trainer, layer = _setup(clock, every_n_steps=10)
    callback.trust = PredictionTrust(TrustConfig(misses_to_widen=None, misses_to_stop=None))
    _run_periodic(callback, trainer, layer, clock, 100)
    assert len(trainer.strategy.applied) >= 8 and not callback.trust.stopped
    assert trainer.strategy.applied[:3] == ["0-0|1-1", "0-1", "0-0|1-1"]


def test_after_misses_a_move_needs_the_shortfall_on_top_of_min_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    callback = DynMoCallback(min_gain=0.02)
    seen: list[float] = []
    monkeypatch.setattr(
        "lightning_dynmo.callback.dynmo_callback.decide",
        lambda problem, current, config, *a, **k: seen.append(config.min_gain),
    )
    callback._window.reason = "every_n_steps"
    view = SimpleNamespace(
        placement=Placement.from_string("0-0|1-1"),
        num_microbatches=1,
        schedule_name="1F1B",
        stage_workers=lambda p: None,
        repack_layouts=lambda: None,
    )
    costs = [LayerCost(fwd_time_s=1.0), LayerCost(fwd_time_s=1.0)]
    callback._decision_call(view, costs, Hardware(), 10, None)[0]()  # type: ignore[arg-type]
    callback.trust.observe(0.10, 0.01)
    callback.trust.observe(0.10, 0.03)  # two misses: shortfalls 0.09 and 0.07
    callback._decision_call(view, costs, Hardware(), 20, None)[0]()  # type: ignore[arg-type]
    assert seen == [pytest.approx(0.02), pytest.approx(0.02 + 0.08)]


class KeptDecision(ScriptedDecision):
    """The scripted decision keeps the placement: the loads it saw are marked for the skip rule."""

    def _close_window(self, trainer: Any, view: Any, batch: Any) -> None:
        super()._close_window(trainer, view, batch)
        assert self._pending is not None
        self._pending = dataclasses.replace(self._pending, apply=False)


@pytest.mark.parametrize("mid_step", [False, True])
def test_an_event_before_the_stages_compute_is_judged_a_step_sooner(mid_step: bool) -> None:
    # One stage (nothing to gain: every judged event is skipped). After a decision that kept the placement,
    # an event published before the stage computes (a batch-start hook) is judged at the next step's start;
    # one published once it computed (at the optimizer step) a step later, on a step that ran the change.
    clock = FakeClock()
    callback, trainer, layer = _setup(clock)
    callback.__class__ = KeptDecision
    compute = lambda: layer(torch.randn(2, 4)).sum().backward()  # noqa: E731
    stage = SimpleNamespace(forward_one_chunk=compute, submod=nn.Module())
    trainer.strategy.pipeline_stages = [stage]
    callback._inbox.computing = lambda: callback._busy.ran

    def step(event: bool) -> None:
        callback.on_train_batch_start(trainer, None, None, trainer.global_step)  # type: ignore[arg-type]
        if event and not mid_step:
            callback._inbox.add(DynamismEvent("frozen", (0,), trainer.global_step))
        stage.forward_one_chunk()
        if event and mid_step:
            callback._inbox.add(DynamismEvent("frozen", (0,), trainer.global_step))
        clock.now += 1.0
        callback.on_train_batch_end(trainer, None, None, None, trainer.global_step)  # type: ignore[arg-type]
        trainer.global_step += 1

    step(event=True)  # the first event: its window opens at once (1 warm-up + 3 steps), nothing to judge
    for _ in range(5):
        step(event=False)
    assert [r.applied for r in callback.rebalances] == [False] and callback._window.stage_loads.marked
    step(event=True)
    skipped_at = []
    for _ in range(3):
        step(event=False)
        skipped_at.append(callback.skipped_windows)
    assert skipped_at == ([0, 1, 1] if mid_step else [1, 1, 1])
    assert not callback._window.is_open and len(callback.rebalances) == 1
