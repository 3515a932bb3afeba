"""Trainer setups on 2 gloo ranks: the supported ones train exactly, the unsupported ones fail at setup.

Supported setups are equivalence tests against the single-process Trainer.fit of the same module in
float64 (1e-9), each with a negative control; refused ones must fail on every rank before training,
with the message of ``lightning_dynmo.strategy.trainer_checks``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
from tests.distributed.fitting import (
    Run,
    assert_matches_reference,
    fit_pipelined,
    make_strategy,
    max_param_diff,
)
from tests.distributed.fitting import reference as reference_fit
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed


class WarmupInOptimizerStep(DemoGPT):
    """LR warm-up over 4 steps in an overridden ``optimizer_step`` (Lightning's documented pattern)."""

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        for group in optimizer.param_groups:
            group["lr"] = self.demo_config.lr * min(1.0, (self.trainer.global_step + 1) / 4)
        optimizer.step(closure=optimizer_closure)


class ClipThroughLightning(DemoGPT):
    """Clips from step 2 on, through ``self.clip_gradients`` (routed through the norm over all stages)."""

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any
    ) -> None:
        if self.trainer.global_step >= 2:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class ClipWithTorch(DemoGPT):
    """Negative control: the same clipping by ``torch.nn.utils.clip_grad_norm_`` on this rank's parameters."""

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any
    ) -> None:
        if self.trainer.global_step >= 2:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)


_MODELS = {
    "plain": DemoGPT,
    "warmup": WarmupInOptimizerStep,
    "clip": ClipThroughLightning,
    "torch": ClipWithTorch,
}


@dataclass(frozen=True)
class FlagRun(Run):
    """A :class:`Run` with a model variant and a gradient-clipping algorithm."""

    variant: str = "plain"
    clip_algorithm: str | None = None

    def model(self) -> DemoGPT:
        return _MODELS[self.variant](num_layers=self.num_layers, lr_gamma=self.lr_gamma)

    def trainer_kwargs(self) -> dict[str, Any]:
        return {**super().trainer_kwargs(), "gradient_clip_algorithm": self.clip_algorithm}


def test_optimizer_step_override_and_value_clipping_train_exactly(tmp_path: Any) -> None:
    run = FlagRun(variant="warmup", lr_gamma=1.0, clip=0.01, clip_algorithm="value", steps=6)
    ref = reference_fit(run)
    assert_matches_reference(fit_pipelined(run, tmp_path), ref, run)
    # Negative controls: the warm-up and the clip both change what is learned (the test can fail).
    assert max_param_diff([reference_fit(replace(run, variant="plain"))], ref) > 1e-4
    assert max_param_diff([reference_fit(replace(run, clip=None, clip_algorithm=None))], ref) > 1e-4


def test_configure_gradient_clipping_through_clip_gradients_is_exact(tmp_path: Any) -> None:
    run = FlagRun(variant="clip", steps=6)
    ref = reference_fit(run)
    assert_matches_reference(fit_pipelined(run, tmp_path), ref, run)
    # Negative control: clipping by torch on this rank's stage alone (the single-process reference clips
    # the whole model, which is what ClipThroughLightning gets) does not match.
    local = fit_pipelined(replace(run, variant="torch"), tmp_path)
    assert max_param_diff(local, ref) > 1e-4


def _refused_worker(rank: int, world_size: int, case: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    run = Run()
    model = run.model()
    data: Any = run.datamodule()
    if case == "manual":
        model.automatic_optimization = False
    elif case == "sharded-by-global-rank":
        # A natural mistake with use_distributed_sampler=False: shard by global rank, so the two stages
        # of the one pipeline read different samples.
        dataset = RandomTokenDataModule(run.batch_size, 32).dataset
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        data = DataLoader(dataset, batch_size=run.batch_size, sampler=sampler, drop_last=True)
    trainer = pl.Trainer(
        devices=world_size, strategy=make_strategy(run), use_distributed_sampler=False, **run.trainer_kwargs()
    )
    if isinstance(data, pl.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, data)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        (
            "manual",
            r"(?s)rank 0 -----.*automatic_optimization is False.*"
            r"rank 1 -----.*automatic_optimization is False",
        ),
        (
            "sharded-by-global-rank",
            r"(?s)rank 0 -----.*ranks \[0, 1\] of pipeline 0 read different batches at the first batch.*"
            r"rank 1 -----.*read different batches",
        ),
    ],
)
def test_refused_setups_fail_on_every_rank_before_training(case: str, match: str, tmp_path: Any) -> None:
    with pytest.raises(AssertionError, match=match):
        run_distributed(_refused_worker, 2, tmp_path, timeout_s=60, args=(case,))
