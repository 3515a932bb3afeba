"""A parameter the first-stage and last-stage parts share (a tied token embedding and head), across ranks.

Read :func:`tie_peer` (which rank holds the other copy), :func:`tied_copies` and :func:`add_peer_grads`
(each step the two copies' gradients are summed, so both take the single-process step), then
:func:`merge_tied_copies` (a re-pack that brings both parts onto one rank makes them one parameter again).

The first stage runs on the pipeline's first rank; the last stage on its last rank (loop layouts) or on
the first one too (V layouts, or a single stage). The ties themselves are found by
:func:`lightning_dynmo.pipeline.contract.find_tied_parameters`. No process group is created: the copies'
gradients travel over the pipeline group, point to point, so every rank keeps the same set of groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.pipeline.contract import TiedParameter

__all__ = ["add_peer_grads", "merge_tied_copies", "tie_peer", "tied_copies"]


def tie_peer(rank: int, pipeline_ranks: Sequence[int], last_position: int) -> tuple[int, str] | None:
    """``(the rank holding the other copy, this rank's side "first" or "last")``, or ``None``.

    ``None`` when this rank holds no copy, or holds both (the last stage runs on the first rank:
    ``last_position == 0``).
    """
    first, last = pipeline_ranks[0], pipeline_ranks[last_position]
    if last_position == 0 or rank not in (first, last):
        return None
    return (last, "first") if rank == first else (first, "last")


def tied_copies(module: nn.Module, ties: Sequence[TiedParameter], side: str) -> list[nn.Parameter]:
    """This rank's copy of each tied parameter: under its first-stage name, or its last-stage name."""
    return [module.get_parameter(t.first_name if side == "first" else t.last_name) for t in ties]


def add_peer_grads(params: Sequence[nn.Parameter], peer: int, group: dist.ProcessGroup | None) -> None:
    """Exchange the gradients of ``params`` with ``peer`` (point to point) and add the peer's to ours.

    Both ranks call it with their copies in the same order; a copy without a gradient counts as zero.
    ``a + b`` on one rank and ``b + a`` on the other are the same in floating point.
    """
    received, ops = [], []
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        buffer = torch.empty_like(param.grad)
        received.append(buffer)
        ops.append(dist.P2POp(dist.isend, param.grad, peer, group))
        ops.append(dist.P2POp(dist.irecv, buffer, peer, group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    for param, buffer in zip(params, received, strict=True):
        assert param.grad is not None
        param.grad.add_(buffer)


def merge_tied_copies(
    module: nn.Module, ties: Sequence[TiedParameter], optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Make a last-stage copy that arrived on the first stage's rank the first-stage parameter again.

    The two copies have taken the same steps, so nothing changes in value; a gradient the dropped copy
    held (inside an accumulation window) is added to the kept one, and the dropped copy leaves the
    optimizers with its state.
    """
    for tie in ties:
        kept, arrived = module.get_parameter(tie.first_name), module.get_parameter(tie.last_name)
        if kept is arrived:
            continue
        if arrived.grad is not None:
            kept.grad = arrived.grad if kept.grad is None else kept.grad + arrived.grad
        owner, _, attr = tie.last_name.rpartition(".")
        setattr(module.get_submodule(owner), attr, kept)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"][:] = [p for p in group["params"] if p is not arrived]
            optimizer.state.pop(arrived, None)
