"""Lightning's collectives on :class:`~lightning_dynmo.DynMoStrategy`: over the active ranks, guarded.

After a re-pack the collectives run over the ranks still training, and are no-ops on released ranks; each
runs inside the strategy's guard, so a collective called on some ranks only fails naming the call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor
from torch.distributed import ReduceOp

if TYPE_CHECKING:
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

__all__ = ["barrier", "broadcast", "reduce", "reduce_boolean_decision"]


def barrier(strategy: DynMoStrategy, name: str | None) -> None:
    if _distributed_is_initialized() and not strategy._released:
        with strategy.guard(f"strategy.barrier({name!r})"):
            dist.barrier(group=strategy._active_group)


def broadcast(strategy: DynMoStrategy, obj: TBroadcast, src: int) -> TBroadcast:
    if not _distributed_is_initialized() or strategy._released:
        return obj
    box = [obj]
    with strategy.guard(f"strategy.broadcast(src={src})"):
        dist.broadcast_object_list(box, src=src, group=strategy._active_group)
    return box[0]


def reduce(
    strategy: DynMoStrategy, tensor: Tensor | Any, group: Any | None, reduce_op: ReduceOp | str | None
) -> Tensor | Any:
    if isinstance(tensor, Tensor) and not strategy._released:
        with strategy.guard("strategy.reduce"):
            return _sync_ddp_if_available(tensor, group or strategy._active_group, reduce_op=reduce_op)
    return tensor


def reduce_boolean_decision(strategy: DynMoStrategy, decision: bool, all: bool) -> bool:
    if strategy._released:
        return decision
    votes = strategy.reduce(torch.tensor(int(decision), device=strategy.root_device), reduce_op="sum")
    return bool(votes == len(strategy._active_ranks)) if all else bool(votes)
