"""Layer freezing of the GPT under DynMoStrategy on 2 gloo ranks equals the single-process run (float64).

- AutoFreeze with DynMoCallback: each ``frozen`` event makes the callback profile and decide at the next
  steps, the ranks take the decisions of the reference, and training equals it.
- A scheduled freeze of rank 0's whole stage (embeddings and layers 0-1): rank 0 runs no backward and its
  parameters never change, rank 1 trains; then forced migrations move frozen layers both ways.
- Resume from a checkpoint on another placement keeps the frozen prefix frozen.
- The zero-bubble V schedule behind a frozen prefix trains the unfrozen layers (pipeline/gradless.py).

Negative controls: a migration that loses the frozen flag's effect (``requires_grad`` back on) on arrival,
a resume that does not re-apply the flags, and the V schedule without the gradless guard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.dynamism.freezing import FreezingConfig
from lightning_dynmo.dynamism_callbacks import FreezingCallback
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.pipeline.step import schedule as schedule_module
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import TOL, ForcePlacement, LossRecorder
from tests.distributed.harness import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@dataclass(frozen=True)
class FreezeRun:
    """One training configuration, shared by the pipelined run and its single-process reference."""

    config: FreezingConfig
    placement: str = "0-1|2-3"
    schedule: str = "1F1B"
    pipeline_size: int | None = None  # 1: two data-parallel replicas of the whole model
    migrations: tuple[tuple[int, str], ...] = ()
    dynmo: bool = False
    steps: int = 10
    epochs: int = 1

    def model(self) -> GPT:
        config = GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=16, vocab_size=64)
        return GPT(config, OptimizerConfig(lr=1e-2, weight_decay=0.1))

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


class TrainableOnArrival(DynMoStrategy):
    """Negative control: a layer that migrates arrives trainable (its frozen flag not applied)."""

    def apply_placement(self, new: Any) -> Any:
        report = super().apply_placement(new)
        module = self.lightning_module
        assert module is not None
        for move in report.moves:
            if move.dst == self.global_rank:
                for param in module.get_submodule(move.name).parameters():
                    param.requires_grad_(True)
        return report


class NoFlagsOnResume(FreezingCallback):
    """Negative control: the resumed run does not turn the restored flags into ``requires_grad``."""

    @property
    def state_key(self) -> str:
        return "FreezingCallback"  # loads the state the positive run saved

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        return None


class Snapshots(pl.Callback):
    """Every local parameter after each optimizer step, by name."""

    def __init__(self) -> None:
        self.after: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.after.append(
            {n: p.detach().clone() for n, p in pl_module.named_parameters() if p.device.type != "meta"}
        )


def outcome(model: GPT, recorder: LossRecorder, freezing: FreezingCallback) -> dict[str, Any]:
    return {
        "losses": recorder.losses,
        "state": {
            k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
        },
        "history": [(r.step, r.num_frozen, r.reason) for r in freezing.history],
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
    }


def fit_worker(
    rank: int,
    world_size: int,
    run: FreezeRun,
    strategy_cls: type[DynMoStrategy],
    ckpt: Path | None,
    resume: bool,
    callback_cls: type[FreezingCallback],
) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    recorder, freezing, mover = LossRecorder(), callback_cls(run.config), ForcePlacement(dict(run.migrations))
    snapshots = Snapshots()
    callbacks: list[pl.Callback] = [recorder, freezing, mover, snapshots]
    dynmo = DynMoCallback(
        balancer="partition", cost="time", profiling=ProfilingConfig(warmup_steps=0, steps=1)
    )
    if run.dynmo:
        callbacks.append(dynmo)
    strategy = strategy_cls(
        schedule=run.schedule, num_microbatches=4, placement=run.placement, pipeline_size=run.pipeline_size
    )
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
        **outcome(model, recorder, freezing),
        "applied": mover.applied,
        "rebalances": [r.to_dict() for r in dynmo.rebalances],
        "events": [(e.kind, e.layers, e.step) for e in dynmo.events],
        "snapshots": snapshots.after,
    }


def fit_distributed(
    run: FreezeRun,
    tmp_path: Path,
    strategy_cls: type[DynMoStrategy] = DynMoStrategy,
    ckpt: Path | None = None,
    resume: bool = False,
    callback_cls: type[FreezingCallback] = FreezingCallback,
) -> list[dict[str, Any]]:
    args = (run, strategy_cls, ckpt, resume, callback_cls)
    return run_distributed(fit_worker, 2, tmp_path, timeout_s=180, args=args)


def reference(run: FreezeRun) -> dict[str, Any]:
    """The same training in this process, without pipeline, migrations or DynMo."""
    recorder, freezing = LossRecorder(), FreezingCallback(run.config)
    trainer = pl.Trainer(devices=1, callbacks=[recorder, freezing], **run.trainer_kwargs())
    model = run.model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.fit(model, run.datamodule())
    finally:
        torch.set_num_threads(threads)
    return outcome(model, recorder, freezing)


def state_diff(results: list[dict[str, Any]], ref: dict[str, Any]) -> float:
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
    for res in results:
        assert len(res["losses"]) == len(losses)
        diff = max(abs(a - b) for a, b in zip(res["losses"], losses, strict=True))
        assert diff < TOL, f"losses differ from the reference by {diff:.3e}"
        assert res["history"] == ref["history"]  # the same decisions on every rank
    assert state_diff(results, ref) < TOL
    assert sorted({n for res in results for n in res["trainable"]}) == ref["trainable"]


def test_autofreeze_events_drive_dynmo_and_training_equals_single_process(tmp_path: Path) -> None:
    run = FreezeRun(config=FreezingConfig(check_every=2), dynmo=True, steps=10)
    ref = reference(run)
    assert ref["history"] and ref["history"][0][0] == 4  # the first decision: after two intervals
    assert ref["history"][0][1] >= 1
    results = fit_distributed(run, tmp_path)
    assert_equal_to_reference(results, ref, ref["losses"])
    for res in results:
        frozen_at = sorted({step for kind, _, step in res["events"] if kind == "frozen"})
        assert frozen_at == [step for step, _, _ in ref["history"]]
        # Each event: profile the next step, decide at its end, apply at the start of the one after.
        decided = [(r["step"], r["reason"]) for r in res["rebalances"]]
        assert decided == [(s + 2, "event") for s in frozen_at if s + 2 < run.steps]
    # Negative control: the same comparison against a reference that froze one block fewer fails.
    fewer = reference(replace(run, config=FreezingConfig(check_every=2, max_frozen=ref["history"][0][1] - 1)))
    assert fewer["history"] != ref["history"]
    assert state_diff(results, fewer) > 1e-4


def test_data_parallel_replicas_take_the_same_decisions(tmp_path: Path) -> None:
    # Two replicas of the whole model reading the same batches: their averaged gradients, norm sums and
    # decisions are the single process's, and frozen blocks join no gradient average.
    run = FreezeRun(config=FreezingConfig(check_every=2), placement="0-3", pipeline_size=1, steps=8)
    ref = reference(run)
    assert ref["history"]
    results = fit_distributed(run, tmp_path)
    for res in results:
        assert state_diff([res], ref) < TOL
    assert_equal_to_reference(results[:1], ref, ref["losses"])
    assert results[1]["history"] == ref["history"]


def test_fully_frozen_first_stage_trains_and_frozen_layers_migrate(tmp_path: Path) -> None:
    # Rank 0 holds the embeddings and layers 0-1, all frozen from step 2 on. At step 5 trainable layer 2
    # moves to rank 0, at step 8 frozen layer 1 (and layer 2) to rank 1.
    config = FreezingConfig(criterion="schedule", schedule=((2, 2),))
    run = FreezeRun(config=config, migrations=((5, "0-2|3-3"), (8, "0-0|1-3")), steps=11)
    ref = reference(run)
    results = fit_distributed(run, tmp_path)
    assert all(res["applied"] == ["0-2|3-3", "0-0|1-3"] for res in results)
    assert_equal_to_reference(results, ref, ref["losses"])
    rank0 = results[0]["snapshots"]
    for name in ("tok_emb.weight", "layers.0.attn.qkv.weight", "layers.1.mlp.fc_in.weight"):
        assert all(torch.equal(rank0[1][name], later[name]) for later in rank0[2:5]), name
    assert not torch.equal(
        results[1]["snapshots"][1]["head.weight"], results[1]["snapshots"][4]["head.weight"]
    )
    # Negative control: frozen layer 1 arrives on rank 1 trainable at step 8 and changes.
    lost = fit_distributed(run, tmp_path, strategy_cls=TrainableOnArrival)
    assert state_diff(lost, ref) > 1e-4


def test_resume_on_another_placement_keeps_layers_frozen(tmp_path: Path) -> None:
    # Layer 0 freezes at step 1 (epoch 1), layer 1 at step 6 (epoch 2, after the resume at step 4).
    config = FreezingConfig(criterion="schedule", schedule=((1, 1), (6, 2)))
    whole = FreezeRun(config=config, steps=4, epochs=2)
    ref = reference(whole)
    ckpt = tmp_path / "epoch1.ckpt"
    fit_distributed(replace(whole, epochs=1), tmp_path, ckpt=ckpt)
    resumed = fit_distributed(replace(whole, placement="0-2|3-3"), tmp_path, ckpt=ckpt, resume=True)
    assert_equal_to_reference(resumed, ref, ref["losses"][4:])
    lost = fit_distributed(
        replace(whole, placement="0-2|3-3"), tmp_path, ckpt=ckpt, resume=True, callback_cls=NoFlagsOnResume
    )
    assert state_diff(lost, ref) > 1e-4


def test_zero_bubble_v_schedule_trains_layers_behind_a_frozen_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ZBV on 2 ranks: stages 0 (layer 0, rank 0), 1 (layer 1, rank 1), 2 (layer 2, rank 1), 3 (layer 3,
    # rank 0). Layer 0 and the embeddings freeze at step 1: stage 1's input then needs no gradient.
    config = FreezingConfig(criterion="schedule", schedule=((1, 1),))
    run = FreezeRun(config=config, placement="0-0|1-1|2-2|3-3", schedule="ZBVZeroBubble", steps=4)
    ref = reference(run)
    results = fit_distributed(run, tmp_path)
    assert_equal_to_reference(results, ref, ref["losses"])
    # Negative control: without the guard, torch's split weight pass leaves layer 1 without gradients.
    monkeypatch.setattr(schedule_module, "guard_gradless_inputs", lambda stage: None)
    unguarded = fit_distributed(run, tmp_path)
    assert state_diff(unguarded, ref) > 1e-4
