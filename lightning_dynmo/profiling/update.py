"""The optimizer update's own clock, for a profiling window only, and its share per profiled unit.

Read :class:`UpdateTimer` first. An update runs once per step, after the pipeline's flush, outside
every layer's hooks, so no layer timer sees it. The timer marks its start when the training loop is
about to update (Lightning's ``on_before_optimizer_step``: the forward and backward closure has run)
and its end in the optimizer's step post-hook, which exists only while the window is open.

The measured seconds are a real measurement shared by a stated rule: an update (AdamW, SGD) costs per
parameter entry it updates, and it updates only the parameters that got a gradient, so each unit
(block or part module) gets the step's update time times its entries with a gradient over all the
entries with a gradient that the optimizer holds on this rank. A frozen unit gets 0. Entries the
optimizer updates outside every unit keep their share (it is not put on the units).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_dynmo.profiling.clock import Mark, StepClock

__all__ = ["UpdateTimer"]

log = logging.getLogger(__name__)


class UpdateTimer:
    """Times each optimizer update of a window and shares it among the units by updated entries.

    Args:
        units: The profiled modules by key (blocks by index, part modules by ``(part, position)``).
        optimizer: The optimizer whose ``step`` is timed (``None``: nothing is timed, every share is 0).
        clock: The window's clock (CUDA events on a GPU: marks never synchronise; they are resolved by
            :meth:`end_step` after the profiler's one synchronise per step).
    """

    def __init__(
        self, units: Mapping[Hashable, nn.Module], optimizer: torch.optim.Optimizer | None, clock: StepClock
    ) -> None:
        self._optimizer = optimizer
        self._clock = clock
        # Each parameter belongs to the first unit that holds it (a tied weight is updated once).
        owner: dict[int, Hashable] = {}
        for key, module in units.items():
            for p in module.parameters():
                owner.setdefault(id(p), key)
        self._owner = owner
        self._keys = list(units)
        self._handle: RemovableHandle | None = None
        self._start: Mark | None = None
        self._entries: dict[Hashable, int] = {}
        self._total = 0
        self._pairs: list[tuple[Mark, Mark, dict[Hashable, int], int]] = []

    @property
    def attached(self) -> bool:
        """Whether the optimizer's step post-hook is registered."""
        return self._handle is not None

    def attach(self) -> None:
        """Register the optimizer's step post-hook (once; a no-op without an optimizer)."""
        if self._handle is None and self._optimizer is not None:
            self._handle = self._optimizer.register_step_post_hook(self._after_update)

    def detach(self) -> None:
        """Remove the post-hook (safe to call twice)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._start = None

    def before_update(self) -> None:
        """The update is about to run: mark its start and count, per unit, the entries with a gradient."""
        if self._handle is None or self._optimizer is None:
            return
        entries = dict.fromkeys(self._keys, 0)
        total = 0
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                total += p.numel()
                key = self._owner.get(id(p))
                if key is not None:
                    entries[key] += p.numel()
        self._entries, self._total = entries, total
        self._start = self._clock.mark()

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._start is None:
            return  # an update the loop did not announce (not one of the window's steps)
        self._pairs.append((self._start, self._clock.mark(), self._entries, self._total))
        self._start = None

    def end_step(self) -> tuple[float, dict[Hashable, float]]:
        """This step's update seconds, and per unit its share (0 each without an update).

        Call after the step, once the clock's marks are resolved (the profiler synchronises once).
        """
        shares = dict.fromkeys(self._keys, 0.0)
        measured = 0.0
        for start, end, entries, total in self._pairs:
            seconds = self._clock.elapsed_s(start, end)
            measured += seconds
            if total == 0:
                continue
            for key, n in entries.items():
                shares[key] += seconds * n / total
            outside = total - sum(entries.values())
            if outside:
                log.debug(
                    "optimizer update: %d of %d updated entries are in no profiled unit", outside, total
                )
        self._pairs = []
        self._start = None
        return measured, shares
