"""Tiny layers with known, emulated costs for profiling tests (shared by unit and distributed tests)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


class SleepFn(torch.autograd.Function):
    """Identity that sleeps ``fwd_ms`` in forward and ``bwd_ms`` in backward (sleeping uses no CPU)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_ms: float, bwd_ms: float) -> torch.Tensor:
        ctx.bwd_ms = bwd_ms
        time.sleep(fwd_ms / 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd_ms / 1e3)
        return grad, None, None


class Block(nn.Module):
    """``tanh(linear(x))``, then optionally a sleep of ``fwd_ms`` / ``bwd_ms``."""

    def __init__(self, width: int = 16, fwd_ms: float = 0.0, bwd_ms: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.fwd_ms = fwd_ms
        self.bwd_ms = bwd_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.lin(x))
        if self.fwd_ms or self.bwd_ms:
            x = SleepFn.apply(x, self.fwd_ms, self.bwd_ms)
        return x


class Stack(nn.Module):
    """Blocks keyed by global index in a ``ModuleDict``, run in order (the model contract's shape)."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): b for i, b in sorted(blocks.items())})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x
