"""Per-layer times land on the right layer, in plain and split (zero-bubble) backward, and no hook stays."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from lightning_dynmo.profiling import LayerProfiler, LayerTimer, module_has_hooks
from lightning_dynmo.profiling.clock import StepClock
from tests.unit.profiling.models import Block, Stack

FWD_S, BWD_S = 0.020, 0.040
MICROBATCHES = 2


def _stack(slow: int, num_layers: int = 4) -> Stack:
    torch.manual_seed(0)
    return Stack(
        {
            i: Block(fwd_ms=FWD_S * 1e3, bwd_ms=BWD_S * 1e3) if i == slow else Block()
            for i in range(num_layers)
        }
    )


def _profile_plain_steps(model: Stack, x_requires_grad: bool, steps: int = 1) -> dict[int, object]:
    profiler = LayerProfiler(dict(enumerate(model.layers.values())), warmup_steps=0, profile_steps=steps)
    profiler.start()
    while not profiler.done:
        profiler.begin_step()
        for _ in range(MICROBATCHES):  # one forward and one backward per micro-batch, as 1F1B does
            x = torch.randn(4, 16, requires_grad=x_requires_grad)
            model(x).square().mean().backward()
        profiler.end_step()
    return dict(profiler.result().layers)


@pytest.mark.parametrize("slow", [0, 2])
def test_slow_layer_gets_its_forward_and_backward_time(slow):
    layers = _profile_plain_steps(_stack(slow), x_requires_grad=True)
    for i, p in layers.items():
        assert p.microbatches_per_step == MICROBATCHES
        if i == slow:
            assert p.fwd_time_s >= MICROBATCHES * FWD_S
            assert p.bwd_time_s >= MICROBATCHES * BWD_S
            assert p.bwd_time_s < 1.75 * MICROBATCHES * BWD_S  # not counted twice
        else:  # the neighbours do not inherit the slow layer's time
            assert p.fwd_time_s < FWD_S
            assert p.bwd_time_s < BWD_S


class _SlowFirstCall(torch.nn.Module):
    """Sleeps ``extra_s`` in the first forward of every step only, like a stage's first call after a wait."""

    def __init__(self, calls_per_step: int, extra_s: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.calls_per_step, self.extra_s, self.calls = calls_per_step, extra_s, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls % self.calls_per_step == 0:
            time.sleep(self.extra_s)
        self.calls += 1
        return torch.tanh(self.lin(x))


def test_a_slow_first_call_is_not_charged_to_the_layer():
    # The first call after a stage waited pays a wake-up that belongs to the boundary, not the layer:
    # the step's time is the median call times the calls, so one 30 ms call among four fast ones
    # leaves the layer fast. (A sum would be >= 30 ms: that is what this guards against.)
    calls, extra_s = 4, 0.030
    layer = _SlowFirstCall(calls, extra_s)
    profiler = LayerProfiler({0: layer}, warmup_steps=0, profile_steps=2)
    profiler.start()
    while not profiler.done:
        profiler.begin_step()
        for _ in range(calls):
            layer(torch.randn(4, 16, requires_grad=True)).sum().backward()
        profiler.end_step()
    (profile,) = profiler.result().layers.values()
    assert layer.calls == 2 * calls
    assert profile.fwd_time_s < extra_s / 2


def test_first_layer_without_input_grad_ends_at_its_last_parameter_grad():
    # Data input needs no gradient: the backward of layer 0 has no input gradient to wait for.
    layers = _profile_plain_steps(_stack(slow=0), x_requires_grad=False)
    assert layers[0].bwd_time_s >= MICROBATCHES * BWD_S
    assert layers[1].bwd_time_s < BWD_S


def test_frozen_prefix_has_no_backward():
    model = _stack(slow=3)
    for p in model.layers["0"].parameters():
        p.requires_grad_(False)
    layers = _profile_plain_steps(model, x_requires_grad=False)
    assert layers[0].bwd_time_s == 0.0
    assert layers[0].fwd_time_s > 0.0
    assert layers[3].bwd_time_s >= MICROBATCHES * BWD_S


@pytest.mark.parametrize("first_stage", [False, True])
def test_split_backward_attributes_deferred_weight_time_once(first_stage):
    # Zero-bubble schedules run torch's stage_backward_input now and stage_backward_weight later; on the
    # first stage (no input gradient) torch skips the input pass and runs the whole backward later.
    model = _stack(slow=1)
    layers = dict(enumerate(model.layers.values()))
    timer = LayerTimer(layers, StepClock("cpu"))
    timer.attach()
    timer.begin_step()
    x = torch.randn(4, 16, requires_grad=not first_stage)
    loss = model(x).square().mean()
    if first_stage:
        with timer.weight_pass():
            loss.backward()
    else:
        _, param_groups = stage_backward_input([loss], None, [x], model.parameters())
        with timer.weight_pass():
            stage_backward_weight(model.parameters(), param_groups)
    times = timer.end_step()
    timer.detach()
    assert times[1].bwd_time_s >= BWD_S
    assert times[1].bwd_time_s < 1.75 * BWD_S
    for i in (0, 2, 3):
        assert 0.0 < times[i].bwd_weight_time_s <= times[i].bwd_time_s < BWD_S
    assert all(p.grad is not None for p in model.parameters())


def test_gradients_are_unchanged_by_profiling():
    model = _stack(slow=-1)
    x = torch.randn(4, 16, requires_grad=True)
    model(x).square().mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with LayerProfiler(dict(enumerate(model.layers.values())), warmup_steps=0, profile_steps=1) as profiler:
        profiler.begin_step()
        model(x).square().mean().backward()
        profiler.end_step()
    for p, ref in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=0, atol=0)


