"""The stall part of the GPU check: which steps stall when a block's shapes change from step to step.

On one H100 (2026-11-28) the per-layer costs of MoD and early exit showed one block 10x its steady cost
in one profiling window and not in the next (``benchmarks/results/gpu/2026-11-28``). Both cases change
the shapes a block sees every step (routed or surviving tokens). This part trains such a case in a plain
loop, with no Lightning, profiler or pipeline in the way, and records per step: its wall time (the device
synchronised), each block's forward calls (CUDA events; on CPU ``perf_counter``: their sum and their
slowest) and what the CUDA caching allocator did in it (segments taken from and given back to the
device, retries after a failed allocation). A stall that comes with allocator work is the allocator's;
one without it points at a new shape's first kernels.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_dynmo.gpu_check.plan import Sizes
from lightning_dynmo.gpu_check.training import CASES, VOCAB
from lightning_dynmo.models import GPT
from lightning_dynmo.profiling.clock import StepClock

#: The allocator counters recorded per step (their change over the step), from ``torch.cuda.memory_stats``.
ALLOCATOR_COUNTERS = ("segment.all.allocated", "segment.all.freed", "num_alloc_retries")


def step_stalls(options: dict[str, Any], sizes: Sizes, device: str) -> dict[str, Any]:
    """Train ``options["case"]`` for ``options["steps"]`` steps in a plain loop and record every step."""
    case, steps = options["case"], int(options["steps"])
    config, _ = CASES[case](sizes)  # the case's own callbacks (none for MoD and early exit) are not run
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(config, seq_len=sizes.seq_len)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    blocks = list(model.layers.values())
    clock = StepClock(device)
    calls: list[list[Any]] = [[] for _ in blocks]  # this step's forward calls of each block: [start, end]
    handles = [h for i, block in enumerate(blocks) for h in _watch(block, calls[i], clock)]
    rows = []
    try:
        for step in range(steps):
            for c in calls:
                c.clear()
            rows.append(_one_step(model, optimizer, calls, sizes, clock) | {"step": step})
    finally:
        for handle in handles:
            handle.remove()
    walls = sorted(r["wall_ms"] for r in rows)
    return {
        "case": case,
        "device": device,
        "steps": rows,
        "median_wall_ms": walls[len(walls) // 2],
        "max_wall_ms": walls[-1],
    }


def _one_step(
    model: GPT, optimizer: torch.optim.Optimizer, calls: list[list[Any]], sizes: Sizes, clock: StepClock
) -> dict[str, Any]:
    device = clock.device.type
    cuda = device == "cuda"
    before = torch.cuda.memory_stats() if cuda else {}
    clock.synchronize()
    start = time.perf_counter()
    rows = sizes.batch_size // sizes.num_microbatches
    for _ in range(sizes.num_microbatches):
        tokens = torch.randint(0, VOCAB, (rows, sizes.seq_len + 1), device=device)
        idx, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            logits = model(idx, labels)
        loss: Any = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    clock.synchronize()
    wall_ms = 1e3 * (time.perf_counter() - start)
    after = torch.cuda.memory_stats() if cuda else {}
    times = [[1e3 * clock.elapsed_s(a, b) for a, b in block_calls] for block_calls in calls]
    return {
        "wall_ms": round(wall_ms, 3),
        "block_fwd_ms": [round(sum(t), 3) for t in times],
        "block_slowest_call_ms": [round(max(t, default=0.0), 3) for t in times],
        "allocator": {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR_COUNTERS},
    }


def _watch(block: nn.Module, calls: list[list[Any]], clock: StepClock) -> list[RemovableHandle]:
    """Hooks that mark each forward call's start and end on ``block``."""

    def pre(module: nn.Module, args: Any) -> None:
        calls.append([clock.mark(), None])

    def post(module: nn.Module, args: Any, output: Any) -> None:
        calls[-1][1] = clock.mark()

    return [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
