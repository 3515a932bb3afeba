"""Gradients of a pipeline step, handed to Lightning's automatic optimization, and reduced across ranks.

A schedule step computes forward *and* backward inside ``training_step``, but Lightning then runs
``zero_grad`` (first batch of an accumulation window) and ``backward(loss)``. To keep Lightning's
semantics exactly, the step's gradients are taken out of ``.grad`` (leaving any accumulated ones in
place) and re-injected by the returned loss: :func:`loss_carrying_grads` returns a tensor whose value
is the loss and whose backward adds ``grad_output * g`` to each parameter. So accumulation, the loss
normalisation by ``accumulate_grad_batches`` and precision-plugin loss scaling all act on the
pipeline's gradients exactly as they would on an ordinary backward.

:func:`average_grads` averages gradients over a data-parallel group and :func:`clip_grad_norm`
clips by the norm over all stages (the per-rank norms are combined over the pipeline group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn


def check_no_step_in_flight(in_flight: bool, call: str) -> None:
    """Refuse ``call`` (a migration) while a step's gradients wait in the loss that carries them.

    Between the schedule step and Lightning's ``backward`` the step's gradients are not in ``.grad`` but
    in that loss: layers moved then would arrive without them, and the step's update would be lost.

    Raises:
        RuntimeError: saying where to call it instead.
    """
    if in_flight:
        raise RuntimeError(
            f"{call} was called inside a training step (between the pipeline schedule step and Lightning's "
            "backward: on_pipeline_step_end, on_before_zero_grad, on_before_backward or on_after_backward), "
            "where the step's gradients are held by the loss that carries them into backward; moved layers "
            "would arrive without them and the step's update would be lost. Call it at a step boundary: in a "
            "callback's on_train_batch_start or on_train_batch_end, or in on_before_optimizer_step (the "
            "gradients are in .grad there and move with the layers)."
        )


def take_grads(params: Sequence[nn.Parameter]) -> list[Tensor | None]:
    """Detach every ``.grad`` from ``params`` and return them (``None`` where there was none)."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def restore_grads(params: Sequence[nn.Parameter], grads: Sequence[Tensor | None]) -> None:
    """Put back gradients taken by :func:`take_grads`."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g


class _CarryGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss: Tensor, grads: list[Tensor | None], scale: float, *params: Tensor) -> Tensor:
        ctx.grads, ctx.scale = grads, scale
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        # grad_output is 1 (or 1/accumulate_grad_batches, or an AMP loss scale): scale like autograd would.
        # One fused multi-tensor op per dtype and device (not one op per parameter: on a GPU, one kernel
        # launch per group); out of place, so the gradients handed in stay as they were.
        grads: list[Tensor | None] = ctx.grads
        ctx.grads = None
        scaled: list[Tensor | None] = [None] * len(grads)
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, g in enumerate(grads):
            if g is not None and g.layout != torch.strided:
                scaled[i] = g * (grad_output * ctx.scale).to(
                    g.dtype
                )  # a sparse gradient: the fused ops take dense ones
            elif g is not None:
                by_kind.setdefault((g.dtype, g.device), []).append(i)
        factor_of_output = grad_output if ctx.scale == 1.0 else grad_output * ctx.scale
        for (dtype, device), index in by_kind.items():
            factor: Tensor = factor_of_output.to(device=device, dtype=dtype)
            dense = [cast(Tensor, grads[i]) for i in index]  # the indices of gradients that are set
            for i, out in zip(index, torch._foreach_mul(dense, factor), strict=True):
                scaled[i] = out
        return (None, None, None, *scaled)


def loss_carrying_grads(
    loss: Tensor, params: Sequence[nn.Parameter], grads: Sequence[Tensor | None], scale: float = 1.0
) -> Tensor:
    """A tensor equal to ``loss`` whose backward adds ``grads`` times the incoming gradient times ``scale``
    to ``params``.

    ``scale`` lets a caller fold a division of the gradients into this one pass over them (the training
    step passes ``1 / micro-batches`` instead of dividing the schedule's gradients first). If no
    parameter takes a gradient (a fully frozen stage), the result still supports ``backward()`` so
    Lightning's loop runs unchanged; it then changes no ``.grad``.
    """
    pairs = [(p, g) for p, g in zip(params, grads, strict=True) if p.requires_grad]
    if not pairs:
        anchor = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        carried: Tensor = _CarryGrads.apply(loss, [None], scale, anchor)  # type: ignore[no-untyped-call]
        return carried
    carried = _CarryGrads.apply(loss, [g for _, g in pairs], scale, *(p for p, _ in pairs))  # type: ignore[no-untyped-call]
    return carried


def average_grads(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, size: int) -> None:
    """Average the gradients of ``params`` over ``group`` (``size`` members), one collective per dtype.

    Every member must pass the same parameters in the same order (the same stage of each replica). A
    parameter that has no gradient on some members (an expert no token of that replica was routed to)
    counts as zero there, so every member ends with the same mean, as one process would compute over the
    union of the replicas' batches; it keeps no gradient only where no member had one. Each parameter's
    "has a gradient" flag travels in the same flat buffer as the gradients, so buffers always agree in size.
    """
    trainable = [p for p in params if p.requires_grad]
    if size == 1 or not trainable:
        return
    by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in trainable:
        by_dtype.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), same in by_dtype.items():
        flags = torch.tensor([p.grad is not None for p in same], dtype=dtype, device=device)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in same]
        flat = torch.cat([*(g.reshape(-1) for g in grads), flags])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for p, g, anywhere in zip(same, grads, flat[-len(same) :].tolist(), strict=True):
            if anywhere > 0:
                g.copy_(flat[offset : offset + g.numel()].view_as(g)).div_(size)
                p.grad = g
            offset += g.numel()


def clip_grad_norm(
    params: Sequence[Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
    counted: Sequence[Tensor] | None = None,
) -> Tensor:
    """Clip gradients by their total norm over every rank of ``group`` (e.g. all pipeline stages).

    Matches :func:`torch.nn.utils.clip_grad_norm_` on the union of all ranks' parameters: each rank's
    local norm is combined over ``group`` (sum of ``norm**p``, or max for ``inf``), then every rank
    scales its own gradients by the same factor. With ``group=None`` only local gradients count.

    Args:
        params: This rank's parameters; all of their gradients are scaled.
        max_norm: The largest total norm allowed.
        group: The ranks whose norms combine (``None``: this rank only).
        norm_type: The p of the p-norm (``inf`` for the max norm).
        counted: The parameters whose gradients count in the norm (default: ``params``). A copy of a
            parameter held on two ranks (a tied embedding) counts once but is scaled on both.

    Returns:
        The total (global) norm.
    """
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in (with_grad if counted is None else counted) if p.grad is not None]
    norm_type = float(norm_type)
    # Combine in float64 so ranks without gradients (frozen stages) agree on the collective's dtype; on
    # the parameters' device, since NCCL only reduces device tensors.
    device = params[0].device if params else torch.device("cpu")
    local = (
        torch.nn.utils.get_total_norm(grads, norm_type).double()
        if grads
        else torch.zeros((), dtype=torch.float64, device=device)
    )
    total = local
    if group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = local**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            total = total ** (1.0 / norm_type)
    if with_grad:
        total = total.to(with_grad[0].dtype)
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    return total
