"""The GPT on the embedded corpus under DynMoStrategy equals its single-process run (float64).

Two cases on 2 gloo ranks: a 2-stage pipeline with a tied embedding/head, an LR schedule, validation and
two forced migrations mid-run; and 2 data-parallel replicas whose batches come from the DistributedSampler
Lightning injects into TextDataModule's loaders. Each has a negative control showing the comparison can
fail (migrations that drop the moved layers' Adam state; a reference that sees only one replica's data).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dynmo.data import StdlibCorpus, TextDataModule
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import TOL, ForcePlacement, LossRecorder, max_param_diff
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed


@dataclass(frozen=True)
class GPTRun:
    """One training configuration, shared by the distributed run and its single-process reference."""

    pipeline_size: int | None = None
    placement: str = "0-1|2-3"
    # (batch_idx, placement) applied at on_train_batch_start.
    migrations: tuple[tuple[int, str], ...] = ((3, "0-2|3-3"), (6, "0-0|1-3"))
    steps: int = 8
    batch_size: int = 8
    num_microbatches: int = 4
    val_batches: int = 2
    use_sampler: bool = False

    def model(self) -> GPT:
        config = GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=16, tie_embeddings=True)
        return GPT(config, OptimizerConfig(lr=1e-2, warmup_steps=2, decay_steps=6))

    def datamodule(self, cache_dir: Path) -> TextDataModule:
        corpus = StdlibCorpus(max_bytes=60_000)
        return TextDataModule(corpus=corpus, seq_len=16, batch_size=self.batch_size, cache_dir=cache_dir)

    def trainer_kwargs(self) -> dict[str, Any]:
        return {
            "accelerator": "cpu",
            "precision": "64-true",
            "max_epochs": 1,
            "limit_train_batches": self.steps,
            "limit_val_batches": self.val_batches,
            "num_sanity_val_steps": 0,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        }


class DropMovedAdamState(DynMoStrategy):
    """Negative control: a migration that loses the moved layers' optimizer state on arrival."""

    def apply_placement(self, new: Any) -> Any:
        report = super().apply_placement(new)
        module = self.lightning_module
        assert module is not None
        for move in report.moves:
            if move.dst == self.global_rank:
                for param in module.get_submodule(move.unit).parameters():
                    for optimizer in self.optimizers:
                        optimizer.state.pop(param, None)
        return report


def _outcome(trainer: pl.Trainer, model: GPT, recorder: LossRecorder) -> dict[str, Any]:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("val_loss", "val_ppl")}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": recorder.losses, "state": state, "metrics": metrics}


def _fit_worker(
    rank: int, world_size: int, run: GPTRun, cache_dir: Path, strategy_cls: type[DynMoStrategy]
) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)  # LightningEnvironment: processes are created externally
    os.environ["NODE_RANK"] = "0"
    recorder, mover = LossRecorder(), ForcePlacement(dict(run.migrations))
    strategy = strategy_cls(
        pipeline_size=run.pipeline_size,
        schedule="1F1B",
        num_microbatches=run.num_microbatches,
        placement=run.placement,
    )
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        use_distributed_sampler=run.use_sampler,
        callbacks=[recorder, mover],
        **run.trainer_kwargs(),
    )
    model = run.model()
    trainer.fit(model, run.datamodule(cache_dir))
    return {**_outcome(trainer, model, recorder), "applied": mover.applied}


def _fit_distributed(
    run: GPTRun, tmp_path: Path, strategy_cls: type[DynMoStrategy] = DynMoStrategy
) -> list[dict[str, Any]]:
    run.datamodule(tmp_path / "cache").prepare_data()  # the ranks then start from a warm cache
    args = (run, tmp_path / "cache", strategy_cls)
    return run_distributed(_fit_worker, 2, tmp_path, timeout_s=120, args=args)


def _fit_reference(run: GPTRun, cache_dir: Path, batches: list[torch.Tensor] | None = None) -> dict[str, Any]:
    recorder = LossRecorder()
    trainer = pl.Trainer(devices=1, callbacks=[recorder], **run.trainer_kwargs())
    model = run.model()
    if batches is None:
        trainer.fit(model, run.datamodule(cache_dir))
    else:
        trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None))
    return _outcome(trainer, model, recorder)


def _worst_loss_diff(results: list[dict[str, Any]], ref: dict[str, Any]) -> float:
    for res in results:
        assert len(res["losses"]) == len(ref["losses"]), "every rank logs one loss per step"
    return max(abs(a - b) for res in results for a, b in zip(res["losses"], ref["losses"], strict=True))


def test_pipelined_gpt_with_migrations_equals_single_process(tmp_path: Path) -> None:
    run = GPTRun()
    results = _fit_distributed(run, tmp_path)
    ref = _fit_reference(run, tmp_path / "cache")
    assert all(res["applied"] == [p for _, p in run.migrations] for res in results)
    assert len(ref["losses"]) == run.steps
    assert _worst_loss_diff(results, ref) < TOL
    assert max_param_diff(results, ref) < TOL
    for res in results:  # validation: the strategy's val_loss and the model's perplexity, on every rank
        assert abs(res["metrics"]["val_loss"] - ref["metrics"]["val_loss"]) < TOL
        assert res["metrics"]["val_ppl"] == pytest.approx(ref["metrics"]["val_ppl"], rel=1e-6)
        assert res["metrics"]["val_ppl"] == pytest.approx(math.exp(ref["metrics"]["val_loss"]), rel=1e-6)
    # Negative control: losing the moved layers' Adam moments must show up in the same comparison.
    dropped = _fit_distributed(run, tmp_path, strategy_cls=DropMovedAdamState)
    assert max_param_diff(dropped, ref) > 1e-4


def _replica_batches(run: GPTRun, dm: TextDataModule, replicas: list[int]) -> list[torch.Tensor]:
    """Global batch k: the k-th batch of each listed replica's DistributedSampler shard, concatenated."""
    dataset = dm.train_dataset
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # what Lightning gives the injected sampler
    shards = [
        list(DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=seed)) for r in replicas
    ]
    size = run.batch_size
    return [
        torch.stack([dataset[i] for shard in shards for i in shard[k * size : (k + 1) * size]])
        for k in range(run.steps)
    ]


def test_data_parallel_replicas_read_disjoint_shards_of_the_corpus(tmp_path: Path) -> None:
    run = GPTRun(
        pipeline_size=1,
        placement="uniform",
        migrations=(),
        batch_size=4,
        num_microbatches=2,
        val_batches=0,
        use_sampler=True,
    )
    results = _fit_distributed(run, tmp_path)
    dm = run.datamodule(tmp_path / "cache")
    ref = _fit_reference(replace(run, batch_size=8), tmp_path / "cache", _replica_batches(run, dm, [0, 1]))
    assert _worst_loss_diff(results, ref) < TOL
    assert max_param_diff(results[:1], ref) < TOL and max_param_diff(results[1:], ref) < TOL
    # Negative control: one replica's data alone is not what the two replicas trained on together.
    alone = _fit_reference(run, tmp_path / "cache", _replica_batches(run, dm, [0]))
    assert max_param_diff(results[:1], alone) > 1e-4
