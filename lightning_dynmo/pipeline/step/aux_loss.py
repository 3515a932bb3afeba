"""Auxiliary losses from any block or part, with their gradient applied on the stage where they arise.

Read in this order: :func:`add_aux_loss` (what a block calls), :func:`collect_aux_losses` (who listens),
then :func:`reduce_step_losses` (how the strategy turns one step's values into the numbers it logs).

Why the loss rides on the hidden state. A MoE router's load-balancing loss, a router z-loss or an early
exit's loss arises in a middle block; its gradient only concerns that block's parameters (and those
upstream of it). Shipping the value to the last stage and adding it to the main loss would need an
extra transfer per micro-batch and a loss the schedule does not know about. Instead,
:func:`add_aux_loss` ties the auxiliary loss to the block's output with an autograd function that
returns the output unchanged and, in backward, hands the auxiliary loss a gradient of ``scale`` (the
idea of Megatron-LM's ``MoEAuxLossAutoScaler``). When the backward of the main loss reaches the block's
output, the auxiliary loss's gradient flows into the block as if ``main + aux`` had been
differentiated. Nothing travels, and torch's schedules (including zero-bubble ones, which split input
and weight gradients) need to know nothing about it.

Scaling. The strategy runs each micro-batch's backward with gradient 1 on its loss and divides every
gradient by the micro-batch count afterwards, so ``scale`` is 1 there and each micro-batch's auxiliary
loss is averaged exactly like its main loss; gradient accumulation, data-parallel averaging and
precision-plugin loss scaling then act on both alike (they act on the gradients the strategy hands to
Lightning). An fp16 loss scaler that scales the pipeline's loss passes its factor as ``scale``.

In a single process (the model's own ``training_step``, the reference the strategy is tested against)
Lightning scales the returned loss (``1 / accumulate_grad_batches``, an fp16 loss scale), which a
gradient injected with a fixed ``scale`` would miss. There, collect with ``attach=False`` and add the
terms to the returned loss::

    with collect_aux_losses(attach=False) as aux:
        loss = self.pipeline_loss(self(inputs), target)
    return loss + aux.total()

Outside any :func:`collect_aux_losses` block the gradient is attached with ``scale`` 1, which is exact
for a plain ``loss.backward()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["AuxLossRecord", "add_aux_loss", "aux_loss_scale", "collect_aux_losses", "reduce_step_losses"]


@dataclass(eq=False)  # compared by identity: open records are removed from the stack by `is`, not value
class AuxLossRecord:
    """The auxiliary loss values added while a :func:`collect_aux_losses` block was open.

    Attributes:
        values: Per name, every detached value added, in order.
        allowed: If set, the only names :func:`add_aux_loss` accepts (the model's declared ones).
        scale: The gradient each auxiliary loss receives in backward (when ``attach``).
        attach: Whether the losses' gradients ride on the hidden state; if not, the values keep their
            autograd graph and the caller adds :meth:`total` to its loss.
        model_name: For error messages.
    """

    values: dict[str, list[Tensor]] = field(default_factory=dict)
    allowed: tuple[str, ...] | None = None
    scale: float = 1.0
    attach: bool = True
    model_name: str = "the model"

    def total(self) -> Tensor | float:
        """The sum of every value added (with its graph when not ``attach``); 0.0 if none was added."""
        values = [v for vals in self.values.values() for v in vals]
        return torch.stack(values).sum() if values else 0.0

    def totals(self) -> dict[str, Tensor]:
        """Per name, the sum of its recorded values (a float64 scalar tensor each)."""
        return {
            name: torch.stack([v.detach().double() for v in vals]).sum() for name, vals in self.values.items()
        }


_local = threading.local()


def _active() -> AuxLossRecord | None:
    stack: list[AuxLossRecord] = getattr(_local, "stack", [])
    return stack[-1] if stack else None


def aux_loss_scale() -> float:
    """The gradient an auxiliary loss added now receives (1 outside :func:`collect_aux_losses`)."""
    record = _active()
    return record.scale if record is not None else 1.0


@contextlib.contextmanager
def collect_aux_losses(
    *,
    scale: float = 1.0,
    attach: bool = True,
    allowed: Sequence[str] | None = None,
    model_name: str = "the model",
) -> Iterator[AuxLossRecord]:
    """Record the auxiliary losses added inside the block, and decide how their gradients flow.

    Args:
        scale: The gradient each auxiliary loss receives in backward (see the module docstring).
        attach: ``True``: gradients ride on the hidden state (pipelines). ``False``: nothing is
            attached; the values keep their graph and the caller adds ``record.total()`` to its loss.
        allowed: If given, :func:`add_aux_loss` refuses other names (the strategy passes the model's
            ``pipeline_aux_losses``, so every rank logs the same set of terms).
        model_name: Named in the error for an undeclared name.

    Yields:
        The record the values go to.
    """
    record = AuxLossRecord(
        allowed=None if allowed is None else tuple(allowed), scale=scale, attach=attach, model_name=model_name
    )
    stack: list[AuxLossRecord] = getattr(_local, "stack", None) or []
    _local.stack = stack
    stack.append(record)
    try:
        yield record
    finally:
        stack.remove(record)


class _AuxLossCarrier(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.dtype, loss.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad_hidden: Tensor) -> tuple[Tensor, Tensor, None]:
        dtype, device = ctx.loss_meta
        return grad_hidden, torch.full((), ctx.scale, dtype=dtype, device=device), None


def add_aux_loss(name: str, loss: Tensor, hidden: Tensor) -> Tensor:
    """Add the auxiliary loss ``loss`` to the objective, with its gradient applied where it arises.

    Call it in a block's (or part's) forward and continue with the returned tensor::

        hidden = add_aux_loss("moe_load_balance", coefficient * balance_loss, hidden)

    Args:
        name: The term's name; under :class:`~lightning_dynmo.DynMoStrategy` one of the model's
            ``pipeline_aux_losses`` (logged as ``train_aux/<name>``).
        loss: A scalar tensor, already weighted by its coefficient.
        hidden: A tensor on the way to the main loss (the block's output); returned unchanged in value.

    Returns:
        ``hidden``, carrying ``loss``'s gradient in backward: a view of it that must not be modified in
        place (autograd forbids in-place changes of a custom function's view; write ``h = h + x``, not
        ``h += x``, or clone it).

    Raises:
        TypeError: if ``loss`` is not a scalar tensor.
        ValueError: if ``name`` is not among the recording context's allowed names.
    """
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise TypeError(
            f"add_aux_loss({name!r}, ...) got {shape}; an auxiliary loss must be a scalar (0-dim) tensor, "
            "already reduced over the micro-batch (e.g. .mean()) and weighted by its coefficient."
        )
    record = _active()
    if record is not None:
        if record.allowed is not None and name not in record.allowed:
            raise ValueError(
                f"add_aux_loss got the name {name!r}, which {record.model_name} does not declare "
                f"(pipeline_aux_losses={record.allowed!r}); add it to pipeline_aux_losses so every rank logs "
                "the term."
            )
        record.values.setdefault(name, []).append(loss if not record.attach else loss.detach())
        if not record.attach:
            return hidden
    if not (torch.is_grad_enabled() and loss.requires_grad and hidden.requires_grad):
        return hidden
    scale = record.scale if record is not None else 1.0
    out: Tensor = _AuxLossCarrier.apply(hidden, loss, scale)  # type: ignore[no-untyped-call]
    return out


def reduce_step_losses(
    losses: Sequence[Tensor],
    record: AuxLossRecord,
    names: Sequence[str],
    *,
    num_microbatches: int,
    data_parallel_size: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One step's main loss and every declared auxiliary loss, the same on every rank; one collective.

    The main loss is the mean over micro-batches of each replica's last stage, averaged over replicas.
    Each auxiliary term is summed over the layers that added it (on whichever stage they run) and
    averaged over micro-batches and replicas: the amount it added to the step's objective.

    Args:
        losses: This rank's per-micro-batch main losses (``[]`` off the last stage).
        record: This rank's auxiliary loss values from the step.
        names: The model's declared auxiliary loss names (the same on every rank, in the same order).
        num_microbatches: Micro-batches per step.
        data_parallel_size: Pipeline replicas.
        group: All active ranks (``None`` for a single process).
        device: Where the collective's tensor lives.
        dtype: The dtype of the returned values.

    Returns:
        ``(main_loss, {name: aux_loss})``.
    """
    zero = torch.zeros((), dtype=torch.float64, device=device)
    main = torch.stack([x.detach().double() for x in losses]).mean() if losses else zero
    sums = record.totals()
    aux = [sums[n].to(device) / num_microbatches if n in sums else zero for n in names]
    box = torch.stack([main.to(device), *aux])
    if group is not None:
        dist.all_reduce(box, op=dist.ReduceOp.SUM, group=group)
    box = (box / data_parallel_size).to(dtype)
    return box[0], {n: box[i + 1] for i, n in enumerate(names)}
