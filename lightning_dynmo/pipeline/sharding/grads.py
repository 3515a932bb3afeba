"""Gradient clipping by the exact norm over every shard of every stage."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_sharded_grad_norm_"]


def clip_sharded_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale the gradients so that their 2-norm over all ranks of ``group`` is at most ``max_norm``.

    Each rank passes the parameters it holds: its shards of its stage's units. Every element of the model's
    gradient lives on exactly one rank of ``group`` (the stages split the units, the data-parallel shards
    split each unit), so the squared norms of the local shards add up, over the group, to the squared norm
    of the whole gradient, which is what one process clipping the whole model computes. Collective over
    ``group``; a rank without parameters (released by a re-pack) still calls it.

    Args:
        parameters: This rank's parameters (sharded DTensors or plain tensors); those without ``.grad``
            are skipped.
        max_norm: The largest norm allowed; must be positive.
        group: Every rank holding a part of the model once, e.g. all active ranks; ``None`` means the
            default group.

    Returns:
        The total norm before clipping (float64 on CPU), the same on every rank.

    Raises:
        ValueError: ``max_norm`` is not positive.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0; pass the clip threshold, e.g. 1.0.")
    grads = [p.grad for p in parameters if p.grad is not None]
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = locals_[0].device if locals_ else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for local in locals_:
        squares += local.detach().to(torch.float64).pow(2).sum()
    dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for local in locals_:
            local.mul_(coefficient.to(local.dtype))
    return total.cpu()
