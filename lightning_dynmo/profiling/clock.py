"""Time stamps for profiling hooks that never stall the device.

On CPU a mark is a ``time.perf_counter`` reading. On CUDA a mark is a recorded ``torch.cuda.Event``:
taking it does not synchronise, so the pipeline's compute/communication overlap is left alone (the
paper's reference code synchronised around every layer, which distorts exactly what we want to
measure). Marks are resolved into seconds once, after the step, by :meth:`StepClock.elapsed_s`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

Mark = Any  # float on CPU, torch.cuda.Event on CUDA


class StepClock:
    """Takes marks during a step and turns pairs of marks into seconds after it.

    Args:
        device: The device whose work is timed. ``cuda`` devices use CUDA events, anything else uses
            ``time.perf_counter``.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.uses_cuda_events = self.device.type == "cuda"

    def mark(self) -> Mark:
        """Take a time stamp now (on CUDA: in the current stream's order, without waiting for it)."""
        if self.uses_cuda_events:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def synchronize(self) -> None:
        """Wait until every mark taken so far can be resolved (a no-op on CPU)."""
        if self.uses_cuda_events:
            torch.cuda.synchronize(self.device)

    def wait(self, mark: Mark) -> None:
        """Wait until the device has passed ``mark`` (only that far: a no-op on CPU)."""
        if self.uses_cuda_events:
            mark.synchronize()

    def elapsed_s(self, start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end``; call :meth:`synchronize` first on CUDA."""
        if self.uses_cuda_events:
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)
