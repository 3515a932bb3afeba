"""``DynMoStrategy(data_parallel_sharding="fsdp")`` through ``Trainer.fit``: 2 stages x 2 shards train
exactly as one process through two migrations and a re-pack, hold half their stage each, and checkpoint
at one placement, load at another and export to one file.

Four forked gloo ranks (global rank = replica * 2 + position) fit a float64 ``DemoGPT`` (AdamW, an LR
schedule, gradient clipping) on Lightning's distributed sampler; the single-process ``Trainer.fit`` on the
union of the replicas' batches is the reference (:mod:`tests.distributed.fitting`). Under ``"1F1B"`` the
placement changes twice (blocks move forward, then back) and then re-packs onto one stage (ranks 1 and 3
are released); under ``"InterleavedZeroBubble"`` (two virtual stages per rank, weight gradients apart
from input gradients) it changes twice and then re-packs both virtual stages onto ranks 0 and 2. On every
rank, after every step, the parameters, gradients and AdamW state it holds are its half of its stage's
(bytes counted from the shards).

The 1F1B run saves a checkpoint after step 3 (placement ``0-3|4-5``); a second run at placement
``0-1|2-5`` (also 2 shards) loads it, the test process exports it to one file, and a third run (one stage
x 2 shards) loads that file: weights and optimizer state equal the reference's after step 3 every time.
The negative control drops the optimizer state of every unit that arrives by migration: the losses then
part from the reference's at the first step after it.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor

import lightning_dynmo.pipeline.sharding.stages as sharding_stages
from lightning_dynmo.pipeline import export_full_checkpoint
from lightning_dynmo.pipeline.sharding import local_bytes
from tests.distributed import fitting
from tests.distributed.fitting import Run, make_strategy
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

#: The tolerance of the comparisons: FSDP's reduce-scatter sums the replicas' gradients in another order
#: than one process's whole-batch mean (differences of ~1e-16 per step, compounding over the steps).
TOL = 1e-9
SAVE_AFTER = 3  # optimizer steps; saved at placement 0-3|4-5 (after the first migration)
LOADED_AT = "0-1|2-5"
RUN_1F1B = Run(
    world_size=4,
    pipeline_size=2,
    num_microbatches=2,
    num_layers=6,
    placement="0-2|3-5",
    migrations=((2, "0-3|4-5"), (4, "0-0|1-5"), (6, "0-5")),
    steps=8,
    clip=0.5,
    use_sampler=True,
)
RUN_ZB = replace(
    RUN_1F1B,
    schedule="InterleavedZeroBubble",
    placement="0-1|2-2|3-4|5-5",
    migrations=((2, "0-0|1-2|3-3|4-5"), (4, "0-1|2-3|4-4|5-5"), (6, "0-2|3-5")),
)


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def _optimizer_state(module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``<parameter>.<state key>`` -> the whole tensor, for this rank's parameters."""
    return {
        f"{name}.{key}": _full(value)
        for name, param in module.named_parameters()
        for key, value in optimizer.state.get(param, {}).items()
        if isinstance(value, torch.Tensor)
    }


