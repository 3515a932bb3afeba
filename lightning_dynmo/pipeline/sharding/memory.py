"""What a rank holds for some units: bytes of parameters, gradients and optimizer state, shards only."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ShardedBytes", "local_bytes"]


@dataclass(frozen=True)
class ShardedBytes:
    """Bytes one rank holds for some units (a sharded tensor counts its local shard only).

    Attributes:
        parameters: Parameter bytes.
        gradients: Gradient bytes (parameters whose ``.grad`` is set).
        optimizer_state: Optimizer state bytes (every tensor in the optimizers' state of these parameters).
    """

    parameters: int
    gradients: int
    optimizer_state: int


def _local_nbytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def local_bytes(units: Iterable[nn.Module], optimizers: Sequence[torch.optim.Optimizer] = ()) -> ShardedBytes:
    """The bytes this rank holds for ``units``: parameters, gradients and optimizer state.

    Args:
        units: The units (sharded or not; a parameter shared by two units counts once).
        optimizers: The optimizers whose state for these parameters counts.
    """
    params = {id(p): p for unit in units for p in unit.parameters()}
    gradients = sum(_local_nbytes(p.grad) for p in params.values() if p.grad is not None)
    state = 0
    for optimizer in optimizers:
        for param, values in optimizer.state.items():
            if id(param) in params:
                state += sum(_local_nbytes(v) for v in values.values() if isinstance(v, torch.Tensor))
    return ShardedBytes(
        parameters=sum(_local_nbytes(p) for p in params.values()),
        gradients=gradients,
        optimizer_state=state,
    )
