"""The sparse-attention GPT under DynMoStrategy + DynMoCallback equals its single-process reference.

Every block draws new hash rotations at every training forward, seeded by the layer and its count of
training forwards; the reference is ``GPT(microbatches=n)`` trained in one process on the same batches,
with ``n`` the pipeline's micro-batches, so it runs each block once per micro-batch in the same order.
The pipeline must not disturb the count (torch's shape-inference pass, the rebuilt pipeline's pass after
a migration, validation), the count must travel with a migrating block and be restored on resume. Each
test compares the logged losses and every parameter and buffer (the counts included) in float64, and has
negative controls:

- 2 pipeline stages from a lopsided placement the callback must fix (periodic trigger, with validation
  between epochs): rank 1 built with another ``hash_seed`` (its blocks draw other rotations), and a
  reference that does not cut batches into the pipeline's micro-batches (other counts, other rotations);
- a checkpoint resumed at another placement: a resume that loses the forward counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.dynamism.sparse_attention import SparseAttentionOptions
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.case_fit import (
    Fit,
    MetricsRecorder,
    fit_case,
    fit_reference,
    resume_elsewhere,
    trainer_kwargs,
)
from tests.distributed.controls import ForgetOnResume
from tests.distributed.equivalence import assert_differs, assert_equivalent, state_diff

pytestmark = pytest.mark.distributed

# Periodic rebalancing (the trigger sparse attention gets in the README), small windows for a short run.
# Balanced by parameter count, so the move off the lopsided start does not hang on timings of tiny blocks
# (measured, head and loss included, they can call the start balanced on a loaded machine).
PERIODIC: tuple[tuple[str, Any], ...] = (
    ("cost", "params"),
    ("every_n_steps", 2),
    ("profiling", ProfilingConfig(warmup_steps=0, steps=1)),
)


@dataclass(frozen=True)
class SparseRun:
    """One training configuration, shared by the pipelined run and its single-process reference."""

    placement: str = "0-0|1-3"
    num_microbatches: int = 2
    batch_size: int = 4
    steps: int = 4  # per epoch
    epochs: int = 2
    # Rank -> hash_seed of the model that rank builds (negative control); absent ranks use 0.
    hash_seeds: tuple[tuple[int, int], ...] = ()
    # DynMoCallback's keyword arguments; None: no callback.
    dynmo: tuple[tuple[str, Any], ...] | None = PERIODIC
    strategy_cls: type[DynMoStrategy] = DynMoStrategy

    def config(self, hash_seed: int = 0) -> GPTConfig:
        def sparse(num_buckets: int, block_size: int) -> SparseAttentionOptions:
            return SparseAttentionOptions(num_buckets=num_buckets, block_size=block_size, hash_seed=hash_seed)

        blocks = [sparse(4, 4), "dense", sparse(2, 8), sparse(8, 2)]
        return GPTConfig(vocab_size=64, seq_len=16, num_layers=4, d_model=16, num_heads=2, blocks=blocks)

    def model(self, microbatches: int = 1, hash_seed: int = 0) -> GPT:
        return GPT(self.config(hash_seed), OptimizerConfig(lr=1e-2), microbatches=microbatches)

    def tokens(self, rows: int) -> Tensor:
        return torch.randint(0, 64, (rows, 17), generator=torch.Generator().manual_seed(rows))

    def loaders(self) -> tuple[DataLoader[Tensor], DataLoader[Tensor]]:
        train = DataLoader(list(self.tokens(self.batch_size * self.steps)), batch_size=self.batch_size)
        return train, DataLoader(list(self.tokens(self.batch_size)), batch_size=self.batch_size)

    def recorder(self) -> MetricsRecorder:
        """The logged training loss of every step and the validation loss of every epoch."""
        return MetricsRecorder("train_loss", validation="val_loss")

    def trainer(self) -> dict[str, Any]:
        return trainer_kwargs(self.epochs, num_sanity_val_steps=1)

    def rank_fit(self, rank: int, world_size: int, resume: bool) -> Fit:
        dynmo = [DynMoCallback(**dict(self.dynmo))] if self.dynmo is not None else []
        strategy = self.strategy_cls(
            schedule="1F1B", num_microbatches=self.num_microbatches, placement=self.placement
        )
        model = self.model(hash_seed=dict(self.hash_seeds).get(rank, 0))
        return Fit(model, self.loaders(), self.recorder(), self.trainer(), dynmo, strategy)

    def reference(self, microbatches: int | None = None) -> dict[str, Any]:
        """Each block runs once per micro-batch of the pipeline's split, in the same order."""
        model = self.model(microbatches=microbatches or self.num_microbatches)
        return fit_reference(Fit(model, self.loaders(), self.recorder(), self.trainer()))


class ForgetForwardCounts(ForgetOnResume):
    """Negative control: resumes everything but the blocks' forward counts (they restart at zero)."""

    forget = "hash_forwards"


def _counts(state: dict[str, Tensor]) -> list[int]:
    return [int(v) for k, v in sorted(state.items()) if k.endswith("hash_forwards")]


@pytest.mark.slow
def test_sparse_attention_gpt_with_rebalancing_equals_single_process(tmp_path: Path) -> None:
    run = SparseRun()
    results = fit_case(run, tmp_path)
    ref = run.reference()
    for res in results:
        assert res["moved"], "the callback must move layers off the lopsided start placement"
        assert res["placement"] != run.placement
    steps = run.steps * run.epochs
    assert _counts(ref["state"]) == [steps * run.num_microbatches] * 3  # validation did not count
    assert_equivalent(results, ref)
    # Negative controls: rank 1's blocks draw other rotations; a reference with one micro-batch per
    # step counts (and draws) differently.
    other_seed = fit_case(replace(run, hash_seeds=((1, 1),)), tmp_path)
    assert_differs(other_seed, ref, "another hash seed on rank 1")
    assert_differs(results, run.reference(microbatches=1), "one micro-batch per step")


@pytest.mark.slow
def test_sparse_attention_gpt_resumed_at_another_placement_continues_exactly(tmp_path: Path) -> None:
    run = SparseRun(epochs=1)
    # Negative control: the same resume with the forward counts lost.
    second, resumed, forgot = resume_elsewhere(run, tmp_path, forgetful=ForgetForwardCounts)
    ref = second.reference()
    first_epoch = run.steps + 1  # the training losses and the validation loss
    assert_equivalent(resumed, ref, ref["losses"][first_epoch:])
    assert state_diff(forgot, ref) > 1e-6
