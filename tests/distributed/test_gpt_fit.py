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
from tests.distributed.case_fit import Fit, fit_case, fit_reference, trainer_kwargs
from tests.distributed.controls import SpoilOnArrival
from tests.distributed.equivalence import assert_equivalent, state_diff
from tests.distributed.fitting import TOL, ForcePlacement, LossRecorder

pytestmark = pytest.mark.distributed


@dataclass(frozen=True)
class GPTRun:
    """One training configuration, shared by the distributed run and its single-process reference."""

    cache_dir: Path  # the corpus's tokens, prepared once before the ranks start
    pipeline_size: int | None = None
    placement: str = "0-1|2-3"
    # (batch_idx, placement) applied at on_train_batch_start.
    migrations: tuple[tuple[int, str], ...] = ((3, "0-2|3-3"), (6, "0-0|1-3"))
    steps: int = 8
    batch_size: int = 8
    num_microbatches: int = 4
    val_batches: int = 2
    use_sampler: bool = False
    strategy_cls: type[DynMoStrategy] = DynMoStrategy

    def model(self) -> GPT:
        config = GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=16, tie_embeddings=True)
        return GPT(config, OptimizerConfig(lr=1e-2, warmup_steps=2, decay_steps=6))

    def datamodule(self) -> TextDataModule:
        corpus = StdlibCorpus(max_bytes=60_000)
        return TextDataModule(corpus=corpus, seq_len=16, batch_size=self.batch_size, cache_dir=self.cache_dir)

    def trainer(self) -> dict[str, Any]:
        return trainer_kwargs(
            limit_train_batches=self.steps, limit_val_batches=self.val_batches, num_sanity_val_steps=0
        )

    def rank_fit(self, rank: int, world_size: int, resume: bool) -> Fit:
        strategy = self.strategy_cls(
            pipeline_size=self.pipeline_size,
            schedule="1F1B",
            num_microbatches=self.num_microbatches,
            placement=self.placement,
        )
        mover = [ForcePlacement(dict(self.migrations))]
        data = (self.datamodule(),)
        return Fit(
            self.model(), data, LossRecorder(), self.trainer(), mover, strategy, self.use_sampler, _metrics
        )

    def reference(self, batches: list[torch.Tensor] | None = None) -> dict[str, Any]:
        data = self.datamodule() if batches is None else DataLoader(batches, batch_size=None)
        return fit_reference(Fit(self.model(), (data,), LossRecorder(), self.trainer(), outcome=_metrics))


class DropMovedAdamState(SpoilOnArrival):
    """Negative control: a migration that loses the moved layers' optimizer state on arrival."""

    def spoil(self, block: torch.nn.Module) -> None:
        for param in block.parameters():
            for optimizer in self.optimizers:
                optimizer.state.pop(param, None)


def _metrics(trainer: pl.Trainer) -> dict[str, Any]:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("val_loss", "val_ppl")}
    return {"metrics": metrics}


def _fit_distributed(run: GPTRun, tmp_path: Path) -> list[dict[str, Any]]:
    run.datamodule().prepare_data()  # the ranks then start from a warm cache
    return fit_case(run, tmp_path)


def test_pipelined_gpt_with_migrations_equals_single_process(tmp_path: Path) -> None:
    run = GPTRun(cache_dir=tmp_path / "cache")
    results = _fit_distributed(run, tmp_path)
    ref = run.reference()
    assert all(res["applied"] == [p for _, p in run.migrations] for res in results)
    assert len(ref["losses"]) == run.steps
    assert_equivalent(results, ref)
    for res in results:  # validation: the strategy's val_loss and the model's perplexity, on every rank
        assert abs(res["metrics"]["val_loss"] - ref["metrics"]["val_loss"]) < TOL
        assert res["metrics"]["val_ppl"] == pytest.approx(ref["metrics"]["val_ppl"], rel=1e-6)
        assert res["metrics"]["val_ppl"] == pytest.approx(math.exp(ref["metrics"]["val_loss"]), rel=1e-6)
    # Negative control: losing the moved layers' Adam moments must show up in the same comparison.
    dropped = _fit_distributed(replace(run, strategy_cls=DropMovedAdamState), tmp_path)
    assert state_diff(dropped, ref) > 1e-4


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
        cache_dir=tmp_path / "cache",
        pipeline_size=1,
        placement="uniform",
        migrations=(),
        batch_size=4,
        num_microbatches=2,
        val_batches=0,
        use_sampler=True,
    )
    results = _fit_distributed(run, tmp_path)
    dm = run.datamodule()
    ref = replace(run, batch_size=8).reference(_replica_batches(run, dm, [0, 1]))
    assert_equivalent(results[:1], ref)
    assert_equivalent(results[1:], ref)
    # Negative control: one replica's data alone is not what the two replicas trained on together.
    alone = run.reference(_replica_batches(run, dm, [0]))
    assert state_diff(results[:1], alone) > 1e-4
