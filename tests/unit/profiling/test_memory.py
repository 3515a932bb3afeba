"""The per-layer memory model: parameters, gradients, optimizer state, saved activations, in-flight count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynmo.profiling import LayerMemory, LayerProfiler, inflight_microbatches, optimizer_state_bytes
from lightning_dynmo.profiling.memory import ActivationMeter, peak_memory, static_memory
from tests.unit.profiling.models import Block


@pytest.mark.parametrize(
    ("schedule", "stage", "expected"),
    [("1F1B", 0, 4), ("1f1b", 1, 3), ("1F1B", 3, 1), ("GPipe", 3, 8), ("InterleavedZeroBubble", 2, 8)],
)
def test_inflight_microbatches(schedule, stage, expected):
    assert inflight_microbatches(schedule, stage, num_stages=4, num_microbatches=8) == expected


def test_inflight_microbatches_capped_by_microbatch_count():
    assert inflight_microbatches("1F1B", 0, num_stages=4, num_microbatches=2) == 2


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((4, 4, 8), r"stage_index=4 with num_stages=4"),
        ((0, 0, 8), r"num_stages=0"),
        ((0, 2, 0), r"num_micro"),
    ],
)
def test_inflight_microbatches_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        inflight_microbatches("1F1B", *args)


def test_saved_activations_count_inputs_and_outputs_not_weights():
    torch.manual_seed(0)
    batch, width = 4, 16
    block = Block(width)
    meter = ActivationMeter({0: block})
    meter.attach()
    block(torch.randn(batch, width, requires_grad=True))
    meter.detach()
    saved, output = meter.per_microbatch(0)
    # linear saves its input (the weight is a parameter, not counted); tanh saves its output.
    assert saved == 2 * batch * width * 4
    assert output == batch * width * 4


def test_saved_activations_of_a_microbatch_view_count_the_view_only():
    torch.manual_seed(0)
    block = Block(16)
    meter = ActivationMeter({0: block})
    meter.attach()
    batch = torch.randn(32, 16)
    block(batch[:4])  # a micro-batch is a view into the whole batch's storage
    meter.detach()
    assert meter.per_microbatch(0)[0] == 2 * 4 * 16 * 4


def test_nothing_saved_under_no_grad():
    block = Block(16)
    meter = ActivationMeter({0: block})
    meter.attach()
    with torch.no_grad():
        block(torch.randn(4, 16))
    meter.detach()
    assert meter.per_microbatch(0) == (0, 0)


def test_static_memory_reads_optimizer_state():
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    optimizer = torch.optim.Adam(layer.parameters())
    assert static_memory(layer, optimizer) == (36 * 4, 36 * 4, 0)  # no state before the first step
    layer(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    # two moments per parameter plus one float32 step counter per parameter tensor
    assert static_memory(layer, optimizer) == (36 * 4, 36 * 4, 2 * 36 * 4 + 2 * 4)
    assert optimizer_state_bytes(None, layer.parameters()) == 0


def test_frozen_parameters_have_no_gradient_bytes():
    layer = nn.Linear(8, 4)
    layer.weight.requires_grad_(False)
    assert static_memory(layer, None) == (36 * 4, 4 * 4, 0)


def test_total_bytes_scales_activations_by_inflight_microbatches():
    memory = LayerMemory(
        param_bytes=100,
        grad_bytes=100,
        optimizer_state_bytes=200,
        activation_bytes_per_microbatch=50,
        output_bytes_per_microbatch=10,
    )
    assert memory.total_bytes(1) == 450
    assert memory.total_bytes(4) == 600


def test_layer_costs_from_a_profile():
    torch.manual_seed(0)
    blocks = {0: Block(16), 1: Block(16)}
    optimizer = torch.optim.Adam([p for b in blocks.values() for p in b.parameters()])
    profiler = LayerProfiler(blocks, warmup_steps=1, profile_steps=1, optimizer=optimizer)
    profiler.start()
    while not profiler.done:
        profiler.begin_step()
        x = torch.randn(4, 16, requires_grad=True)
        blocks[1](blocks[0](x)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            blocks[1].lin.weight[:2].zero_()  # a pruning mask applied after the step: 32 weights gone
        profiler.end_step()
    result = profiler.result()
    costs = result.layer_costs(inflight_microbatches=3)
    param_bytes = 272 * 4
    optim_bytes = 2 * param_bytes + 2 * 4
    activation = 2 * 4 * 16 * 4
    assert costs[0].memory_bytes == 2 * param_bytes + optim_bytes + 3 * activation
    assert costs[0].activation_bytes == 4 * 16 * 4
    assert costs[0].num_params == 272
    assert costs[1].num_params == 272 - 32  # pruned entries do not count as work
    assert costs[0].fwd_time_s > 0 and costs[0].bwd_time_s > 0
    assert result.peak.source == "ru_maxrss" and result.peak.peak_bytes > 0
    with pytest.raises(ValueError, match=r"inflight_microbatches=0 must be >= 1"):
        result.layer_costs(0)


def test_cpu_peak_memory_is_the_process_peak():
    peak = peak_memory(torch.device("cpu"))
    assert peak.source == "ru_maxrss"
    assert peak.peak_bytes > 10 * 2**20  # a Python process with torch loaded holds tens of MiB


def test_known_activations_are_reused_and_not_metered_again():
    torch.manual_seed(0)
    blocks = {0: Block(16), 1: Block(16)}
    profiler = LayerProfiler(
        blocks, warmup_steps=0, profile_steps=1, known_activations={1: (123, 456), 7: (1, 1)}
    )
    assert profiler.known_activations == {1: (123, 456)}  # a layer this rank does not own is ignored
    profiler.start()
    # Layer 0 carries the timer's pre-hook and the meter's; layer 1, already known, the timer's only.
    assert (len(blocks[0]._forward_pre_hooks), len(blocks[1]._forward_pre_hooks)) == (2, 1)
    profiler.begin_step()
    blocks[1](blocks[0](torch.randn(4, 16, requires_grad=True))).sum().backward()
    profiler.end_step()
    activations = profiler.result().activations()
    assert activations[1] == (123, 456)
    assert activations[0] == (2 * 4 * 16 * 4, 4 * 16 * 4)  # metered as in the test above


def test_a_window_with_every_activation_known_attaches_no_meter():
    blocks = {0: Block(16)}
    profiler = LayerProfiler(blocks, warmup_steps=0, profile_steps=1, known_activations={0: (8, 8)})
    profiler.start()
    assert len(blocks[0]._forward_pre_hooks) == 1
    profiler.stop()
