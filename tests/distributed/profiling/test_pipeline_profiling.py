"""Profiling inside real torch.distributed.pipelining schedule steps on 2 gloo ranks.

Layer 2 (on rank 1) sleeps 20 ms in forward and 40 ms in backward per micro-batch; the profile must
charge that to layer 2 whatever the schedule (GPipe, 1F1B, and a zero-bubble schedule that defers weight
gradients), leave no hook behind, and give identical records on both ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from lightning_dynmo.balancing import LayerCost
from lightning_dynmo.profiling import (
    LayerProfiler,
    gather_layer_costs,
    inflight_microbatches,
    measure_boundary_comm_s,
    module_has_hooks,
)
from tests.distributed.harness import run_distributed
from tests.unit.profiling.models import Block, Stack

pytestmark = pytest.mark.distributed

NUM_LAYERS, SLOW, MICROBATCHES = 4, 2, 4
FWD_S, BWD_S = 0.020, 0.040


def profile_worker(rank: int, world_size: int, schedule_name: str) -> dict:
    torch.manual_seed(0)
    blocks = {
        i: Block(fwd_ms=FWD_S * 1e3, bwd_ms=BWD_S * 1e3) if i == SLOW else Block() for i in range(NUM_LAYERS)
    }
    mine = {i: b for i, b in blocks.items() if i // 2 == rank}
    stage = PipelineStage(Stack(mine), rank, world_size, torch.device("cpu"))
    cls = get_schedule_class(schedule_name)
    single = cls.__name__ in ("ScheduleGPipe", "Schedule1F1B")
    schedule = cls(stage if single else [stage], MICROBATCHES, loss_fn=_mse)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    profiler = LayerProfiler(mine, warmup_steps=1, profile_steps=2, stages=[stage])
    profiler.start()
    while not profiler.done:
        profiler.begin_step()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        profiler.end_step()
    result = profiler.result()
    inflight = inflight_microbatches(schedule_name, 0, world_size, MICROBATCHES)
    costs = gather_layer_costs(result.layer_costs(inflight), NUM_LAYERS)
    comm = measure_boundary_comm_s([costs[1].activation_bytes], repeats=3)
    return {
        "costs": costs,
        "comm": comm,
        "hooks_left": any(module_has_hooks(b) for b in mine.values()),
        "stage_patched": "backward_weight_one_chunk" in vars(stage),
        "weight_s": {i: p.bwd_weight_time_s for i, p in result.layers.items()},
    }


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


@pytest.mark.parametrize("schedule_name", ["GPipe", "1F1B", "InterleavedZeroBubble"])
def test_pipeline_profile_charges_the_slow_layer(schedule_name, tmp_path):
    results = run_distributed(profile_worker, 2, tmp_path, timeout_s=90, args=(schedule_name,))
    costs = results[0]["costs"]
    assert results[1]["costs"] == costs  # identical on every rank
    assert results[1]["comm"] == results[0]["comm"] and results[0]["comm"][0] > 0.0
    slow = costs[SLOW]
    assert slow.fwd_time_s >= MICROBATCHES * FWD_S
    assert MICROBATCHES * BWD_S <= slow.bwd_time_s < 1.75 * MICROBATCHES * BWD_S
    for i in set(range(NUM_LAYERS)) - {SLOW}:
        assert costs[i].fwd_time_s < FWD_S and costs[i].bwd_time_s < BWD_S
    assert costs[0].activation_bytes == 2 * 16 * 4  # one micro-batch of 2 rows of 16 float32
    for r in results:
        assert not r["hooks_left"] and not r["stage_patched"]
    deferred = sum(sum(r["weight_s"].values()) for r in results)
    assert (deferred > 0.0) == (schedule_name == "InterleavedZeroBubble")


def _value_error(call: Callable[[], object]) -> str:
    """The message of the ``ValueError`` that ``call()`` raises, or ``"no error"``."""
    try:
        call()
    except ValueError as e:
        return str(e)
    return "no error"


def duplicate_owner_worker(rank: int, world_size: int) -> str:
    return _value_error(lambda: gather_layer_costs({0: _unit_cost(), rank + 1: _unit_cost()}, 3))


def test_gather_rejects_a_layer_owned_by_two_ranks(tmp_path):
    messages = run_distributed(duplicate_owner_worker, 2, tmp_path, timeout_s=60)
    assert all("layers [0] were profiled by more than one rank" in m for m in messages)


def wrong_boundaries_worker(rank: int, world_size: int) -> str:
    dist.barrier()
    return _value_error(lambda: measure_boundary_comm_s([1, 2]))


def test_boundary_comm_needs_one_size_per_boundary(tmp_path):
    messages = run_distributed(wrong_boundaries_worker, 2, tmp_path, timeout_s=60)
    assert all("boundary_bytes has 2 entries but the pipeline group has 2 stages" in m for m in messages)


def _unit_cost() -> LayerCost:
    return LayerCost(fwd_time_s=1.0)
