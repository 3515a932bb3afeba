"""Trainer.predict under the strategy: every rank returns what the whole model computes on one device."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.demos.data import RandomTokenDataset
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

NUM_LAYERS, SAMPLES = 4, 14  # batches of 8 and 6: the last one is cut into 3 micro-batches, not 4


def _loader() -> DataLoader[Any]:
    return DataLoader(RandomTokenDataset(num_samples=SAMPLES, seed=3), batch_size=8)


def _predict(rank: int, world_size: int, strategy_kwargs: dict[str, Any]) -> list[torch.Tensor]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DynMoStrategy(num_microbatches=4, **strategy_kwargs),
        precision="64-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    predictions = trainer.predict(DemoGPT(num_layers=NUM_LAYERS), dataloaders=_loader())
    assert predictions is not None
    return [p.detach().clone() for p in predictions]  # type: ignore[union-attr]


def _reference() -> list[torch.Tensor]:
    model = DemoGPT(num_layers=NUM_LAYERS).double().eval()
    with torch.no_grad():
        return [model(model.pipeline_batch(batch)[0]) for batch in _loader()]


@pytest.mark.parametrize(
    "strategy_kwargs",
    [{"schedule": "1F1B"}, {"schedule": "1F1B", "placement": "0-2|3-3"}, {"schedule": "Interleaved1F1B"}],
    ids=["1F1B", "uneven-placement", "Interleaved1F1B"],
)
def test_every_rank_predicts_what_one_device_does(tmp_path: Any, strategy_kwargs: dict[str, Any]) -> None:
    results = run_distributed(_predict, 2, tmp_path, timeout_s=90, args=(strategy_kwargs,))
    expected = _reference()
    for predictions in results:
        assert [p.shape for p in predictions] == [e.shape for e in expected]
        worst = max((p - e).abs().max().item() for p, e in zip(predictions, expected, strict=True))
        assert worst < 1e-9, f"predictions differ from one device by {worst:.3e}"
