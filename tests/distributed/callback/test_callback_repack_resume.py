"""DynMoCallback with the strategy's phase-2 features: re-pack and release, resume from a checkpoint file.

- Re-pack: every block becomes free at a known step (the work shrinks);
  ``repack=RepackConfig(target_num_stages=1)`` moves everything onto rank 0 and releases rank 1 mid-fit.
  Rank 1 leaves ``fit`` early; rank 0 trains on and its losses and whole model equal the single-process
  reference.
- Resume: a run rebalances after a pruning event and saves a checkpoint at the epoch's end; a fresh run
  with a fresh callback resumes from the file, starts on the default uniform placement, and the callback
  puts back the saved placement and history; the second epoch equals the uninterrupted reference.
- Resume onto another pipeline (one device, a V schedule, more devices): the saved placement does not
  fit it, so the run keeps its own initial placement (never re-packing or releasing a rank at start-up)
  and rebalances after profiling its first steps; the second epoch still equals the reference.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_dynmo.callback import DynMoCallback, ProfilingConfig, RepackConfig
from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.events import notify_dynamism
from tests.distributed.fitting import TOL, LossRecorder, local_state, make_strategy, reference
from tests.distributed.harness import run_distributed
from tests.distributed.test_checkpoint import EpochRun

pytestmark = pytest.mark.distributed

CHANGE_AT, SLEEP_MS = 2, 5.0


class MakeFree(pl.Callback):
    """At batch ``CHANGE_AT`` of every epoch, the listed blocks stop costing anything (and say so)."""

    def __init__(self, blocks: range) -> None:
        self.blocks = blocks

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != CHANGE_AT:
            return
        changed = [i for i in trainer.strategy.local_layers if i in self.blocks]
        for i in changed:
            trainer.strategy.local_layers[i].cost.fwd_ms = 0.0
            trainer.strategy.local_layers[i].cost.bwd_ms = 0.0
        if changed:
            notify_dynamism("pruned", layers=changed, step=trainer.global_step, detail="emulated")


class PlacementAtStart(pl.Callback):
    """Records the placement once every callback's ``on_train_start`` has run."""

    placement: str | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.placement = str(trainer.strategy.placement)


def worker(
    rank: int,
    world_size: int,
    run: EpochRun,
    free: range,
    dynmo_kwargs: dict[str, Any],
    ckpt: Path | None,
    resume: bool,
) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    recorder, dynmo, probe = LossRecorder(), DynMoCallback(**dynmo_kwargs), PlacementAtStart()
    trainer = pl.Trainer(
        devices=world_size,
        strategy=make_strategy(run),
        use_distributed_sampler=False,
        callbacks=[recorder, MakeFree(free), dynmo, probe],
        **run.trainer_kwargs(),
    )
    model = DemoGPT(num_layers=run.num_layers, lr_gamma=run.lr_gamma, sleep_ms=[SLEEP_MS] * run.num_layers)
    trainer.fit(model, run.datamodule(), ckpt_path=ckpt if resume else None)
    if ckpt is not None and not resume:
        trainer.save_checkpoint(ckpt)
    return {
        "losses": recorder.losses,
        "state": local_state(model),
        "released": trainer.strategy.is_released,
        "placement": str(trainer.strategy.placement),
        "placement_at_start": probe.placement,
        "callback": dynmo.state_dict(),
    }


