"""Activation checkpointing of a block: exact gradients, and a second run that counts nothing.

``run_checkpointed`` runs a block whose forward draws dropout, adds an auxiliary loss and counts its
training forwards (skipping those :func:`in_shape_inference` reports, as the dynamism blocks do). The
gradients equal the plain call's (float64, ``torch.equal``), the forward runs twice, the count and the
recorded auxiliary loss once. Pipelined: ``tests/distributed/test_activation_checkpointing.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss, collect_aux_losses
from lightning_dynmo.pipeline.step.recompute import recomputing, run_checkpointed
from lightning_dynmo.pipeline.step.stage import in_shape_inference


class CountingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, dtype=torch.float64)
        self.dropout = nn.Dropout(0.5)
        self.calls = 0
        self.counted = 0
        self.seen_recomputing: list[bool] = []

    def forward(self, hidden: Tensor) -> Tensor:
        self.calls += 1
        self.seen_recomputing.append(recomputing())
        if not in_shape_inference():
            self.counted += 1
        out = self.dropout(torch.tanh(self.linear(hidden)))
        return add_aux_loss("aux", 0.1 * out.pow(2).mean(), out)


def _grads(checkpointed: bool) -> tuple[list[Tensor], CountingBlock, list[float]]:
    torch.manual_seed(0)
    block = CountingBlock()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with collect_aux_losses() as record:
        torch.manual_seed(1)
        out = run_checkpointed(block, x) if checkpointed else block(x)
        out.sum().backward()
    values = [float(v) for v in record.values["aux"]]
    assert x.grad is not None
    return [x.grad, *(p.grad for p in block.parameters() if p.grad is not None)], block, values


def test_a_checkpointed_block_has_the_plain_gradients_and_counts_once() -> None:
    plain, plain_block, plain_aux = _grads(checkpointed=False)
    grads, block, aux = _grads(checkpointed=True)
    assert len(grads) == len(plain) == 3
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))  # dropout masks replayed
    assert block.calls == 2 and block.seen_recomputing == [False, True]  # the forward ran again
    assert block.counted == plain_block.counted == 1 and aux == plain_aux  # counted and logged once
    assert not recomputing()


def test_without_a_second_run_nothing_is_recomputed() -> None:
    # Negative control of the count: evaluation (no gradients) runs the forward once.
    block = CountingBlock()
    with torch.no_grad():
        run_checkpointed(block, torch.randn(3, 4, dtype=torch.float64))
    assert block.calls == 1
