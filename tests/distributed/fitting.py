"""Shared pieces of the distributed tests: a training configuration, pipelined fits in forked ranks, and
the single-process reference they must equal.

Each run forks real gloo ranks (``run_distributed``) that call ``Trainer.fit`` with ``DynMoStrategy``
on an already-initialised process group (Lightning's launcher is not used; the launcher tests cover it).
Every rank returns the per-step losses it logged and its local ``state_dict``; keys are global
(``layers.5...``), so the union is the whole model. The reference is a plain single-device
``Trainer.fit`` of the identically seeded model in the test process, in float64 (``precision="64-true"``),
where pipelining changes results only by rounding.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule, RandomTokenDataset
from lightning_dynmo.pipeline.model.compiled import is_compiled_block
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.harness import run_distributed

TOL = 1e-9


@dataclass(frozen=True)
class Run:
    """One training configuration, shared by the pipelined run and its reference."""

    world_size: int = 2
    pipeline_size: int | None = None
    schedule: str = "1F1B"
    num_microbatches: int = 4
    num_layers: int = 4
    placement: str = "uniform"
    batch_size: int = 8
    steps: int = 10
    accumulate: int = 1
    clip: float | None = None
    lr_gamma: float = 0.9
    use_sampler: bool = False
    precision: str = "64-true"
    # Samples past the last full batch: with them the last batch is smaller (a shape change).
    extra_samples: int = 0
    # (batch_idx, placement) pairs applied at on_train_batch_start.
    migrations: tuple[tuple[int, str], ...] = field(default_factory=tuple)
    # The output head reuses the token embedding's weight (first and last stage share a parameter).
    tie_embeddings: bool = False
    # The model: a DemoGPT (sub)class, called with these leading arguments and the sizes above.
    model_cls: type[DemoGPT] = DemoGPT
    model_args: tuple[Any, ...] = ()

    @property
    def num_samples(self) -> int:
        replicas = self.world_size // (self.pipeline_size or self.world_size)
        full = self.batch_size * self.steps * self.accumulate * (replicas if self.use_sampler else 1)
        return full + self.extra_samples

    def datamodule(self) -> RandomTokenDataModule:
        return RandomTokenDataModule(self.batch_size, self.num_samples, drop_last=not self.extra_samples)

    def model(self) -> DemoGPT:
        return self.model_cls(
            *self.model_args,
            num_layers=self.num_layers,
            lr_gamma=self.lr_gamma,
            tie_embeddings=self.tie_embeddings,
        )

    @classmethod
    def two_migrations(cls, model_cls: type[DemoGPT], *model_args: Any) -> Run:
        """Six blocks on two ranks; block 3 moves to rank 0 at batch 2, then blocks 1-3 to rank 1 at batch 4,
        so each rank takes in a block it never held (for tests of what a migrating block carries)."""
        migrations = ((2, "0-3|4-5"), (4, "0-0|1-5"))
        return cls(model_cls=model_cls, model_args=model_args, num_layers=6, placement="0-2|3-5", steps=6,
                   migrations=migrations)  # fmt: skip

    def reference_model(self) -> DemoGPT:
        """The model the single-process reference trains (the same as :meth:`model` unless overridden)."""
        return self.model()

    def trainer_kwargs(self) -> dict[str, Any]:
        return {
            "accelerator": "cpu",
            "precision": self.precision,
            "max_epochs": 1,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "accumulate_grad_batches": self.accumulate,
            "gradient_clip_val": self.clip,
        }


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the tensors in ``model``'s state dict (a rank's share, under global keys)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


class LossRecorder(pl.Callback):
    """Records the logged ``train_loss`` after every batch and the gradient norm before each step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.losses.append(trainer.progress_bar_metrics["train_loss"])

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.grad_norms.append(torch.nn.utils.get_total_norm(grads).item())


class ForcePlacement(pl.Callback):
    """Calls ``strategy.apply_placement`` at given batch indices (a stand-in for DynMoCallback)."""

    def __init__(self, at: dict[int, str]) -> None:
        self.at = at
        self.applied: list[str] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx in self.at:
            trainer.strategy.apply_placement(self.at[batch_idx])
            self.applied.append(str(trainer.strategy.placement))


class NoTieSyncStrategy(DynMoStrategy):
    """Negative control: the two copies of a tied parameter are not kept in step."""

    def _sync_tied_grads(self) -> None:
        return None


class LocalClipStrategy(DynMoStrategy):
    """Negative control: Lightning's default clipping, by each rank's local norm only."""

    def _route_clipping_through_pipeline(self) -> None:
        pass