class _FakeStage:
    """Stands in for a PipelineStage: only the weight-pass method the profiler wraps."""

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> int:
        return bwd_chunk_id


def test_no_hook_or_wrapper_left_after_the_window():
    model = _stack(slow=-1)
    stage = _FakeStage()
    x = torch.randn(4, 16, requires_grad=True)  # a leaf reused across steps, like a receive buffer
    profiler = LayerProfiler(
        dict(enumerate(model.layers.values())), warmup_steps=1, profile_steps=2, stages=[stage]
    )
    profiler.start()
    assert module_has_hooks(model)
    assert "backward_weight_one_chunk" in vars(stage)
    while not profiler.done:
        profiler.begin_step()
        model(x).sum().backward()
        assert stage.backward_weight_one_chunk(7) == 7  # the wrapper still calls through
        profiler.end_step()
        assert not x._backward_hooks  # tensor hooks on persistent leaves go at every step end
    assert not profiler.active
    assert not module_has_hooks(model)
    assert "backward_weight_one_chunk" not in vars(stage)


def test_hooks_removed_when_the_step_raises():
    model = _stack(slow=-1)
    with (
        pytest.raises(RuntimeError, match="boom"),
        LayerProfiler(dict(enumerate(model.layers.values()))) as p,
    ):
        p.begin_step()
        raise RuntimeError("boom")
    assert not module_has_hooks(model)


def test_module_has_hooks_sees_parameter_hooks():
    # Negative control for the cleanup tests: a hook we did not remove must be reported.
    model = _stack(slow=-1)
    assert not module_has_hooks(model)
    handle = next(model.parameters()).register_hook(lambda g: None)
    assert module_has_hooks(model)
    handle.remove()
    assert not module_has_hooks(model)


def test_hook_overhead_is_reported():
    model = _stack(slow=-1)
    profiler = LayerProfiler(dict(enumerate(model.layers.values())), warmup_steps=0, profile_steps=1)
    profiler.start()
    profiler.begin_step()
    model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    profiler.end_step()
    result = profiler.result()
    assert 0.0 < result.hook_time_s < result.step_time_s


def _layers() -> dict[int, torch.nn.Module]:
    return dict(enumerate(_stack(slow=-1).layers.values()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1}, r"warmup_steps=-1 must be >= 0"),
        ({"profile_steps": 0}, r"profile_steps=0 must be >= 1"),
    ],
)
def test_bad_window_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerProfiler(_layers(), **kwargs)


def test_no_layers_is_rejected():
    with pytest.raises(ValueError, match=r"layers is empty"):
        LayerProfiler({})


def test_misuse_of_the_step_protocol_is_reported():
    profiler = LayerProfiler(_layers(), warmup_steps=0, profile_steps=1)
    with pytest.raises(RuntimeError, match=r"begin_step\(\) before start\(\)"):
        profiler.begin_step()
    with pytest.raises(RuntimeError, match=r"end_step\(\) without begin_step\(\)"):
        profiler.end_step()
    with pytest.raises(RuntimeError, match=r"window incomplete: 0 of 1"):
        profiler.result()
    profiler.start()
    with pytest.raises(RuntimeError, match=r"attach\(\) called twice"):
        profiler.start()
    profiler.stop()


def test_bad_microbatch_count_is_rejected():
    with pytest.raises(ValueError, match=r"microbatches_per_step=0 must be >= 1 or None"):
        LayerProfiler(_layers(), microbatches_per_step=0)
