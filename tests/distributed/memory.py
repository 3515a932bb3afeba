"""Memory a rank holds: its peak resident growth while it builds and sets up a model, and its model tensors.

:class:`Watch` (a callback) records, outside the code under test, the peak resident memory growth (the
kernel's ``VmHWM``, reset in the ``setup`` hook) while ``configure_model`` and the strategy build and set up
the model, the initial weights, and the bytes of model tensors the rank holds after every batch.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from tests.distributed.fitting import local_state
from tests.distributed.meta_model import model_bytes

MIB = 1 << 20


def resident_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def fresh_pages_for_big_allocations() -> None:
    """Make resident memory growth count what is allocated from now on (glibc, Linux).

    A forked rank inherits the parent's free heap pages, already resident: allocations reusing them do
    not grow the resident size. Free pages are handed back (``malloc_trim``), and allocations of 1 MiB
    and more get fresh pages of their own (a fixed ``mmap`` threshold instead of glibc's sliding one).
    """
    libc = ctypes.CDLL("libc.so.6")
    m_mmap_threshold = -3
    assert libc.mallopt(m_mmap_threshold, MIB) == 1
    libc.malloc_trim(0)


class Watch(pl.Callback):
    """Records the peak memory growth while the model is built and set up, the initial weights, and the
    bytes of model tensors held after every batch.

    The window opens in the ``setup`` hook (after Lightning's own start-up, before ``configure_model`` and
    the strategy's setup) and closes when training starts.
    """

    def __init__(self) -> None:
        self.baseline_kib = 0
        self.setup_growth = 0
        self.initial: dict[str, torch.Tensor] = {}
        self.held: list[int] = []

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        # Garbage inherited from the parent (an earlier test's Trainer and its optimizer state) would be
        # freed inside the window and hide what is allocated there: collect it first.
        gc.collect()
        fresh_pages_for_big_allocations()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident size (VmHWM) to now
        self.baseline_kib = resident_kib("VmRSS")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.setup_growth = (resident_kib("VmHWM") - self.baseline_kib) * 1024
        self.initial = local_state(pl_module)
        self.held.append(model_bytes(pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.held.append(model_bytes(pl_module))
