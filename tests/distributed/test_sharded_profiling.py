"""The profiler's view of an FSDP2-sharded unit: its forward time contains its parameter all-gather, and
its saved activations do not count its gathered parameters.

Two gloo ranks shard one block over both (``shard_unit``) and time its forward with the profiler's
:class:`~lightning_dynmo.profiling.layer_timer.LayerTimer`. The all-gather is slowed by 0.3 s (a wrapper
around ``dist.all_gather_single``, the collective FSDP2 gathers with); the first step's forward gathers,
so its time must include the 0.3 s. The control: the second step's forward finds the parameters still
gathered (``reshard_after_forward=False``, no backward in between), does not gather, and reads far less,
so the 0.3 s of the first step is the gather and not something else.

The activation meter must count what the sharded block saves for backward as it counts an unsharded
copy's: the input, not the gathered weight (which a matmul saves too, and which the layer holds anyway).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_dynmo.pipeline.sharding import shard_unit
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.profiling.layer_timer import LayerTimer
from lightning_dynmo.profiling.memory import ActivationMeter
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

DELAY_S = 0.3


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    gathers = []
    gather = dist.all_gather_single

    def slowed(*args: Any, **kwargs: Any) -> Any:
        gathers.append(time.perf_counter())
        time.sleep(DELAY_S)
        return gather(*args, **kwargs)

    dist.all_gather_single = slowed  # type: ignore[assignment]  # this forked rank only
    block = nn.Linear(8, 8, dtype=torch.float64)
    shard_unit(block, DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    timer = LayerTimer({0: block}, StepClock("cpu"))
    timer.attach()
    times = []
    for _ in range(2):
        timer.begin_step()
        with torch.no_grad():
            block(torch.ones(2, 8, dtype=torch.float64))
        times.append(timer.end_step()[0].fwd_time_s)
    timer.detach()
    return {
        "times": times,
        "gathers": len(gathers),
        "saved": [_saved_bytes(sharded) for sharded in (True, False)],
    }


def _saved_bytes(sharded: bool) -> int:
    torch.manual_seed(0)
    block = nn.Linear(64, 64, dtype=torch.float64)
    if sharded:
        shard_unit(block, DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    meter = ActivationMeter({0: block})
    meter.attach()
    block(torch.ones(2, 64, dtype=torch.float64, requires_grad=True)).sum().backward()
    meter.detach()
    return meter.per_microbatch(0)[0]


def test_unit_forward_time_contains_its_all_gather(tmp_path: Any) -> None:
    for result in run_distributed(_worker, 2, tmp_path, timeout_s=60):
        first, second = result["times"]
        assert result["gathers"] == 1  # the first forward gathered, the second did not
        assert first >= DELAY_S, result
        assert second < DELAY_S / 3, result
        sharded, plain = result["saved"]
        assert sharded == plain == 2 * 64 * 8, result  # the float64 input only
