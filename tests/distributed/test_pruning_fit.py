"""Global pruning of the GPT under DynMoStrategy on 2 gloo ranks equals the single-process run (float64).

- With DynMoCallback: every pruning step's ``pruned`` event makes the callback profile and decide at the
  next steps (its records say so), and training equals the reference.
- Forced migrations of pruned layers (one after the last pruning step): masks, kernels, zeros and Adam
  state travel.
- A re-pack onto one rank before the last pruning steps: the threshold stays global and exact.
- Resume from a checkpoint on another placement, with pruning steps after the checkpoint and without.

Everything runs on the CSR kernel (forced), so the sparse path is what trains. Negative controls: a
migration that loses the masks of the layers it moves, and a resume that loses them. Both are placed
after the last pruning step: a lost mask is healed by the next selection, which prunes the regrown
entries again before any forward uses them (they are tiny, and a step's pruning runs before its forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from torch import nn

from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.dynamism.pruning import PruningConfig, prunable_linears
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_linear import MaskedLinear
from lightning_dynmo.dynamism_callbacks import PruningCallback
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.case_fit import Fit, fit_case, fit_reference, rebalance_on_events, trainer_kwargs
from tests.distributed.controls import SpoilOnArrival
from tests.distributed.equivalence import assert_equivalent, state_diff
from tests.distributed.fitting import ForcePlacement, LossRecorder

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@dataclass(frozen=True)
class PruneRun:
    """One training configuration, shared by the pipelined run and its single-process reference."""

    placement: str = "0-1|2-3"
    # (batch_idx, placement) applied at on_train_batch_start; "0-3" re-packs onto rank 0.
    migrations: tuple[tuple[int, str], ...] = ()
    dynmo: bool = False  # DynMoCallback, rebalancing on events
    steps: int = 10  # per epoch
    epochs: int = 1
    schedule: PruningSchedule = field(
        default_factory=lambda: PruningSchedule(final_sparsity=0.8, start_step=1, frequency=2, num_steps=4)
    )
    strategy_cls: type[DynMoStrategy] = DynMoStrategy
    extra: tuple[pl.Callback, ...] = ()

    def model(self) -> GPT:
        config = GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=16, vocab_size=64)
        return GPT(config, OptimizerConfig(lr=1e-2, weight_decay=0.1))

    def pruning(self) -> PruningCallback:
        return PruningCallback(PruningConfig(schedule=self.schedule, kernel="csr"))

    def datamodule(self) -> RandomTokenDataModule:
        return RandomTokenDataModule(batch_size=8, num_samples=8 * self.steps, seq_len=16, vocab_size=64)

    def rank_fit(self, rank: int, world_size: int, resume: bool) -> Fit:
        model, pruning = self.model(), self.pruning()
        callbacks: list[pl.Callback] = [pruning, ForcePlacement(dict(self.migrations)), *self.extra]
        if self.dynmo:
            callbacks.append(rebalance_on_events())
        strategy = self.strategy_cls(schedule="1F1B", num_microbatches=4, placement=self.placement)
        fit = Fit(
            model, (self.datamodule(),), LossRecorder(), trainer_kwargs(self.epochs), callbacks, strategy
        )
        fit.outcome = lambda trainer: outcome(model, pruning)
        return fit

    def reference(self) -> dict[str, Any]:
        """The same training in this process, on one device, without migrations or DynMo."""
        model, pruning = self.model(), self.pruning()
        fit = Fit(model, (self.datamodule(),), LossRecorder(), trainer_kwargs(self.epochs), [pruning])
        fit.outcome = lambda trainer: outcome(model, pruning)
        return fit_reference(fit)


class DropMasksOnArrival(SpoilOnArrival):
    """Negative control: a layer that migrates arrives without its masks (all weights kept again)."""

    def spoil(self, block: nn.Module) -> None:
        forget_masks(block)


def forget_masks(module: nn.Module) -> None:
    for sub in module.modules():
        if isinstance(sub, MaskedLinear):
            sub.weight_mask.fill_(True)
            sub._pruned = False


class DropMasksOnResume(pl.Callback):
    """Negative control: the resumed run starts with every weight kept (masks lost by the checkpoint)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        forget_masks(pl_module)


def outcome(model: GPT, pruning: PruningCallback) -> dict[str, Any]:
    layers = {int(k): b for k, b in model.layers.items()}
    return {
        "kernels": {n: m.kernel for _, n, m in prunable_linears(layers)},
        "history": [(r.step, r.sparsity) for r in pruning.history],
    }


