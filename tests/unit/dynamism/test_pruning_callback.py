"""PruningCallback in a single-process Trainer: prunes once per optimizer step at the schedule's steps
(also under gradient accumulation), keeps its history in checkpoints, and names a model without blocks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.dynamism.pruning import PruningConfig, prunable_linears
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_linear import MaskedLinear
from lightning_dynmo.dynamism_callbacks import PruningCallback
from lightning_dynmo.events import EventBus
from lightning_dynmo.models import GPT, GPTConfig
from tests.quiet_trainer import quiet_trainer

# Single-threaded (conftest.py): small matrices are much faster so on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")


def trainer(callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    return quiet_trainer(max_epochs=1, callbacks=callbacks, **kwargs)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_prunes_at_the_schedule_steps_once_per_optimizer_step(accumulate: int) -> None:
    bus, events = EventBus(), []
    bus.subscribe(events.append)
    schedule = PruningSchedule(final_sparsity=0.6, start_step=1, frequency=2, num_steps=2)
    callback = PruningCallback(PruningConfig(schedule=schedule, kernel="dense"), event_bus=bus)
    model = GPT(GPTConfig(num_layers=2, d_model=16, num_heads=2, seq_len=16, vocab_size=64))
    data = RandomTokenDataModule(batch_size=4, num_samples=4 * 7 * accumulate)
    trainer([callback], accumulate_grad_batches=accumulate).fit(model, data)
    assert [r.step for r in callback.history] == [1, 3, 5]
    assert callback.history[-1].sparsity == pytest.approx(0.6, abs=1e-4)
    assert [e.step for e in events] == [3, 5]
    layers = {int(k): m for k, m in model.layers.items()}
    assert len(prunable_linears(layers)) == 8  # converted at setup
    assert all((m.weight[~m.weight_mask] == 0).all() for _, _, m in prunable_linears(layers))
    restored = PruningCallback()
    restored.load_state_dict(callback.state_dict())
    assert restored.history == callback.history


class NoBlocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch.float()[:, :2]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_without_blocks_is_named() -> None:
    callback = PruningCallback(PruningConfig(schedule=PruningSchedule(start_step=0)))
    with pytest.raises(TypeError, match=r"NoBlocks has no `layers` \(an nn.ModuleDict of blocks"):
        trainer([callback], max_steps=1).fit(NoBlocks(), RandomTokenDataModule(batch_size=2, num_samples=4))
    assert not any(isinstance(m, MaskedLinear) for m in NoBlocks().modules())
