"""DynMoCallback's measured gain, driven hook by hook with an injected clock (no pipeline, no process group).

The profiling window is real (a ``LayerProfiler`` on one ``nn.Linear`` that each scripted step runs);
only the decision is scripted, so the test follows the callback's own bookkeeping of step phases,
dynamism events and rebalances.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.policy import RebalanceDecision
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
    """The window closes with a fixed decision instead of gathering costs over a process group."""

    def _close_window(self, trainer: Any, view: Any, batch: Any) -> None:
        assert self._window.is_open
        self._window.profiler = None
        current = trainer.strategy.placement
        self._pending = RebalanceDecision(
            apply=True,
            current=current,
            proposed=Placement.from_string("0-0|1-1"),
            predicted_step_before=1.0,
            predicted_step_after=0.9,
            bubble_ratio_before=0.0,
            bubble_ratio_after=0.0,
            imbalance_before=0.0,
            imbalance_after=0.0,
            reason="scripted",
        )
        self._pending_overhead = WindowOverhead(profiling_s=0.0, decision_s=0.0)


def _setup(clock: FakeClock) -> tuple[ScriptedDecision, Any, nn.Linear]:
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
    callback = ScriptedDecision(profiling=profiling, clock=clock)
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
            callback._new_events.append(DynamismEvent("custom", (1,), step, "early exit"))
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
