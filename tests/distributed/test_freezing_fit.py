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

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.dynamism.freezing import FreezingConfig
from lightning_dynmo.dynamism_callbacks import FreezingCallback
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.pipeline.step import schedule as schedule_module
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.case_fit import Fit, fit_case, fit_reference, rebalance_on_events, trainer_kwargs
from tests.distributed.controls import SpoilOnArrival
from tests.distributed.equivalence import assert_equivalent, state_diff
from tests.distributed.fitting import TOL, ForcePlacement, LossRecorder

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
    skip_balanced: bool = False  # DynMoCallback's (with dynmo)
    steps: int = 10
    epochs: int = 1
    strategy_cls: type[DynMoStrategy] = DynMoStrategy
    callback_cls: type[FreezingCallback] = FreezingCallback

    def model(self) -> GPT:
        config = GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=16, vocab_size=64)
        return GPT(config, OptimizerConfig(lr=1e-2, weight_decay=0.1))

    def datamodule(self) -> RandomTokenDataModule:
        return RandomTokenDataModule(batch_size=8, num_samples=8 * self.steps, seq_len=16, vocab_size=64)

    def rank_fit(self, rank: int, world_size: int, resume: bool) -> Fit:
        model, freezing, snapshots = self.model(), self.callback_cls(self.config), Snapshots()
        callbacks: list[pl.Callback] = [freezing, ForcePlacement(dict(self.migrations)), snapshots]
        if self.dynmo:
            callbacks.append(rebalance_on_events(self.skip_balanced))
        strategy = self.strategy_cls(
            schedule=self.schedule,
            num_microbatches=4,
            placement=self.placement,
            pipeline_size=self.pipeline_size,
        )

        def report(trainer: pl.Trainer) -> dict[str, Any]:
            return {**outcome(model, freezing), "snapshots": snapshots.after}

        return Fit(
            model,
            (self.datamodule(),),
            LossRecorder(),
            trainer_kwargs(self.epochs),
            callbacks,
            strategy,
            outcome=report,
        )

    def reference(self) -> dict[str, Any]:
        """The same training in this process, without pipeline, migrations or DynMo."""
        model, freezing = self.model(), FreezingCallback(self.config)
        fit = Fit(model, (self.datamodule(),), LossRecorder(), trainer_kwargs(self.epochs), [freezing])
        fit.outcome = lambda trainer: outcome(model, freezing)
        return fit_reference(fit)


class TrainableOnArrival(SpoilOnArrival):
    """Negative control: a layer that migrates arrives trainable (its frozen flag not applied)."""

    def spoil(self, block: torch.nn.Module) -> None:
        for param in block.parameters():
            param.requires_grad_(True)


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


def outcome(model: GPT, freezing: FreezingCallback) -> dict[str, Any]:
    return {
        "history": [(r.step, r.num_frozen, r.reason) for r in freezing.history],
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
    }


def assert_equal_to_reference(
    results: list[dict[str, Any]], ref: dict[str, Any], losses: list[float]
) -> None:
    assert_equivalent(results, ref, losses)
    for res in results:
        assert res["history"] == ref["history"]  # the same decisions on every rank
    assert sorted({n for res in results for n in res["trainable"]}) == ref["trainable"]


def test_autofreeze_events_drive_dynmo_and_training_equals_single_process(tmp_path: Path) -> None:
    run = FreezeRun(config=FreezingConfig(check_every=2), dynmo=True, steps=10)
    ref = run.reference()
    assert ref["history"] and ref["history"][0][0] == 4  # the first decision: after two intervals
    assert ref["history"][0][1] >= 1
    results = fit_case(run, tmp_path)
    assert_equal_to_reference(results, ref, ref["losses"])
    for res in results:
        frozen_at = sorted({step for kind, _, step in res["events"] if kind == "frozen"})
        assert frozen_at == [step for step, _, _ in ref["history"]]
        # Each event: profile the next step, decide at its end, apply at the start of the one after.
        decided = [(r["step"], r["reason"]) for r in res["rebalances"]]
        assert decided == [(s + 2, "event") for s in frozen_at if s + 2 < run.steps]
    # Negative control: the same comparison against a reference that froze one block fewer fails.
    fewer = replace(
        run, config=FreezingConfig(check_every=2, max_frozen=ref["history"][0][1] - 1)
    ).reference()
    assert fewer["history"] != ref["history"]
    assert state_diff(results, fewer) > 1e-4


