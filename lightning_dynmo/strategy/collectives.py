"""Lightning's collectives on :class:`~lightning_dynmo.DynMoStrategy`: over the active ranks, guarded.

After a re-pack the collectives run over the ranks still training, and are no-ops on released ranks; each
runs inside the strategy's guard (``guard(what)``, see :meth:`DynMoStrategy.guard
<lightning_dynmo.strategy.DynMoStrategy.guard>`), so a collective called on some ranks only fails naming
the call.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_dynmo.strategy.state import RankState

__all__ = ["Guard", "all_gather", "barrier", "broadcast", "reduce", "reduce_boolean_decision"]

#: ``guard(what)``: the context a collective named ``what`` runs in.
Guard = Callable[[str], AbstractContextManager[None]]


def barrier(ranks: RankState, guard: Guard, name: str | None) -> None:
    if _distributed_is_initialized() and not ranks.released:
        with guard(f"strategy.barrier({name!r})"):
            dist.barrier(group=ranks.active_group)


def broadcast(ranks: RankState, guard: Guard, obj: TBroadcast, src: int) -> TBroadcast:
    if not _distributed_is_initialized() or ranks.released:
        return obj
    box = [obj]
    with guard(f"strategy.broadcast(src={src})"):
        dist.broadcast_object_list(box, src=src, group=ranks.active_group)
    return box[0]


def reduce(
    ranks: RankState, guard: Guard, tensor: Tensor | Any, group: Any | None, reduce_op: ReduceOp | str | None
) -> Tensor | Any:
    if isinstance(tensor, Tensor) and not ranks.released:
        with guard("strategy.reduce"):
            return _sync_ddp_if_available(tensor, group or ranks.active_group, reduce_op=reduce_op)
    return tensor


def all_gather(
    ranks: RankState,
    guard: Guard,
    gather: Callable[[Tensor, Any, bool], Tensor],
    tensor: Tensor,
    group: Any | None,
    sync_grads: bool,
) -> Tensor:
    """``gather(tensor, group, sync_grads)`` (Lightning's all-gather) over the active ranks, guarded."""
    if ranks.released:
        return tensor.unsqueeze(0)  # gathered over this rank alone: it no longer shares any group
    with guard("strategy.all_gather"):
        return gather(tensor, group or ranks.active_group, sync_grads)


def reduce_boolean_decision(
    ranks: RankState, guard: Guard, device: torch.device, decision: bool, all: bool
) -> bool:
    if ranks.released:
        return decision
    votes = reduce(ranks, guard, torch.tensor(int(decision), device=device), None, "sum")
    return bool(votes == len(ranks.active_ranks)) if all else bool(votes)