class Recorder(pl.Callback):
    """Per step: the logged loss, and the bytes of parameters, gradients and optimizer state held here."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.held: list[dict[str, Any]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.losses.append(float(trainer.progress_bar_metrics["train_loss"]))
        params = list(pl_module.parameters())
        self.held.append(
            {
                "step": trainer.global_step,
                "placement": str(trainer.strategy.placement),  # type: ignore[attr-defined]
                "bytes": local_bytes([pl_module], trainer.optimizers),
                "stage_full": sum(p.numel() * p.element_size() for p in params),
                # Each parameter's shard: its rounded-up half of the rows (FSDP2 shards on dim 0).
                "bound": sum(
                    math.ceil(p.shape[0] / 2) * math.prod(p.shape[1:]) * p.element_size() for p in params
                ),
                "tensors": len(params),
                "all_sharded": all(isinstance(p, DTensor) for p in params),
            }
        )


class SaveAt(pl.Callback):
    def __init__(self, after_steps: int, path: str) -> None:
        self.after_steps, self.path = after_steps, path

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        if trainer.global_step == self.after_steps:
            trainer.save_checkpoint(self.path)


def _forget_arrived_optimizer_state() -> None:
    """The negative control: units arrive by migration without their optimizer state."""
    migrate = sharding_stages.migrate_sharded_units

    def spoiled(*args: Any, **kwargs: Any) -> Any:
        received = migrate(*args, **kwargs)
        for optimizer in args[2]:
            for unit in received.values():
                for param in unit.parameters():
                    optimizer.state.pop(param, None)
        return received

    sharding_stages.migrate_sharded_units = spoiled  # type: ignore[assignment]  # this forked rank only


def fit_worker(rank: int, world_size: int, run: Run, options: dict[str, Any]) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)  # LightningEnvironment: the processes exist already
    os.environ["NODE_RANK"] = "0"
    if options.get("spoil"):
        _forget_arrived_optimizer_state()
    recorder, mover = Recorder(), fitting.ForcePlacement(dict(run.migrations))
    callbacks: list[pl.Callback] = [recorder, mover]
    if "save" in options:
        callbacks.append(SaveAt(SAVE_AFTER, options["save"]))
    kwargs = run.trainer_kwargs()
    if "max_steps" in options:
        kwargs["max_steps"] = options["max_steps"]
    strategy = make_strategy(run, data_parallel_sharding="fsdp")
    trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=callbacks, **kwargs)
    model = run.model()
    trainer.fit(model, run.datamodule(), ckpt_path=options.get("load"))
    return {
        "losses": recorder.losses,
        "held": recorder.held,
        "released": strategy.is_released,
        "placement": str(strategy.placement),
        "state": {k: _full(v) for k, v in model.state_dict().items()},
        "optimizer": {} if strategy.is_released else _optimizer_state(model, trainer.optimizers[0]),
        "position": rank % 2,
    }


def _fit(run: Run, tmp_path: Path, **options: Any) -> list[dict[str, Any]]:
    return run_distributed(fit_worker, run.world_size, tmp_path, timeout_s=240, args=(run, options))


class Snapshot(pl.Callback):
    """The reference's weights and AdamW state after ``after_steps`` steps, and every step's grad norm."""

    def __init__(self, after_steps: int) -> None:
        self.after_steps = after_steps
        self.state: dict[str, torch.Tensor] = {}
        self.optimizer: dict[str, torch.Tensor] = {}
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        if trainer.global_step == self.after_steps:
            self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.optimizer = _optimizer_state(pl_module, trainer.optimizers[0])


def _reference(run: Run) -> dict[str, Any]:
    """Single-process Trainer.fit on the union of the replicas' batches (no migrations apply)."""
    run = replace(run, migrations=())
    recorder, snapshot = fitting.LossRecorder(), Snapshot(SAVE_AFTER)
    trainer = pl.Trainer(devices=1, callbacks=[recorder, snapshot], **run.trainer_kwargs())
    model = run.reference_model()
    trainer.fit(model, fitting._reference_batches(run))
    return {
        "losses": recorder.losses,
        "state": model.state_dict(),
        "saved_state": snapshot.state,
        "saved_optimizer": snapshot.optimizer,
        "norms": snapshot.norms,
    }


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _check_training(results: list[dict[str, Any]], ref: dict[str, Any], run: Run) -> None:
    active = [r for r in results if not r["released"]]
    for rank, res in enumerate(results):
        steps = len(res["losses"])
        worst = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"][:steps], strict=True))
        assert worst < TOL, f"rank {rank}: losses differ from the single process's by {worst:.3e}"
    assert all(len(r["losses"]) == run.steps for r in active)
    merged: dict[str, torch.Tensor] = {}
    for res in active:  # each rank's shards gathered whole; both replicas of a position agree
        for key, value in res["state"].items():
            if key in merged:
                torch.testing.assert_close(value, merged[key], rtol=0, atol=0)
            merged[key] = value
    assert _worst(merged, ref["state"]) < TOL
    assert all(r["placement"] == run.migrations[-1][1] for r in active)


def _check_bytes(results: list[dict[str, Any]], run: Run) -> None:
    """Each rank holds at most its rounded-up half of its stage's parameters; the two shards of a position
    add up to the stage; gradients as many bytes, AdamW's two moments twice that plus a scalar step each."""
    placements = {h["placement"] for r in results for h in r["held"]}
    assert placements == {run.placement, *(p for _, p in run.migrations)}, placements  # before and after
    for position in (0, 1):
        pair = [r["held"] for r in results if r["position"] == position]
        assert len(pair[0]) == len(pair[1])
        for a, b in zip(*pair, strict=True):
            assert a["stage_full"] == b["stage_full"] and a["placement"] == b["placement"]
            assert a["bytes"].parameters + b["bytes"].parameters == a["stage_full"], (position, a, b)
            for h in (a, b):
                got = h["bytes"]
                assert h["all_sharded"] and 0 < got.parameters <= h["bound"] < h["stage_full"], (position, h)
                assert got.gradients == got.parameters, (position, h)
                assert 0 < got.optimizer_state - 2 * got.parameters <= 8 * h["tensors"], (position, h)


