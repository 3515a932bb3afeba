"""Pipelined validation and test equal the single-process model's, and do not perturb training.

Each run forks real gloo ranks that call ``Trainer.fit`` (and ``validate`` / ``test``) with
``DynMoStrategy``; the reference is the same seeded :class:`DemoGPT` in one process, whose own
``validation_step`` / ``test_step`` compute the loss of the whole model. Everything runs in float64.
The validation set has 20 samples in batches of 6: batches of 6, 6, 6 and 2, so evaluation sees a
shape change and batch sizes that ``num_microbatches=4`` does not divide (it then uses 3 and 2
micro-batches).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dynmo.demos import DemoGPT, RandomTokenDataset
from lightning_dynmo.pipeline.step.evaluation import global_mean_loss
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed import fitting
from tests.distributed.fitting import TOL, Run, local_state, make_strategy, max_param_diff, reference
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed


@dataclass(frozen=True)
class EvalRun:
    """A training run plus its validation / test settings, shared by the pipelined run and its reference."""

    train: Run = field(default_factory=lambda: Run(steps=8))
    val_samples: int = 20
    val_batch_size: int = 6
    val_check_interval: int | None = 4
    sanity_steps: int = 2
    early_stopping: bool = False
    checkpoint: bool = False
    hook_model: bool = False
    # After fit: Trainer.validate and Trainer.test on the same trainer.
    validate_after: bool = False

    def val_loader(self, seed: int = 1) -> DataLoader[Tensor]:
        data = RandomTokenDataset(self.val_samples, seed=seed)
        return DataLoader(data, batch_size=self.val_batch_size, shuffle=False, drop_last=False)

    def model(self) -> DemoGPT:
        cls = HookedGPT if self.hook_model else DemoGPT
        return cls(num_layers=self.train.num_layers, lr_gamma=self.train.lr_gamma)

    def trainer_kwargs(self) -> dict[str, Any]:
        kwargs = self.train.trainer_kwargs()
        kwargs["num_sanity_val_steps"] = self.sanity_steps
        kwargs["val_check_interval"] = self.val_check_interval  # None: no val loader is given to fit
        kwargs["enable_checkpointing"] = self.checkpoint
        return kwargs


class HookedGPT(DemoGPT):
    """DemoGPT whose pipelined training steps log a perplexity through ``on_pipeline_step_end``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook_calls: list[tuple[int, float, int]] = []

    def on_pipeline_step_end(self, loss: Tensor, batch: Tensor, batch_idx: int) -> None:
        self.hook_calls.append((batch_idx, loss.item(), batch.shape[0]))
        self.log("train_ppl", loss.exp(), prog_bar=True)