def assert_equal_to_reference(
    results: list[dict[str, Any]], ref: dict[str, Any], losses: list[float]
) -> None:
    assert_equivalent(results, ref, losses)  # masks must be identical
    active = [res for res in results if not res["released"]]
    kernels = {k: v for res in active for k, v in res["kernels"].items()}
    assert kernels == ref["kernels"]
    for key, mask in ref["state"].items():  # the pruned weights are exactly zero where the ranks left them
        if key.endswith("weight_mask"):
            weight = next(res["state"][key[: -len("_mask")]] for res in active if key in res["state"])
            assert (weight[~mask] == 0).all()


def test_pruning_events_drive_dynmo_and_training_equals_single_process(tmp_path: Path) -> None:
    run = PruneRun(dynmo=True)
    ref = run.reference()
    assert [step for step, _ in ref["history"]] == [1, 3, 5, 7, 9]
    assert ref["history"][-1][1] == pytest.approx(0.8, abs=1e-4)
    results = fit_case(run, tmp_path)
    assert_equal_to_reference(results, ref, ref["losses"])
    for res in results:
        assert res["history"] == ref["history"]  # the same global sparsity on every rank
        pruned_at = sorted({step for kind, _, step in res["events"] if kind == "pruned"})
        assert pruned_at == [3, 5, 7, 9]  # step 1 prunes to 0%: nothing changes, no event
        assert {layer for _, layers, _ in res["events"] for layer in layers} == {0, 1, 2, 3}
        # Each event: profile the next step, decide at its end, apply at the start of the one after.
        decided = [(r["step"], r["reason"]) for r in res["rebalances"]]
        assert decided == [(5, "event"), (7, "event"), (9, "event")]


def test_pruned_layers_migrate_exactly(tmp_path: Path) -> None:
    # Pruning at 1, 3, 5, 7; the second migration comes after the last pruning step, so a lost mask cannot
    # be healed by the next selection (which would re-prune the few regrown entries before any forward).
    schedule = PruningSchedule(final_sparsity=0.8, start_step=1, frequency=2, num_steps=3)
    run = PruneRun(steps=11, schedule=schedule, migrations=((4, "0-2|3-3"), (8, "0-0|1-3")))
    ref = run.reference()
    results = fit_case(run, tmp_path)
    assert all(res["applied"] == ["0-2|3-3", "0-0|1-3"] for res in results)
    assert_equal_to_reference(results, ref, ref["losses"])
    # Negative control: layers that lose their masks when they move regrow their pruned weights.
    dropped = fit_case(replace(run, strategy_cls=DropMasksOnArrival), tmp_path)
    assert state_diff(dropped, ref) > 1e-4


def test_pruning_after_a_repack_stays_global_and_exact(tmp_path: Path) -> None:
    # Re-pack onto rank 0 at step 6; steps 7 and 9 prune on the one-rank pipeline.
    run = PruneRun(steps=11, migrations=((6, "0-3"),))
    ref = run.reference()
    results = fit_case(run, tmp_path)
    assert results[0]["applied"] == ["0-3"] and results[1]["released"]
    assert_equal_to_reference(results, ref, ref["losses"])
    assert results[0]["history"] == ref["history"]
    assert results[1]["history"] == ref["history"][:3]


@pytest.mark.parametrize("num_steps", [4, 2], ids=["pruning-after-resume", "pruning-done-before"])
def test_resume_on_another_placement_keeps_pruning_exactly(num_steps: int, tmp_path: Path) -> None:
    # Epoch 1 is steps 0-5 (pruning at 1, 3, 5), epoch 2 steps 6-11 (pruning at 7, 9 with num_steps=4).
    schedule = PruningSchedule(final_sparsity=0.8, start_step=1, frequency=2, num_steps=num_steps)
    whole = PruneRun(steps=6, epochs=2, schedule=schedule)
    ref = whole.reference()
    ckpt = tmp_path / "epoch1.ckpt"
    fit_case(replace(whole, epochs=1), tmp_path, ckpt=ckpt)
    resumed = fit_case(replace(whole, placement="0-2|3-3"), tmp_path, ckpt=ckpt, resume=True)
    assert_equal_to_reference(resumed, ref, ref["losses"][6:])
    for res in resumed:
        assert res["history"] == ref["history"]  # restored from the checkpoint (and continued)
    if num_steps == 2:
        # Negative control: a resume that loses the masks regrows the pruned weights. (With pruning steps
        # after the resume the next selection would prune the regrown entries again before any forward.)
        forgetful = replace(whole, placement="0-2|3-3", extra=(DropMasksOnResume(),))
        lost = fit_case(forgetful, tmp_path, ckpt=ckpt, resume=True)
        assert state_diff(lost, ref) > 1e-4
