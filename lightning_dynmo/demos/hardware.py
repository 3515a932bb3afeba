"""Emulated heterogeneous hardware for tests and benchmarks: a slow worker and a slow link, per process.

- :func:`set_emulated_slowdown`: every :class:`~lightning_dynmo.demos.EmulatedCost` in this process (this
  rank) sleeps that many times longer, like a worker that is that many times slower: a block that
  migrates here costs more here. :func:`emulated_speed_probe` is the matching reference workload for
  ``DynMoCallback(profiling=ProfilingConfig(speed_probe=...))``: a fixed sleep, stretched by the same
  factor, and timed.
- :func:`emulate_slow_link`: sends from this process to one peer wait ``latency + bytes * s_per_byte``
  before they are posted, in the sending thread, like a synchronous send over a congested link. It wraps
  ``torch.distributed.isend``, through which torch's pipeline stages and ``send`` (the link measurement)
  post their sends, so the profiler's link measurement sees the same delay as training does.

Real hardware does not need any of this: the real probe (``profiling.speed``) and the real link
measurement (``profiling.comm``) see real slowness. These exist because a 2-core machine has neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

#: Emulated milliseconds of the reference workload on a worker of slowdown 1.0. Long enough that a busy
#: machine's late wake-up (a few ms, more when other processes share the cores) barely moves the ratio of
#: two workers' probes, which is what the slowdown is read from.
PROBE_MS = 50.0
#: Timed sleeps per probe; the shortest is the reading.
PROBE_REPEATS = 3

_SLOWDOWN = 1.0


def set_emulated_slowdown(factor: float) -> None:
    """Make this process an emulated worker ``factor`` times slower (1.0: the reference)."""
    if not factor > 0:
        raise ValueError(f"factor={factor!r} must be > 0 (1.0 is the reference speed, 2.0 half as fast).")
    global _SLOWDOWN
    _SLOWDOWN = float(factor)


def emulated_slowdown() -> float:
    """This process's emulated slowdown factor."""
    return _SLOWDOWN


def emulated_speed_probe(device: torch.device, dtype: torch.dtype) -> float:
    """Seconds of the emulated reference workload on this process (``PROBE_MS`` times its slowdown).

    The shortest of :data:`PROBE_REPEATS` timed sleeps: a late wake-up only ever lengthens a sleep. With
    one sleep per probe, a slowdown of 3 once read 2.55 on 2 cores shared by three test processes (the
    real probe, ``profiling.speed``, repeats its workload and takes the median for the same reason).
    """
    times = []
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        time.sleep(PROBE_MS * _SLOWDOWN / 1e3)
        times.append(time.perf_counter() - start)
    return min(times)


def emulate_slow_link(to_rank: int, s_per_byte: float, latency_s: float = 0.0) -> Callable[[], None]:
    """Delay every send from this process to global rank ``to_rank``; returns the function that undoes it.

    Args:
        to_rank: The global rank at the other end of the slow link (this direction only).
        s_per_byte: Seconds per byte sent (a bandwidth of ``1 / s_per_byte`` bytes per second).
        latency_s: Seconds added to every send.
    """
    if s_per_byte < 0 or latency_s < 0:
        raise ValueError(f"s_per_byte={s_per_byte}, latency_s={latency_s} must be >= 0.")
    # ``send`` posts through the module's ``isend``, so wrapping ``isend`` delays both, once.
    originals = {name: getattr(c10d, name) for name in ("isend",)}

    def delayed(original: Callable[..., Any]) -> Callable[..., Any]:
        def send(
            tensor: torch.Tensor,
            dst: int | None = None,
            group: dist.ProcessGroup | None = None,
            tag: int = 0,
            group_dst: int | None = None,
        ) -> Any:
            peer = (
                dst
                if group_dst is None
                else dist.get_global_rank(group or c10d._get_default_group(), group_dst)
            )
            if peer == to_rank:
                time.sleep(latency_s + tensor.numel() * tensor.element_size() * s_per_byte)
            return original(tensor, dst, group, tag, group_dst=group_dst)

        return send

    for name, original in originals.items():
        wrapped = delayed(original)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)

    def undo() -> None:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)

    return undo