def test_with_skip_balanced_a_later_event_is_judged_on_its_own_step_then_decides_or_is_skipped(
    tmp_path: Path,
) -> None:
    run = FreezeRun(config=FreezingConfig(check_every=2), dynmo=True, skip_balanced=True, steps=10)
    ref = run.reference()
    results = fit_case(run, tmp_path)
    assert_equal_to_reference(results, ref, ref["losses"])
    for res in results:
        first, *later = sorted({step for kind, _, step in res["events"] if kind == "frozen"})
        judged = [s for s in later if s + 2 < run.steps]
        assert judged, f"the run must have an event after the first decision (events at {[first, *later]})"
        decided = [(r["step"], r["reason"]) for r in res["rebalances"]]
        # Before any decision an event's window opens at once (profile, decide, apply two steps later).
        assert decided[0] == (first + 2, "event")
        # After it, the event's own step is judged (FreezingCallback freezes and publishes at the step's
        # first batch, before the stages compute: the step ran the changed model); then its window opens
        # (a decision two steps after the event, three when it came mid-step) or the stage shares stayed
        # where the decision left them (a skip). The ranks agree on which (the same decisions above; the
        # skip counts below).
        assert all(r == "event" and s - 2 in judged for s, r in decided[1:]), decided
        assert len(decided) - 1 + res["skipped_windows"] == len(judged), (decided, res["skipped_windows"])
    assert len({res["skipped_windows"] for res in results}) == 1


def test_data_parallel_replicas_take_the_same_decisions(tmp_path: Path) -> None:
    # Two replicas of the whole model reading the same batches: their averaged gradients, norm sums and
    # decisions are the single process's, and frozen blocks join no gradient average.
    run = FreezeRun(config=FreezingConfig(check_every=2), placement="0-3", pipeline_size=1, steps=8)
    ref = run.reference()
    assert ref["history"]
    results = fit_case(run, tmp_path)
    for res in results:
        assert state_diff([res], ref) < TOL
    assert_equal_to_reference(results[:1], ref, ref["losses"])
    assert results[1]["history"] == ref["history"]


def test_fully_frozen_first_stage_trains_and_frozen_layers_migrate(tmp_path: Path) -> None:
    # Rank 0 holds the embeddings and layers 0-1, all frozen from step 2 on. At step 5 trainable layer 2
    # moves to rank 0, at step 8 frozen layer 1 (and layer 2) to rank 1.
    config = FreezingConfig(criterion="schedule", schedule=((2, 2),))
    run = FreezeRun(config=config, migrations=((5, "0-2|3-3"), (8, "0-0|1-3")), steps=11)
    ref = run.reference()
    results = fit_case(run, tmp_path)
    assert all(res["applied"] == ["0-2|3-3", "0-0|1-3"] for res in results)
    assert_equal_to_reference(results, ref, ref["losses"])
    rank0 = results[0]["snapshots"]
    for name in ("tok_emb.weight", "layers.0.attn.qkv.weight", "layers.1.mlp.fc_in.weight"):
        assert all(torch.equal(rank0[1][name], later[name]) for later in rank0[2:5]), name
    assert not torch.equal(
        results[1]["snapshots"][1]["head.weight"], results[1]["snapshots"][4]["head.weight"]
    )
    # Negative control: frozen layer 1 arrives on rank 1 trainable at step 8 and changes.
    lost = fit_case(replace(run, strategy_cls=TrainableOnArrival), tmp_path)
    assert state_diff(lost, ref) > 1e-4


def test_resume_on_another_placement_keeps_layers_frozen(tmp_path: Path) -> None:
    # Layer 0 freezes at step 1 (epoch 1), layer 1 at step 6 (epoch 2, after the resume at step 4).
    config = FreezingConfig(criterion="schedule", schedule=((1, 1), (6, 2)))
    whole = FreezeRun(config=config, steps=4, epochs=2)
    ref = whole.reference()
    ckpt = tmp_path / "epoch1.ckpt"
    fit_case(replace(whole, epochs=1), tmp_path, ckpt=ckpt)
    resumed = fit_case(replace(whole, placement="0-2|3-3"), tmp_path, ckpt=ckpt, resume=True)
    assert_equal_to_reference(resumed, ref, ref["losses"][4:])
    forgetful = replace(whole, placement="0-2|3-3", callback_cls=NoFlagsOnResume)
    lost = fit_case(forgetful, tmp_path, ckpt=ckpt, resume=True)
    assert state_diff(lost, ref) > 1e-4


def test_zero_bubble_v_schedule_trains_layers_behind_a_frozen_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ZBV on 2 ranks: stages 0 (layer 0, rank 0), 1 (layer 1, rank 1), 2 (layer 2, rank 1), 3 (layer 3,
    # rank 0). Layer 0 and the embeddings freeze at step 1: stage 1's input then needs no gradient.
    config = FreezingConfig(criterion="schedule", schedule=((1, 1),))
    run = FreezeRun(config=config, placement="0-0|1-1|2-2|3-3", schedule="ZBVZeroBubble", steps=4)
    ref = run.reference()
    results = fit_case(run, tmp_path)
    assert_equal_to_reference(results, ref, ref["losses"])
    # Negative control: without the guard, torch's split weight pass leaves layer 1 without gradients.
    monkeypatch.setattr(schedule_module, "guard_gradless_inputs", lambda stage: None)
    unguarded = fit_case(run, tmp_path)
    assert state_diff(unguarded, ref) > 1e-4
