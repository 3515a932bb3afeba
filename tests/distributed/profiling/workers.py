"""Run a function on N forked ranks meeting through a file store; collect results or tracebacks."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def run_ranks(
    fn: Callable[[int, int], Any], world_size: int, tmp_path: Path, timeout_s: float = 90
) -> list[Any]:
    """``fn(rank, world_size)`` on every rank of a gloo group; returns each rank's return value."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results: dict[int, Any] = {}
    while not queue.empty():
        rank, ok, payload = queue.get()
        if not ok:
            raise AssertionError(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s")
    assert sorted(results) == list(range(world_size)), f"missing results: {sorted(results)}"
    return [results[r] for r in range(world_size)]


def _entry(fn: Callable[[int, int], Any], rank: int, world_size: int, store: str, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),  # a lost peer fails the test instead of hanging it
        )
        result = fn(rank, world_size)
        dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