def test_callback_repacks_onto_one_rank_and_releases_the_other(tmp_path: Path) -> None:
    run = EpochRun(num_layers=8, steps=12, epochs=1)
    # Once the blocks are free only real compute is left, and one rank doing it all is slower than two:
    # freeing a rank costs step time, accepted here through max_slowdown (the gate is on by default).
    kwargs = {
        "repack": RepackConfig(target_num_stages=1, max_slowdown=4.0),
        "profiling": ProfilingConfig(steps=2),
        "memory_capacity_bytes": 2**40,
    }
    args = (run, range(8), kwargs, None, False)
    rank0, rank1 = run_distributed(worker, 2, tmp_path, timeout_s=150, args=args)
    assert not rank0["released"] and rank1["released"]
    assert rank0["placement"] == "0-7"
    [repack] = rank0["callback"]["rebalances"]
    assert (repack["old"], repack["new"], repack["applied"]) == ("0-3|4-7", "0-7", True)
    # The released rank left fit at the re-pack; the survivor trained every step.
    assert len(rank1["losses"]) == repack["step"] < run.steps == len(rank0["losses"])
    ref = reference(replace(run, epochs=1))
    diff = max(abs(a - b) for a, b in zip(rank0["losses"], ref["losses"], strict=True))
    assert diff < TOL, f"losses differ from the reference by {diff:.3e}"
    assert set(rank0["state"]) == set(ref["state"])  # rank 0 now holds the whole model
    worst = max((rank0["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
    assert worst < TOL


def test_callback_repacks_a_v_schedule_onto_a_pipeline_it_can_run(tmp_path: Path) -> None:
    # ZBV runs 2 stages per rank in a V: from 4 stages on 2 ranks the planner may only propose 2 stages
    # (rank 0 alone), never 1 or 3. By parameter count one rank holding everything is 2x slower, accepted
    # through max_slowdown.
    run = EpochRun(schedule="ZBVZeroBubble", num_layers=8, steps=8, epochs=1)
    kwargs = {
        "repack": RepackConfig(max_slowdown=10.0),
        "cost": "params",
        "every_n_steps": 2,
        "profiling": ProfilingConfig(steps=1),
        "memory_capacity_bytes": 2**40,
    }
    rank0, rank1 = run_distributed(
        worker, 2, tmp_path, timeout_s=150, args=(run, range(0), kwargs, None, False)
    )
    assert not rank0["released"] and rank1["released"]
    repack = next(r for r in rank0["callback"]["rebalances"] if r["applied"])
    assert repack["old"] == "0-1|2-3|4-5|6-7" and repack["new"].count("|") == 1  # 2 stages, both on rank 0
    assert rank0["placement"] == repack["new"]
    ref = reference(replace(run, epochs=1))
    diff = max(abs(a - b) for a, b in zip(rank0["losses"], ref["losses"], strict=True))
    assert len(rank0["losses"]) == run.steps and diff < TOL, f"losses differ from the reference by {diff:.3e}"
    worst = max((rank0["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
    assert worst < TOL


def test_resume_from_a_checkpoint_restores_the_callbacks_placement_and_history(tmp_path: Path) -> None:
    run = EpochRun(num_layers=8, steps=12, epochs=1)
    ckpt = tmp_path / "epoch1.ckpt"
    kwargs = {"balancer": "partition", "cost": "time", "profiling": ProfilingConfig(steps=2)}
    first = run_distributed(worker, 2, tmp_path, timeout_s=150, args=(run, range(4), kwargs, ckpt, False))
    saved = first[0]["callback"]
    assert saved["placement"] == "0-5|6-7" and [e["kind"] for e in saved["events"]] == ["pruned"]
    # A fresh process, a fresh callback; the events of epoch 2 are not acted on, so only the restore moves.
    resumed = run_distributed(
        worker,
        2,
        tmp_path,
        timeout_s=150,
        args=(replace(run, epochs=2), range(4), {"on_events": False}, ckpt, True),
    )
    ref = reference(replace(run, epochs=2))
    for r in resumed:
        assert r["placement_at_start"] == "0-5|6-7"  # put back before the first step
        history = r["callback"]
        assert history["events"][0] == saved["events"][0] and history["rebalances"] == saved["rebalances"]
        assert len(r["losses"]) == run.steps
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"][run.steps :], strict=True))
        assert diff < TOL, f"resumed losses differ from the uninterrupted run by {diff:.3e}"


SAVE_RUN = EpochRun(num_layers=8, steps=4, epochs=1)
RESUME_KWARGS: dict[str, Any] = {"profiling": ProfilingConfig(steps=1), "on_events": False}


@pytest.fixture(scope="module")
def two_stage_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Epoch 1 on 2 ranks (1F1B, "0-3|4-7") with DynMoCallback, saved at the epoch's end."""
    tmp = tmp_path_factory.mktemp("two_stage")
    ckpt = tmp / "epoch1.ckpt"
    run_distributed(worker, 2, tmp, timeout_s=150, args=(SAVE_RUN, range(0), RESUME_KWARGS, ckpt, False))
    return ckpt


def _resume(run: EpochRun, ckpt: Path, tmp_path: Path) -> list[dict[str, Any]]:
    args = (replace(run, epochs=2), range(0), RESUME_KWARGS, ckpt, True)
    resumed = run_distributed(worker, run.world_size, tmp_path, timeout_s=150, args=args)
    ref = reference(replace(run, epochs=2))
    released = [rank for rank, r in enumerate(resumed) if r["released"]]
    assert not released, f"a resumed run must never release ranks at start-up (released: {released})"
    for r in resumed:
        assert len(r["losses"]) == run.steps
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"][run.steps :], strict=True))
        assert diff < TOL, f"resumed losses differ from the uninterrupted run by {diff:.3e}"
        reasons = [(rb["step"], rb["reason"]) for rb in r["callback"]["rebalances"]]
        # The window opens at the first step (1 warm-up + 1 profiled step), the decision applies after it.
        assert reasons == [(run.steps + 2, "resume")], "the new pipeline is profiled and rebalanced at once"
    return resumed


@pytest.mark.parametrize(
    ("world_size", "schedule", "start"),
    [(1, "1F1B", "0-7"), (2, "ZBVZeroBubble", "0-1|2-3|4-5|6-7")],
    ids=["one-device", "v-schedule"],
)
def test_resume_onto_another_pipeline_keeps_it_and_rebalances_it(
    world_size: int, schedule: str, start: str, two_stage_checkpoint: Path, tmp_path: Path
) -> None:
    run = replace(SAVE_RUN, world_size=world_size, schedule=schedule)
    for r in _resume(run, two_stage_checkpoint, tmp_path):
        assert r["placement_at_start"] == start  # not the checkpoint's "0-3|4-7"
        assert r["callback"]["layout"]["schedule"] == schedule


def test_a_one_stage_checkpoint_resumed_on_two_devices_keeps_both(tmp_path: Path) -> None:
    ckpt = tmp_path / "one_stage.ckpt"
    one = replace(SAVE_RUN, world_size=1)
    run_distributed(worker, 1, tmp_path, timeout_s=150, args=(one, range(0), RESUME_KWARGS, ckpt, False))
    resumed = _resume(SAVE_RUN, ckpt, tmp_path)
    assert [r["placement_at_start"] for r in resumed] == ["0-3|4-7"] * 2
