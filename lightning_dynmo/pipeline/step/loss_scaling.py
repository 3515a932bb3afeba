"""fp16 loss scaling across a pipeline: the schedule's backward runs on the scaled loss, and the ranks skip
overflowing steps together.

Read :class:`PipelineLossScaling`: :meth:`~PipelineLossScaling.scaled_backward` (around one schedule step)
and :meth:`~PipelineLossScaling.agree_on_overflow` (installed once, at setup).

With ``precision="16-mixed"`` Lightning's ``MixedPrecision`` plugin multiplies the loss it back-propagates
by the ``GradScaler``'s scale, so that small gradients survive float16; it unscales them before the
optimizer step and skips the step when one is not finite, halving the scale. Under the strategy two
things break that:

* The real backward runs inside the schedule step, before Lightning's ``backward``: the loss Lightning
  scales only carries the finished gradients (:mod:`lightning_dynmo.pipeline.step.grads`), so the float16
  activations' gradients were computed unscaled and underflowed. :meth:`scaled_backward` makes the
  schedule's own loss scaled in backward (its value, which is logged, stays the loss) and divides the
  step's gradients by the same scale afterwards, so Lightning's scaling applies to them exactly once.
  The scale is a power of two, so this round trip is exact.
* Each rank unscales and checks only its own stage's gradients: after an overflow on one stage its
  rank skips the step while the others take it. :meth:`agree_on_overflow` wraps the scaler's
  ``unscale_`` so that the ranks agree, over the active group, on whether any of them found an
  infinity: every rank then skips the step, and the scale drops on every rank.

Both reach into private torch state (the schedule's ``_loss_fn``, the scaler's per-optimizer
``found_inf_per_device``), which torch 2.13 (the version this package supports) keeps as used here.
On CUDA the scale and the agreement stay on the device (NCCL reduces device tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["PipelineLossScaling"]


class _ScaleBackward(torch.autograd.Function):
    """The loss itself in forward; its gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, scale: Tensor) -> Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale.to(grad.dtype), None


class PipelineLossScaling:
    """Loss scaling of a precision plugin, applied inside the pipeline (a no-op without a scaler).

    Args:
        precision_plugin: The Trainer's precision plugin; only a ``GradScaler`` it holds (``16-mixed``)
            is used.
        group: Returns the process group whose ranks must agree on overflows (the active ranks).
        device: This rank's device (where the agreement's tensor lives).
    """

    def __init__(
        self, precision_plugin: Any, group: Callable[[], dist.ProcessGroup | None], device: torch.device
    ) -> None:
        scaler = getattr(precision_plugin, "scaler", None)
        self.scaler: torch.amp.GradScaler | None = (
            scaler if scaler is not None and scaler.is_enabled() else None
        )
        self._group = group
        self._device = device

    @property
    def scale(self) -> float:
        """The factor the pipeline's backward runs with (1.0 without a scaler); auxiliary losses
        (:mod:`lightning_dynmo.pipeline.step.aux_loss`) get it as their gradient."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    @contextmanager
    def scaled_backward(self, pipe: Any) -> Generator[None, None, None]:
        """Around one schedule step of ``pipe`` (a ``BuiltPipeline``): its backward runs on the scaled loss.

        The stage parameters' ``.grad`` must hold only this step's gradients (as ``run_schedule_step``
        requires); on exit they are divided by the scale again.
        """
        if self.scaler is None:
            yield
            return
        scale = self.scaler.scale(torch.ones((), device=self._device))
        schedule = pipe.schedule
        loss_fn = schedule._loss_fn

        def scaled_loss(*args: Any, **kwargs: Any) -> Tensor:
            scaled: Tensor = _ScaleBackward.apply(loss_fn(*args, **kwargs), scale)  # type: ignore[no-untyped-call]
            return scaled

        schedule._loss_fn = scaled_loss
        try:
            yield
        finally:
            schedule._loss_fn = loss_fn
        seen: set[int] = set()
        for module in pipe.modules:
            for p in module.parameters():
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    p.grad.div_(scale.to(p.grad.dtype))

    def agree_on_overflow(self) -> None:
        """Make the scaler's ``unscale_`` agree, over the group, on whether a gradient was not finite."""
        scaler = self.scaler
        if scaler is None:
            return
        unscale = type(scaler).unscale_.__get__(scaler)

        def agreeing_unscale_(optimizer: torch.optim.Optimizer) -> None:
            unscale(optimizer)
            self._agree(scaler._per_optimizer_states[id(optimizer)])

        scaler.unscale_ = agreeing_unscale_  # type: ignore[method-assign]

    def _agree(self, optimizer_state: dict[str, Any]) -> None:
        found = optimizer_state["found_inf_per_device"]
        local = torch.zeros((), dtype=torch.float32, device=self._device)
        for flag in found.values():
            local += flag.to(device=self._device, dtype=torch.float32)
        group = self._group()
        if dist.is_available() and dist.is_initialized() and group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        agreed = (local > 0).to(torch.float32)
        # A rank without gradients (a fully frozen stage) found nothing, but must record the verdict too.
        optimizer_state["found_inf_per_device"] = {d: agreed.to(d) for d in found} or {self._device: agreed}
