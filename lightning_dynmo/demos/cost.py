"""Emulated layer cost: sleep in forward and backward, using no CPU.

Sleeping keeps pipeline timings meaningful even with more processes than cores (measured in
``shared/notes/feasibility.md`` section 6), so balance can be benchmarked on a small machine. A sleep
wakes late on a busy machine: :data:`SLEEPS` adds up, per process, what was asked and what was slept,
so a benchmark can state the costs its layers really had. With ``SLEEPS.feedback`` on, each sleep asks
for less by the wake-up delay the process's last sleeps had, so a sleep lasts what it was asked to under
any load that leaves the delay shorter than the sleep.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dynmo.demos import hardware

__all__ = ["FEEDBACK_GAIN", "SLEEPS", "EmulatedCost", "SleepAccount", "check_emulated_ms"]


#: How far one sleep moves the wake-up delay estimate towards the delay it had (an exponential average).
FEEDBACK_GAIN = 0.05


@dataclass
class SleepAccount:
    """What this process's emulated costs asked to sleep and how long they slept, seconds.

    Attributes:
        requested_s: Seconds the emulated costs asked for.
        slept_s: Seconds their sleeps lasted.
        feedback: Ask the operating system for ``seconds - wakeup_s`` (not below 0) instead of ``seconds``,
            and follow each sleep's own delay in ``wakeup_s``: on a machine with more sleeping processes
            than cores, a sleep wakes 0.1-1 ms late, which would add to every emulated call.
        wakeup_s: The estimated wake-up delay (an exponential average, :data:`FEEDBACK_GAIN`), kept
            while ``feedback`` is on.
    """

    requested_s: float = 0.0
    slept_s: float = 0.0
    feedback: bool = False
    wakeup_s: float = 0.0

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` (with ``feedback``: for as long as that, late wake-up included) and count it."""
        ask = max(0.0, seconds - self.wakeup_s) if self.feedback else seconds
        start = time.perf_counter()
        time.sleep(ask)
        slept = time.perf_counter() - start
        if self.feedback:  # a sleep of 0 updates too, or one long stall would leave every ask at 0
            self.wakeup_s += FEEDBACK_GAIN * (slept - ask - self.wakeup_s)
        self.requested_s += seconds
        self.slept_s += slept

    @property
    def overshoot(self) -> float:
        """Slept over requested (1.0 before any sleep)."""
        return self.slept_s / self.requested_s if self.requested_s > 0 else 1.0


#: This process's account of every emulated sleep.
SLEEPS = SleepAccount()


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fwd_s: float, bwd_s: float) -> Tensor:
        ctx.bwd_s = bwd_s
        SLEEPS.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        SLEEPS.sleep(ctx.bwd_s)
        return grad, None, None


class _WeightSleep(torch.autograd.Function):
    """Identity on a parameter whose backward sleeps: it runs where the parameter's gradient is computed
    (the weight pass of a split-backward schedule, or the whole backward of any other)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, wgrad_s: float) -> Tensor:
        ctx.wgrad_s = wgrad_s
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        SLEEPS.sleep(ctx.wgrad_s)
        return grad, None


def check_emulated_ms(fwd_ms: float, bwd_ms: float | None) -> None:
    """Raise ``ValueError`` unless both emulated costs (``bwd_ms=None``: twice ``fwd_ms``) are >= 0 ms."""
    bwd = 2.0 * fwd_ms if bwd_ms is None else bwd_ms
    if fwd_ms < 0 or bwd < 0:
        raise ValueError(f"fwd_ms={fwd_ms}, bwd_ms={bwd_ms}: emulated costs must be >= 0 milliseconds.")


class EmulatedCost(torch.nn.Module):
    """Identity whose forward sleeps ``fwd_ms`` and whose backward sleeps ``bwd_ms`` (default 2x).

    The values are plain attributes, so they can be changed during training (a dynamic model) and
    travel with the layer when it migrates. On an emulated slow worker
    (:func:`~lightning_dynmo.demos.hardware.set_emulated_slowdown`) both sleeps stretch by its factor.

    With ``split_backward=True`` the cost owns one zero parameter (``anchor``, whose gradient is always 0,
    so training is unchanged) and ``wgrad_ms`` more milliseconds are slept on the path to it: in the
    weight-gradient pass of a schedule that splits the backward (zero-bubble, DualPipeV), in the one
    backward of any other. ``bwd_ms`` then sleeps in the input-gradient pass.

    Args:
        fwd_ms: Forward sleep per call, milliseconds (>= 0).
        bwd_ms: Backward sleep per call, milliseconds; ``None`` means ``2 * fwd_ms``.
        split_backward: Own the ``anchor`` parameter that ``wgrad_ms`` sleeps on.
    """

    def __init__(self, fwd_ms: float = 0.0, bwd_ms: float | None = None, split_backward: bool = False):
        super().__init__()
        check_emulated_ms(fwd_ms, bwd_ms)
        self.fwd_ms = float(fwd_ms)
        self.bwd_ms = float(2.0 * fwd_ms if bwd_ms is None else bwd_ms)
        self.wgrad_ms = 0.0
        self.anchor = torch.nn.Parameter(torch.zeros(())) if split_backward else None

    def forward(self, x: Tensor) -> Tensor:
        if self.wgrad_ms > 0.0 and self.anchor is None:
            raise ValueError(
                f"wgrad_ms={self.wgrad_ms} needs a weight to sleep on; build "
                "EmulatedCost(split_backward=True)."
            )
        if self.fwd_ms == 0.0 and self.bwd_ms == 0.0 and self.wgrad_ms == 0.0:
            return x
        factor = hardware.emulated_slowdown()
        slept: Tensor = _Sleep.apply(x, factor * self.fwd_ms / 1e3, factor * self.bwd_ms / 1e3)  # type: ignore[no-untyped-call]
        if self.anchor is not None and self.wgrad_ms > 0.0:
            weight: Tensor = _WeightSleep.apply(self.anchor, factor * self.wgrad_ms / 1e3)  # type: ignore[no-untyped-call]
            slept = slept + 0.0 * weight  # the anchor's gradient is 0: the sleep is all it adds
        return slept
