"""GPT and DemoGPT hyper-parameters, and ``load_from_checkpoint`` from one-process checkpoints (the way
Lightning's own checkpoints round-trip).

A model is trained for two steps in float64 by a plain single-device Trainer and saved; the loaded model
must have the trained weights exactly (``torch.equal``), also under ``torch.load(weights_only=True)``
(Lightning's default), which unpickles only allow-listed classes. Pipelined checkpoints (a sharded
directory, its export, one gathered file) are in ``tests/distributed/test_load_from_checkpoint.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_dynmo.demos import DemoConfig, DemoGPT, RandomTokenDataModule
from lightning_dynmo.dynamism.moe import MoEOptions
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig

TINY = {"vocab_size": 64, "seq_len": 16, "num_layers": 3, "d_model": 16, "num_heads": 2}


def _trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _train_and_save(model: pl.LightningModule, path: Path) -> dict[str, torch.Tensor]:
    trainer = _trainer(max_steps=2)
    trainer.fit(model, RandomTokenDataModule(batch_size=4, num_samples=8))
    trainer.save_checkpoint(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_equal_weights(loaded: pl.LightningModule, trained: dict[str, torch.Tensor]) -> None:
    state = loaded.state_dict()
    assert list(state) == list(trained)
    for key, value in trained.items():
        assert state[key].dtype == torch.float64, key
        assert torch.equal(state[key], value), key


def test_gpt_hparams_are_its_arguments() -> None:
    config, optimizer = GPTConfig(**TINY), OptimizerConfig(lr=0.01)
    model = GPT(config, optimizer, microbatches=2)
    assert dict(model.hparams) == {"config": config, "optimizer": optimizer, "microbatches": 2}
    assert dict(DemoGPT(num_layers=2).hparams) == {"config": DemoConfig(num_layers=2)}


@pytest.mark.parametrize("weights_only", [None, True])
def test_gpt_loads_from_its_checkpoint_with_the_trained_weights(
    tmp_path: Path, weights_only: bool | None
) -> None:
    # A block kind with options: the options travel in hparams and are allow-listed for weights_only.
    blocks = ("dense", MoEOptions(num_experts=2, top_k=1), "dense")
    model = GPT(GPTConfig(**TINY, blocks=blocks), OptimizerConfig(lr=0.01))
    trained = _train_and_save(model, tmp_path / "gpt.ckpt")
    with _trainer().init_module():  # builds in float64, the trained precision
        loaded = GPT.load_from_checkpoint(tmp_path / "gpt.ckpt", weights_only=weights_only)
    assert loaded.config == model.config and loaded.hparams == model.hparams
    _assert_equal_weights(loaded, trained)


def test_demo_gpt_loads_from_its_checkpoint_with_the_trained_weights(tmp_path: Path) -> None:
    model = DemoGPT(num_layers=2, lr_gamma=0.9, sleep_ms=(0.0, 0.0))
    trained = _train_and_save(model, tmp_path / "demo.ckpt")
    with _trainer().init_module():
        loaded = DemoGPT.load_from_checkpoint(tmp_path / "demo.ckpt", weights_only=True)
    assert loaded.demo_config == model.demo_config
    _assert_equal_weights(loaded, trained)


def test_without_hparams_the_default_shape_misses_keys(tmp_path: Path) -> None:
    # Negative control (the bug): a checkpoint without hyper-parameters builds GPT() (4 layers), which
    # does not fit a 3-layer model's weights.
    model = GPT(GPTConfig(**{**TINY, "seq_len": 128, "vocab_size": 256}))
    checkpoint = {"state_dict": model.state_dict(), "pytorch-lightning_version": pl.__version__}
    torch.save(checkpoint, tmp_path / "bare.ckpt")
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*layers\.3"):
        GPT.load_from_checkpoint(tmp_path / "bare.ckpt")


def test_a_directory_that_is_not_a_checkpoint_is_refused_naming_the_alternative(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not a sharded checkpoint.*export_full_checkpoint"):
        GPT.load_from_checkpoint(tmp_path)