def make_strategy(run: Run, **overrides: Any) -> DynMoStrategy:
    cls = overrides.pop("strategy_cls", DynMoStrategy)
    kwargs: dict[str, Any] = {
        "pipeline_size": run.pipeline_size,
        "schedule": run.schedule,
        "num_microbatches": run.num_microbatches,
        "placement": run.placement,
    }
    return cls(**{**kwargs, **overrides})


def fit_worker(rank: int, world_size: int, run: Run, strategy_overrides: dict[str, Any]) -> dict[str, Any]:
    """Body of one forked rank: Trainer.fit under DynMoStrategy; returns losses and local state."""
    os.environ["LOCAL_RANK"] = str(rank)  # LightningEnvironment: processes are created externally
    os.environ["NODE_RANK"] = "0"
    recorder, mover = LossRecorder(), ForcePlacement(dict(run.migrations))
    trainer = pl.Trainer(
        devices=world_size,
        strategy=make_strategy(run, **dict(strategy_overrides)),
        use_distributed_sampler=run.use_sampler,
        callbacks=[recorder, mover],
        **run.trainer_kwargs(),
    )
    model = run.model()
    trainer.fit(model, run.datamodule())
    strategy = trainer.strategy
    assert isinstance(strategy, DynMoStrategy)
    return {
        "losses": recorder.losses,
        "state": local_state(model),
        "placement": str(strategy.placement),
        "applied": mover.applied,
        "layers": sorted(strategy.local_layers),
        "stage_index": strategy.stage_index,
        "stage_indices": strategy.stage_indices,
        "first": strategy.is_first_stage,
        "last": strategy.is_last_stage,
        "compiled": sorted(i for i, block in strategy.local_layers.items() if is_compiled_block(block)),
    }


def fit_pipelined(run: Run, tmp_path: Any, **strategy_overrides: Any) -> list[dict[str, Any]]:
    return run_distributed(
        fit_worker, run.world_size, tmp_path, timeout_s=120, args=(run, strategy_overrides)
    )


def _reference_batches(run: Run) -> DataLoader[Any]:
    dm = run.datamodule()
    if not run.use_sampler:
        return dm.train_dataloader()
    # Replica r trains on Lightning's DistributedSampler shard r; the single-process reference trains on
    # the concatenation of all replicas' k-th batches (the mean loss of the union is the replicas' mean).
    dataset: RandomTokenDataset = dm.dataset
    replicas = run.world_size // (run.pipeline_size or run.world_size)
    shards = [
        list(DistributedSampler(dataset, num_replicas=replicas, rank=r, shuffle=True, seed=0))
        for r in range(replicas)
    ]
    batches = []
    for k in range(len(shards[0]) // run.batch_size):
        rows = [i for shard in shards for i in shard[k * run.batch_size : (k + 1) * run.batch_size]]
        batches.append(dataset.tokens[rows])
    return DataLoader(batches, batch_size=None)


@functools.cache
def reference(run: Run) -> dict[str, Any]:
    """Single-process Trainer.fit of the same model on the same batches (migrations do not apply)."""
    run = replace(run, migrations=())
    recorder = LossRecorder()
    trainer = pl.Trainer(devices=1, callbacks=[recorder], **run.trainer_kwargs())
    model = run.reference_model()
    trainer.fit(model, _reference_batches(run))
    return {"losses": recorder.losses, "state": model.state_dict(), "grad_norms": recorder.grad_norms}


def max_param_diff(results: list[dict[str, Any]], ref: dict[str, Any]) -> float:
    merged: dict[str, torch.Tensor] = {}
    for res in results:
        merged.update(res["state"])  # data-parallel replicas hold identical copies
    assert set(merged) == set(ref["state"]), set(merged) ^ set(ref["state"])
    return max((merged[k] - ref["state"][k]).abs().max().item() for k in ref["state"])


def assert_matches_reference(
    results: list[dict[str, Any]], ref: dict[str, Any], run: Run, tol: float = TOL
) -> None:
    expected_steps = run.steps * run.accumulate + (1 if run.extra_samples else 0)
    for rank, res in enumerate(results):
        assert len(res["losses"]) == expected_steps, f"rank {rank} logged {len(res['losses'])} losses"
        diff = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"], strict=True))
        assert diff < tol, f"rank {rank}: logged losses differ from the reference by {diff:.3e}"
    worst = max_param_diff(results, ref)
    assert worst < tol, f"parameters differ from the reference by up to {worst:.3e}"
