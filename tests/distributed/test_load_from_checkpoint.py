"""``GPT.load_from_checkpoint`` from what DynMoStrategy saves: a sharded directory, its export, one file.

A GPT trains on 2 forked gloo ranks (2 stages, float64) and every rank saves with
``trainer.save_checkpoint``. The model Lightning's ``load_from_checkpoint`` builds in one process (from
the checkpoint's hyper-parameters) must hold exactly the trained weights, the union of the ranks' units
(``torch.equal``). Sharded and one-file saves with a custom ``CheckpointIO`` or ``storage_options``: a
sharded save refuses them (it would ignore them), a one-file save honours them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import TorchCheckpointIO

from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.pipeline import export_full_checkpoint
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import Run, local_state
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

RUN = Run(num_layers=4, steps=3, placement="0-1|2-3")


def _model() -> GPT:
    config = GPTConfig(vocab_size=64, seq_len=16, num_layers=RUN.num_layers, d_model=16, num_heads=2)
    return GPT(config, OptimizerConfig(lr=0.01))


class RecordingIO(TorchCheckpointIO):
    """Lightning's file IO that notes the ``storage_options`` it was given."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        Path(path).parent.joinpath("options.txt").write_text(repr(storage_options))  # path: a staged sibling
        super().save_checkpoint(checkpoint, path)


def _trainer(world_size: int, sharded: bool, plugins: list[Any]) -> pl.Trainer:
    strategy = DynMoStrategy(num_microbatches=4, placement=RUN.placement, save_distributed_checkpoint=sharded)
    return pl.Trainer(devices=world_size, strategy=strategy, plugins=plugins, **RUN.trainer_kwargs())


def save_worker(rank: int, world_size: int, path: Path, sharded: bool) -> dict[str, Any]:
    os.environ["LOCAL_RANK"], os.environ["NODE_RANK"] = str(rank), "0"
    trainer = _trainer(world_size, sharded, plugins=[] if sharded else [RecordingIO()])
    model = _model()
    trainer.fit(model, RUN.datamodule())
    trainer.save_checkpoint(path, storage_options=None if sharded else {"kept": 1})
    refused = {}
    if sharded:
        with pytest.raises(TypeError, match=r"storage_options=\{'x': 1\}\) is not supported.*sharded.*"
                           r"save_distributed_checkpoint=False"):  # fmt: skip
            trainer.save_checkpoint(path.with_name("other.ckpt"), storage_options={"x": 1})
        with pytest.raises(TypeError, match=r"CheckpointIO plugin RecordingIO.*silently ignored"):
            _trainer(world_size, sharded, plugins=[RecordingIO()])
        refused = {"refused": True}
    return {"state": local_state(model), **refused}


@pytest.fixture(scope="module", params=[True, False], ids=["sharded", "one-file"])
def saved(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    sharded = request.param
    tmp = tmp_path_factory.mktemp("sharded" if sharded else "file")
    path = tmp / "trained.ckpt"
    ranks = run_distributed(save_worker, 2, tmp, timeout_s=120, args=(path, sharded))
    assert path.is_dir() == sharded
    if sharded:
        assert all(r["refused"] for r in ranks)
    else:
        assert (tmp / "options.txt").read_text() == "{'kept': 1}"  # the plugin got them
    return path, {k: v for r in ranks for k, v in r["state"].items()}


def _load(path: Path) -> GPT:
    with pl.Trainer(accelerator="cpu", precision="64-true", logger=False).init_module():  # float64
        return GPT.load_from_checkpoint(path, weights_only=True)


def _assert_trained(model: GPT, trained: dict[str, torch.Tensor]) -> None:
    assert model.config == _model().config
    state = model.state_dict()
    assert set(state) == set(trained)
    for key, value in trained.items():
        assert value.dtype == torch.float64 and torch.equal(state[key], value), key


def test_load_from_checkpoint_restores_the_trained_weights(saved: tuple[Path, dict[str, Any]]) -> None:
    path, trained = saved
    _assert_trained(_load(path), trained)  # a sharded directory is read in place, a file as Lightning does


@pytest.mark.parametrize("saved", [True], ids=["sharded"], indirect=True)  # only a directory is exported
def test_load_from_an_exported_file_restores_the_trained_weights(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, trained = saved
    assert path.is_dir()
    _assert_trained(_load(export_full_checkpoint(path, tmp_path / "full.ckpt")), trained)