@pytest.fixture(scope="module")
def reference_1f1b() -> dict[str, Any]:
    return _reference(RUN_1F1B)


def test_sharded_1f1b_fit_migrates_repacks_and_checkpoints_like_one_process(
    tmp_path: Path, reference_1f1b: dict[str, Any]
) -> None:
    ref = reference_1f1b
    assert min(ref["norms"]) < RUN_1F1B.clip < max(ref["norms"])  # clipping acts on some steps only
    directory = tmp_path / "sharded.ckpt"
    results = _fit(RUN_1F1B, tmp_path, save=str(directory))
    assert [r["released"] for r in results] == [False, True, False, True]
    _check_training(results, ref, RUN_1F1B)
    _check_bytes(results, RUN_1F1B)

    # Loaded at another placement (2 shards again): every rank's weights and AdamW state are the
    # reference's after SAVE_AFTER steps (max_steps stops the fit right after the restore).
    loading = replace(RUN_1F1B, placement=LOADED_AT, migrations=())
    loaded = _fit(loading, tmp_path, load=str(directory), max_steps=SAVE_AFTER)
    state: dict[str, torch.Tensor] = {}
    optimizer: dict[str, torch.Tensor] = {}
    for res in loaded:
        assert res["placement"] == LOADED_AT and not res["losses"]
        state.update(res["state"])
        optimizer.update(res["optimizer"])
    assert _worst(state, ref["saved_state"]) < TOL
    assert _worst(optimizer, ref["saved_optimizer"]) < TOL
    assert _worst(state, ref["state"]) > 1e3 * TOL  # the control: later weights are not what was loaded

    # Exported to one file: the single-process model's keys and its AdamW state by parameter name.
    exported = torch.load(export_full_checkpoint(directory, tmp_path / "one.ckpt"), weights_only=False)
    assert exported["global_step"] == SAVE_AFTER
    assert _worst(exported["state_dict"], ref["saved_state"]) < TOL
    saved = exported["optimizer_states"][0]["state"]
    flat = {f"{name}.{key}": value for name, values in saved.items() for key, value in values.items()}
    assert _worst(flat, ref["saved_optimizer"]) < TOL

    # The one file loads into a sharded run too (one stage x 2 shards): each rank cuts its own rows.
    one_stage = replace(RUN_1F1B, world_size=2, pipeline_size=1, placement="0-5", migrations=())
    for res in _fit(one_stage, tmp_path, load=str(tmp_path / "one.ckpt"), max_steps=SAVE_AFTER):
        assert _worst(res["state"], ref["saved_state"]) < TOL
        assert _worst(res["optimizer"], ref["saved_optimizer"]) < TOL


def test_sharded_zero_bubble_fit_migrates_like_one_process(
    tmp_path: Path, reference_1f1b: dict[str, Any]
) -> None:
    # The single process has no schedule, placement nor migrations: RUN_ZB's reference is RUN_1F1B's.
    assert replace(RUN_ZB, schedule="1F1B", placement="", migrations=()) == replace(
        RUN_1F1B, placement="", migrations=()
    )
    results = _fit(RUN_ZB, tmp_path)
    assert [r["released"] for r in results] == [False, True, False, True]
    _check_training(results, reference_1f1b, RUN_ZB)
    _check_bytes(results, RUN_ZB)


def test_negative_control_units_arriving_without_optimizer_state_fail_the_comparison(
    tmp_path: Path, reference_1f1b: dict[str, Any]
) -> None:
    results = _fit(RUN_1F1B, tmp_path, spoil=True, max_steps=4)
    losses, ref = results[0]["losses"], reference_1f1b["losses"]
    # Steps 0-2 are untouched (the first migration comes before step 2, whose loss precedes its update).
    assert max(abs(a - b) for a, b in zip(losses[:3], ref[:3], strict=True)) < TOL
    assert abs(losses[3] - ref[3]) > 1e3 * TOL, "spoiled optimizer state must show in the next loss"
