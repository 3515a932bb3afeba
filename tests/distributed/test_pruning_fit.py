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

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.dynamism.pruning import PruningConfig, prunable_linears
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_linear import MaskedLinear
from lightning_dynmo.dynamism_callbacks import PruningCallback
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import TOL, ForcePlacement, LossRecorder
from tests.distributed.harness import run_distributed

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

    def model(self) -> GPT:
        config = GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=16, vocab_size=64)
        return GPT(config, OptimizerConfig(lr=1e-2, weight_decay=0.1))

    def pruning(self) -> PruningCallback:
        return PruningCallback(PruningConfig(schedule=self.schedule, kernel="csr"))

    def datamodule(self) -> RandomTokenDataModule:
        return RandomTokenDataModule(batch_size=8, num_samples=8 * self.steps, seq_len=16, vocab_size=64)

    def trainer_kwargs(self) -> dict[str, Any]:
        return {
            "accelerator": "cpu",
            "precision": "64-true",
            "max_epochs": self.epochs,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        }


class DropMasksOnArrival(DynMoStrategy):
    """Negative control: a layer that migrates arrives without its masks (all weights kept again)."""

    def apply_placement(self, new: Any) -> Any:
        report = super().apply_placement(new)
        module = self.lightning_module
        assert module is not None
        for move in report.moves:
            if move.dst == self.global_rank:
                forget_masks(module.get_submodule(move.name))
        return report


def forget_masks(module: nn.Module) -> None:
    for sub in module.modules():
        if isinstance(sub, MaskedLinear):
            sub.weight_mask.fill_(True)
            sub._pruned = False


