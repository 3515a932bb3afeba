"""The always-on stage busy timer: sums chunk-method time, follows rebuilt stages, leaves no wrapper."""

from __future__ import annotations

import torch

from lightning_dynmo.profiling import LayerProfiler
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.profiling.stage_timer import StageBusyTimer
from tests.unit.profiling.models import Block


class FakeClock(StepClock):
    """Marks are readings of a counter the fake stage advances: exact, no sleeping."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.now = 0.0

    def mark(self) -> float:
        return self.now


class FakeStage:
    def __init__(self, clock: FakeClock, fwd_s: float, bwd_s: float) -> None:
        self.clock, self.fwd_s, self.bwd_s = clock, fwd_s, bwd_s

    def forward_one_chunk(self, chunk: int) -> int:
        self.clock.now += self.fwd_s
        return chunk

    def backward_one_chunk(self, chunk: int) -> None:
        self.clock.now += self.bwd_s


def _step(clock: FakeClock, stage: FakeStage, microbatches: int = 2) -> None:
    for mb in range(microbatches):
        assert stage.forward_one_chunk(mb) == mb
        clock.now += 10.0  # waiting for a peer: idle, not busy
        stage.backward_one_chunk(mb)


def test_busy_time_excludes_waiting():
    clock = FakeClock()
    stage = FakeStage(clock, fwd_s=1.0, bwd_s=2.0)
    timer = StageBusyTimer(clock)
    timer.watch([stage])
    timer.begin_step()
    _step(clock, stage)
    assert timer.end_step() == 6.0


def test_ran_says_whether_the_stages_computed_in_this_step_yet():
    clock = FakeClock()
    stage = FakeStage(clock, fwd_s=1.0, bwd_s=2.0)
    timer = StageBusyTimer(clock)
    timer.watch([stage])
    timer.begin_step()
    assert not timer.ran  # a batch-start hook runs here, before any chunk
    stage.forward_one_chunk(0)
    assert timer.ran
    stage.backward_one_chunk(0)
    timer.end_step()
    assert not timer.ran  # between one step's end and the next step's first chunk
    timer.begin_step()
    timer.watch([FakeStage(clock, 1.0, 1.0)])  # rebuilt: this step is dropped, and says nothing ran after
    stage.forward_one_chunk(1)  # the old stage has its own methods back: not timed
    assert not timer.ran and timer.end_step() is None and not timer.ran


def test_rebuilt_stages_are_followed_and_a_half_watched_step_is_dropped():
    clock = FakeClock()
    old, new = FakeStage(clock, 1.0, 1.0), FakeStage(clock, 3.0, 3.0)
    timer = StageBusyTimer(clock)
    timer.watch([old])
    timer.begin_step()
    timer.watch([new])  # the strategy rebuilt its pipeline mid-step
    _step(clock, new)
    assert timer.end_step() is None
    assert "forward_one_chunk" not in vars(old)  # the old stage got its own methods back
    timer.watch([new])  # same objects: nothing changes
    timer.begin_step()
    _step(clock, new)
    assert timer.end_step() == 12.0


def test_unwatch_restores_the_methods():
    clock = FakeClock()
    stage = FakeStage(clock, 1.0, 1.0)
    timer = StageBusyTimer(clock)
    timer.watch([stage])
    assert "forward_one_chunk" in vars(stage)
    timer.unwatch()
    assert vars(stage).keys() == {"clock", "fwd_s", "bwd_s"}
    timer.begin_step()
    assert timer.end_step() is None  # nothing watched: no figure rather than a zero


def test_extra_shape_inference_calls_are_scaled_away():
    # The first step of a new pipeline runs micro-batch 0 once more for shape inference.
    block = Block(16)
    plain = LayerProfiler({0: block}, warmup_steps=0, profile_steps=1)
    scaled = LayerProfiler({0: Block(16)}, warmup_steps=0, profile_steps=1, microbatches_per_step=2)
    for profiler in (plain, scaled):
        layer = profiler._layers[0]
        profiler.start()
        profiler.begin_step()
        for _ in range(3):
            layer(torch.randn(4, 16, requires_grad=True)).sum().backward()
        profiler.end_step()
    assert plain.result().layers[0].microbatches_per_step == 3
    assert scaled.result().layers[0].microbatches_per_step == 2


def test_busy_timer_and_profiler_wrappers_nest():
    # The busy timer wraps the stage first, a profiling window wraps the weight pass on top; when the
    # window closes, the busy timer's wrapper must still be in place.
    clock = FakeClock()
    stage = FakeStage(clock, 1.0, 1.0)
    stage.backward_weight_one_chunk = lambda chunk: None  # an instance-level method, like a patched one
    original = stage.backward_weight_one_chunk
    timer = StageBusyTimer(clock)
    timer.watch([stage])
    busy_wrapper = stage.backward_weight_one_chunk
    profiler = LayerProfiler({0: Block(16)}, warmup_steps=0, profile_steps=1, stages=[stage])
    profiler.start()
    assert stage.backward_weight_one_chunk is not busy_wrapper
    profiler.stop()
    assert stage.backward_weight_one_chunk is busy_wrapper
    timer.unwatch()
    assert stage.backward_weight_one_chunk is original


class DeviceLikeClock(FakeClock):
    """Like CUDA events: resolving needs the device; counts full synchronises and per-mark waits."""

    def __init__(self) -> None:
        super().__init__()
        self.uses_cuda_events = True
        self.synchronizes = 0
        self.waited: list[float] = []

    def synchronize(self) -> None:
        self.synchronizes += 1

    def wait(self, mark: float) -> None:
        self.waited.append(mark)

    def elapsed_s(self, start: float, end: float) -> float:
        return end - start


def test_on_a_device_steps_outside_windows_report_the_previous_step_without_synchronising() -> None:
    clock = DeviceLikeClock()
    stage = FakeStage(clock, fwd_s=1.0, bwd_s=2.0)
    timer = StageBusyTimer(clock)
    timer.watch([stage])
    busy = []
    for microbatches in (1, 2, 3):
        timer.begin_step()
        _step(clock, stage, microbatches)
        busy.append(timer.end_step(wait=False))
    assert busy == [None, 3.0, 6.0]  # one step late: the first has nothing before it
    assert clock.synchronizes == 0 and len(clock.waited) == 2  # only up to the previous step's last mark
    # A window's step (wait=True) resolves itself with one synchronise and drops the step left over.
    timer.begin_step()
    _step(clock, stage, 1)
    assert timer.end_step(wait=True) == 3.0 and clock.synchronizes == 1
    timer.begin_step()
    _step(clock, stage, 1)
    assert timer.end_step(wait=False) is None  # nothing left over after a resolved step
    # New stages drop what was left over from the old ones.
    timer.watch([FakeStage(clock, fwd_s=1.0, bwd_s=2.0)])
    timer.begin_step()
    assert timer.end_step(wait=False) is None


def test_the_gradient_reduction_after_the_last_backward_is_busy_time():
    # A stage sharded with FSDP2 reduce-scatters its gradients in perform_reduce_grad, once per step
    # after its last backward: the rank works there, it does not wait.
    clock = FakeClock()
    stage = FakeStage(clock, fwd_s=1.0, bwd_s=2.0)

    def perform_reduce_grad(grad_scale_factor: int) -> None:
        clock.now += 4.0

    stage.perform_reduce_grad = perform_reduce_grad  # type: ignore[attr-defined]
    timer = StageBusyTimer(clock)
    timer.watch([stage])
    timer.begin_step()
    _step(clock, stage)
    stage.perform_reduce_grad(1)  # type: ignore[attr-defined]
    assert timer.end_step() == 10.0