class EvalRecorder(pl.Callback):
    """Records every evaluation batch's output and every evaluation epoch's logged loss."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, bool, int, float]] = []
        self.epochs: list[tuple[str, bool, int, float]] = []
        self.ppl: list[float] = []

    def _batch(self, trainer: pl.Trainer, phase: str, outputs: Any) -> None:
        self.batches.append((phase, trainer.sanity_checking, trainer.global_step, float(outputs)))

    def _epoch(self, trainer: pl.Trainer, phase: str) -> None:
        value = trainer.callback_metrics.get(f"{phase}_loss")
        if value is not None:
            self.epochs.append((phase, trainer.sanity_checking, trainer.global_step, float(value)))

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self._batch(trainer, "val", outputs)

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self._batch(trainer, "test", outputs)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._epoch(trainer, "val")

    def on_test_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._epoch(trainer, "test")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if "train_ppl" in trainer.progress_bar_metrics:
            self.ppl.append(trainer.progress_bar_metrics["train_ppl"])


def _callbacks(run: EvalRun, ckpt_dir: str) -> list[pl.Callback]:
    mover = fitting.ForcePlacement(dict(run.train.migrations))
    callbacks: list[pl.Callback] = [fitting.LossRecorder(), EvalRecorder(), mover]
    if run.early_stopping:
        # min_delta larger than any improvement: the second validation stops training.
        callbacks.append(EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0))
    if run.checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=1))
    return callbacks


def _execute(trainer: pl.Trainer, model: DemoGPT, run: EvalRun, train_batches: Any) -> dict[str, Any]:
    val = run.val_loader() if run.val_check_interval else None
    trainer.fit(model, train_dataloaders=train_batches, val_dataloaders=val)
    out: dict[str, Any] = {}
    if run.validate_after:
        out["validate"] = trainer.validate(model, dataloaders=run.val_loader(), verbose=False)
        out["test"] = trainer.test(model, dataloaders=run.val_loader(seed=2), verbose=False)
        if isinstance(trainer.strategy, DynMoStrategy):
            predictions = trainer.predict(model, dataloaders=run.val_loader())
        else:  # one device: the whole model on the inputs pipeline_batch gives, as the strategy predicts
            with torch.no_grad():
                predictions = [model(model.pipeline_batch(b)[0]) for b in run.val_loader()]
        out["predictions"] = [p.detach().clone() for p in predictions or []]
    recorder = next(c for c in trainer.callbacks if isinstance(c, fitting.LossRecorder))
    evals = next(c for c in trainer.callbacks if isinstance(c, EvalRecorder))
    out.update(
        losses=recorder.losses,
        batches=evals.batches,
        epochs=evals.epochs,
        ppl=evals.ppl,
        global_step=trainer.global_step,
        state=local_state(model),
        hook_calls=getattr(model, "hook_calls", []),
    )
    ckpt = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    if ckpt is not None and ckpt.best_model_score is not None:
        out["best_score"] = float(ckpt.best_model_score)
    return out


def eval_worker(rank: int, world_size: int, run: EvalRun, ckpt_dir: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    trainer = pl.Trainer(
        devices=world_size,
        strategy=make_strategy(run.train),
        use_distributed_sampler=False,
        callbacks=_callbacks(run, ckpt_dir),
        **run.trainer_kwargs(),
    )
    out = _execute(trainer, run.model(), run, run.train.datamodule().train_dataloader())
    strategy = trainer.strategy
    assert isinstance(strategy, DynMoStrategy)
    evaluator = strategy._pipeline.evaluator
    out["eval_builds"] = evaluator.num_builds if evaluator is not None else 0
    return out


def fit_pipelined(run: EvalRun, tmp_path: Any) -> list[dict[str, Any]]:
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir(exist_ok=True)
    return run_distributed(
        eval_worker, run.train.world_size, tmp_path, timeout_s=120, args=(run, str(ckpt_dir))
    )


@functools.cache
def eval_reference(run: EvalRun) -> dict[str, Any]:
    """Single-process fit (+ validate/test) of the same model on the same batches."""
    run = replace(run, train=replace(run.train, migrations=()))
    ckpt_dir = tempfile.mkdtemp(prefix="dynmo-eval-ref-")  # the cached reference outlives tmp_path
    try:
        trainer = pl.Trainer(devices=1, callbacks=_callbacks(run, ckpt_dir), **run.trainer_kwargs())
        return _execute(trainer, run.model(), run, run.train.datamodule().train_dataloader())
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def _assert_close_records(name: str, got: list[Any], want: list[Any]) -> None:
    assert [r[:3] for r in got] == [r[:3] for r in want], f"{name}: different evaluation points"
    diff = max((abs(a[3] - b[3]) for a, b in zip(got, want, strict=True)), default=0.0)
    assert diff < TOL, f"{name}: differs from the single-process reference by {diff:.3e}"


def assert_evaluation_matches(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for rank, res in enumerate(results):
        _assert_close_records(f"rank {rank} batch losses", res["batches"], ref["batches"])
        _assert_close_records(f"rank {rank} logged epoch losses", res["epochs"], ref["epochs"])


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "ZBVZeroBubble"])
def test_validation_during_fit_matches_single_process(schedule: str, tmp_path: Any) -> None:
    run = EvalRun(train=Run(schedule=schedule, steps=8))
    results = fit_pipelined(run, tmp_path)
    ref = eval_reference(run)
    # Sanity check (2 batches) + validation after steps 4 and 8 (4 batches each).
    assert [(s, g) for _, s, g, _ in ref["batches"]] == [(True, 0)] * 2 + [(False, 4)] * 4 + [(False, 8)] * 4
    assert len(ref["epochs"]) >= 2
    assert_evaluation_matches(results, ref)
    # Validation does not perturb training: the run equals the training-only reference.
    train_ref = reference(run.train)
    for rank, res in enumerate(results):
        diff = max(abs(a - b) for a, b in zip(res["losses"], train_ref["losses"], strict=True))
        assert diff < TOL, f"rank {rank}: training losses moved by {diff:.3e} with validation on"
    assert max_param_diff(results, train_ref) < TOL
    # Batches of 6, 6, 6, 2: a new evaluation pipeline for the shape changes 6 -> 2 -> 6, not per batch.
    assert all(res["eval_builds"] == 4 for res in results), [res["eval_builds"] for res in results]


@pytest.mark.parametrize("schedule", ["1F1B", "InterleavedZeroBubble"])
def test_validation_after_migrations_and_inside_an_accumulation_window(schedule: str, tmp_path: Any) -> None:
    # Validation after batches 2, 5 and 8 (val_check_interval=3) falls inside accumulation windows of
    # two batches; placements change before batches 3 and 6, so the last two validations run on new
    # stages (and new evaluation pipelines).
    stages = 2 if schedule == "1F1B" else 4
    if stages == 2:
        start, moves = "0-2|3-5", ((3, "0-3|4-5"), (6, "0-0|1-5"))
    else:
        start, moves = "0-1|2-2|3-3|4-5", ((3, "0-0|1-3|4-4|5-5"), (6, "0-2|3-3|4-4|5-5"))
    train = Run(schedule=schedule, num_layers=6, placement=start, migrations=moves, accumulate=2, steps=5)
    run = EvalRun(train=train, val_check_interval=3, val_batch_size=10)
    results = fit_pipelined(run, tmp_path)
    ref = eval_reference(run)
    assert len({g for _, sanity, g, _ in ref["batches"] if not sanity}) == 3
    assert_evaluation_matches(results, ref)
    train_ref = reference(train)
    for rank, res in enumerate(results):
        diff = max(abs(a - b) for a, b in zip(res["losses"], train_ref["losses"], strict=True))
        assert diff < TOL, f"rank {rank}: training losses moved by {diff:.3e} with validation on"
    assert max_param_diff(results, train_ref) < TOL
    # One pipeline per placement (batches of 10, 10: no shape change).
    assert all(res["eval_builds"] == 3 for res in results), [res["eval_builds"] for res in results]


def test_validate_test_and_predict_after_fit_match(tmp_path: Any) -> None:
    run = EvalRun(train=Run(steps=4), val_check_interval=None, sanity_steps=0, validate_after=True)
    results = fit_pipelined(run, tmp_path)
    ref = eval_reference(run)
    assert [r[0] for r in ref["epochs"]] == ["val", "test"]
    assert_evaluation_matches(results, ref)
    for rank, res in enumerate(results):
        for phase, key in (("validate", "val_loss"), ("test", "test_loss")):
            got, want = res[phase][0][key], ref[phase][0][key]
            assert abs(got - want) < TOL, f"rank {rank}: Trainer.{phase} returned {got}, expected {want}"
        assert len(res["predictions"]) == len(ref["predictions"]) > 0
        for got, want in zip(res["predictions"], ref["predictions"], strict=True):
            assert (got - want).abs().max().item() < TOL, f"rank {rank}: Trainer.predict differs"


def test_early_stopping_and_checkpoint_monitor_agree_on_every_rank(tmp_path: Any) -> None:
    # EarlyStopping reduces its decision over the ranks; it stops after the second validation (step 4),
    # at the same step on every rank as in the single-process run; ModelCheckpoint ranks by val_loss.
    run = EvalRun(train=Run(steps=8), val_check_interval=2, early_stopping=True, checkpoint=True)
    results = fit_pipelined(run, tmp_path)
    ref = eval_reference(run)
    assert ref["global_step"] == 4 < run.train.steps, (
        "early stopping must bite for this test to mean anything"
    )
    assert [res["global_step"] for res in results] == [ref["global_step"]] * run.train.world_size
    assert_evaluation_matches(results, ref)
    scores = [res["best_score"] for res in results]
    assert max(abs(s - ref["best_score"]) for s in scores) < TOL, (scores, ref["best_score"])


def test_on_pipeline_step_end_logs_from_every_rank(tmp_path: Any) -> None:
    run = EvalRun(train=Run(steps=5, accumulate=2), val_check_interval=None, sanity_steps=0, hook_model=True)
    results = fit_pipelined(run, tmp_path)
    train_ref = reference(run.train)
    for rank, res in enumerate(results):
        assert [idx for idx, _, _ in res["hook_calls"]] == list(range(10)), (
            f"rank {rank}: {res['hook_calls']}"
        )
        assert all(size == run.train.batch_size for _, _, size in res["hook_calls"])
        hook_losses = [loss for _, loss, _ in res["hook_calls"]]
        assert max(abs(a - b) for a, b in zip(hook_losses, train_ref["losses"], strict=True)) < TOL
        ppl = [math.exp(x) for x in train_ref["losses"]]
        assert max(abs(a - b) for a, b in zip(res["ppl"], ppl, strict=True)) < TOL, f"rank {rank}"


def _no_last_stage_worker(rank: int, world_size: int) -> str:
    with pytest.raises(RuntimeError, match="no last pipeline stage contributed") as err:
        global_mean_loss([], 8, group=None, device=torch.device("cpu"), dtype=torch.float64)
    return str(err.value)


def _mean_worker(rank: int, world_size: int) -> tuple[float, int]:
    # Rank 0 plays a replica's last stage with 6 samples, rank 1 another one with 2 samples.
    losses = [torch.tensor([1.0, 3.0][rank], dtype=torch.float64)]
    loss, total = global_mean_loss(
        losses, [6, 2][rank], group=None, device=torch.device("cpu"), dtype=torch.float64
    )
    return loss.item(), total


def test_global_mean_loss_weighs_samples_and_rejects_a_missing_last_stage(tmp_path: Any) -> None:
    assert run_distributed(_mean_worker, 2, tmp_path, timeout_s=30) == [(1.5, 8), (1.5, 8)]
    run_distributed(_no_last_stage_worker, 1, tmp_path, timeout_s=30)