class DropMasksOnResume(pl.Callback):
    """Negative control: the resumed run starts with every weight kept (masks lost by the checkpoint)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        forget_masks(pl_module)


def outcome(model: GPT, recorder: LossRecorder, pruning: PruningCallback) -> dict[str, Any]:
    layers = {int(k): b for k, b in model.layers.items()}
    return {
        "losses": recorder.losses,
        "state": {
            k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
        },
        "kernels": {n: m.kernel for _, n, m in prunable_linears(layers)},
        "history": [(r.step, r.sparsity) for r in pruning.history],
    }


def fit_worker(
    rank: int,
    world_size: int,
    run: PruneRun,
    strategy_cls: type[DynMoStrategy],
    ckpt: Path | None,
    resume: bool,
    extra: list[pl.Callback],
) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)  # LightningEnvironment: processes are created externally
    os.environ["NODE_RANK"] = "0"
    recorder, pruning, mover = LossRecorder(), run.pruning(), ForcePlacement(dict(run.migrations))
    callbacks: list[pl.Callback] = [recorder, pruning, mover, *extra]
    dynmo = DynMoCallback(
        balancer="partition", cost="time", profiling=ProfilingConfig(warmup_steps=0, steps=1)
    )
    if run.dynmo:
        callbacks.append(dynmo)
    strategy = strategy_cls(schedule="1F1B", num_microbatches=4, placement=run.placement)
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **run.trainer_kwargs(),
    )
    model = run.model()
    trainer.fit(model, run.datamodule(), ckpt_path=ckpt if resume else None)
    if ckpt is not None and not resume:
        trainer.save_checkpoint(ckpt)
    return {
        **outcome(model, recorder, pruning),
        "released": strategy.is_released,
        "applied": mover.applied,
        "rebalances": [r.to_dict() for r in dynmo.rebalances],
        "events": [(e.kind, e.layers, e.step) for e in dynmo.events],
    }


def fit_distributed(
    run: PruneRun,
    tmp_path: Path,
    strategy_cls: type[DynMoStrategy] = DynMoStrategy,
    ckpt: Path | None = None,
    resume: bool = False,
    extra: tuple[pl.Callback, ...] = (),
) -> list[dict[str, Any]]:
    args = (run, strategy_cls, ckpt, resume, list(extra))
    return run_distributed(fit_worker, 2, tmp_path, timeout_s=180, args=args)


def reference(run: PruneRun) -> dict[str, Any]:
    """The same training in this process, on one device, without migrations or DynMo."""
    recorder, pruning = LossRecorder(), run.pruning()
    trainer = pl.Trainer(devices=1, callbacks=[recorder, pruning], **run.trainer_kwargs())
    model = run.model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: tiny matrices are much slower on 2 threads here
    try:
        trainer.fit(model, run.datamodule())
    finally:
        torch.set_num_threads(threads)
    return outcome(model, recorder, pruning)


def state_diff(results: list[dict[str, Any]], ref: dict[str, Any]) -> float:
    """Largest difference of a float tensor; masks must be identical (inf if not)."""
    merged: dict[str, torch.Tensor] = {}
    for res in results:
        merged.update(res["state"])
    assert set(merged) == set(ref["state"]), set(merged) ^ set(ref["state"])
    worst = 0.0
    for key, want in ref["state"].items():
        if want.dtype == torch.bool:
            if not torch.equal(merged[key], want):
                return float("inf")
        else:
            worst = max(worst, (merged[key] - want).abs().max().item())
    return worst


def assert_equal_to_reference(
    results: list[dict[str, Any]], ref: dict[str, Any], losses: list[float]
) -> None:
    active = [res for res in results if not res["released"]]
    for res in results:
        n = len(res["losses"])
        diff = max(abs(a - b) for a, b in zip(res["losses"], losses[:n], strict=True))
        assert diff < TOL, f"losses differ from the reference by {diff:.3e}"
    for res in active:
        assert len(res["losses"]) == len(losses)
    assert state_diff(active, ref) < TOL
    kernels = {k: v for res in active for k, v in res["kernels"].items()}
    assert kernels == ref["kernels"]
    for key, mask in ref["state"].items():  # the pruned weights are exactly zero where the ranks left them
        if key.endswith("weight_mask"):
            weight = next(res["state"][key[: -len("_mask")]] for res in active if key in res["state"])
            assert (weight[~mask] == 0).all()


def test_pruning_events_drive_dynmo_and_training_equals_single_process(tmp_path: Path) -> None:
    run = PruneRun(dynmo=True)
    ref = reference(run)
    assert [step for step, _ in ref["history"]] == [1, 3, 5, 7, 9]
    assert ref["history"][-1][1] == pytest.approx(0.8, abs=1e-4)
    results = fit_distributed(run, tmp_path)
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
    ref = reference(run)
    results = fit_distributed(run, tmp_path)
    assert all(res["applied"] == ["0-2|3-3", "0-0|1-3"] for res in results)
    assert_equal_to_reference(results, ref, ref["losses"])
    # Negative control: layers that lose their masks when they move regrow their pruned weights.
    dropped = fit_distributed(run, tmp_path, strategy_cls=DropMasksOnArrival)
    assert state_diff(dropped, ref) > 1e-4


def test_pruning_after_a_repack_stays_global_and_exact(tmp_path: Path) -> None:
    # Re-pack onto rank 0 at step 6; steps 7 and 9 prune on the one-rank pipeline.
    run = PruneRun(steps=11, migrations=((6, "0-3"),))
    ref = reference(run)
    results = fit_distributed(run, tmp_path)
    assert results[0]["applied"] == ["0-3"] and results[1]["released"]
    assert_equal_to_reference(results, ref, ref["losses"])
    assert results[0]["history"] == ref["history"]
    assert results[1]["history"] == ref["history"][:3]


@pytest.mark.parametrize("num_steps", [4, 2], ids=["pruning-after-resume", "pruning-done-before"])
def test_resume_on_another_placement_keeps_pruning_exactly(num_steps: int, tmp_path: Path) -> None:
    # Epoch 1 is steps 0-5 (pruning at 1, 3, 5), epoch 2 steps 6-11 (pruning at 7, 9 with num_steps=4).
    schedule = PruningSchedule(final_sparsity=0.8, start_step=1, frequency=2, num_steps=num_steps)
    whole = PruneRun(steps=6, epochs=2, schedule=schedule)
    ref = reference(whole)
    ckpt = tmp_path / "epoch1.ckpt"
    fit_distributed(replace(whole, epochs=1), tmp_path, ckpt=ckpt)
    resumed = fit_distributed(replace(whole, placement="0-2|3-3"), tmp_path, ckpt=ckpt, resume=True)
    assert_equal_to_reference(resumed, ref, ref["losses"][6:])
    for res in resumed:
        assert res["history"] == ref["history"]  # restored from the checkpoint (and continued)
    if num_steps == 2:
        # Negative control: a resume that loses the masks regrows the pruned weights. (With pruning steps
        # after the resume the next selection would prune the regrown entries again before any forward.)
        lost = fit_distributed(
            replace(whole, placement="0-2|3-3"),
            tmp_path,
            ckpt=ckpt,
            resume=True,
            extra=(DropMasksOnResume(),),
        )
        assert state_diff(lost, ref) > 1e-4
