"""Re-pack and release: a pipeline shrinks onto fewer ranks mid-fit and the released ranks leave fit.

Each run forks real gloo ranks that call ``Trainer.fit`` under ``DynMoStrategy``; a test callback calls
``apply_placement`` with fewer stages at a given batch. The released ranks must finish ``fit`` (the worker
function returns normally: "exit 0" under the harness) while the others are still training, which the
active ranks check deterministically: before their last batch they wait (bounded) for the marker file
each released rank writes once its ``fit`` has returned. The active ranks' losses and final parameters
must equal the single-process reference run in float64, as if nothing had happened.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_dynmo.pipeline.placement.release import ReleaseEvent
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed import fitting
from tests.distributed.fitting import TOL, Run, local_state, make_strategy, max_param_diff, reference
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

_WAIT_FOR_RELEASED_S = 30.0


class ReleaseWatcher(pl.Callback):
    """Records ``on_dynmo_ranks_released``; before batch ``wait_at``, waits for the released ranks."""

    def __init__(self, marker_dir: Path, wait_at: int) -> None:
        self.marker_dir = marker_dir
        self.wait_at = wait_at
        self.events: list[ReleaseEvent] = []
        self.released_seen_done: list[int] = []

    def on_dynmo_ranks_released(self, trainer: pl.Trainer, pl_module: Any, event: ReleaseEvent) -> None:
        self.events.append(event)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != self.wait_at or not self.events or trainer.strategy.is_released:
            return  # a rank released at this very batch would wait for its own marker, written after fit
        deadline = time.monotonic() + _WAIT_FOR_RELEASED_S
        pending = set(self.events[-1].released_ranks)
        while pending and time.monotonic() < deadline:
            pending = {r for r in pending if not (self.marker_dir / f"released-{r}").exists()}
            time.sleep(0.01)
        self.released_seen_done = sorted(set(self.events[-1].released_ranks) - pending)


def repack_worker(rank: int, world_size: int, run: Run, marker_dir: Path) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    hook_events: list[ReleaseEvent] = []
    recorder, mover = fitting.LossRecorder(), fitting.ForcePlacement(dict(run.migrations))
    watcher = ReleaseWatcher(marker_dir, wait_at=run.steps - 1)
    strategy = make_strategy(run, on_release=hook_events.append)
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        use_distributed_sampler=run.use_sampler,
        callbacks=[recorder, mover, watcher],
        **run.trainer_kwargs(),
    )
    model = run.model()
    trainer.fit(model, run.datamodule())
    if strategy.is_released:
        (marker_dir / f"released-{rank}").touch()
    return {
        "losses": recorder.losses,
        "state": local_state(model),
        "released": strategy.is_released,
        "active_ranks": strategy.active_ranks,
        "stage_index": strategy.stage_index,
        "global_step": trainer.global_step,
        "hook_events": hook_events,
        "callback_events": watcher.events,
        "released_seen_done": watcher.released_seen_done,
        "num_params": sum(p.numel() for p in model.parameters()),
        "optimizer_state": sum(len(opt.state) for opt in trainer.optimizers),
        "placement": str(strategy.placement),
    }


def fit_with_repack(run: Run, tmp_path: Path) -> list[dict[str, Any]]:
    markers = tmp_path / "markers"
    markers.mkdir(exist_ok=True)
    return run_distributed(repack_worker, run.world_size, tmp_path, timeout_s=120, args=(run, markers))


def check_repack(results: list[dict[str, Any]], run: Run, released: tuple[int, ...], at: int) -> None:
    active = tuple(r for r in range(run.world_size) if r not in released)
    final = run.migrations[-1][1]
    for rank, res in enumerate(results):
        assert res["released"] == (rank in released), rank
        assert res["active_ranks"] == active
        expected = ReleaseEvent(released, active, run.placement, final, global_step=at)
        assert res["hook_events"] == [expected], f"rank {rank}: on_release got {res['hook_events']}"
        assert res["callback_events"] == [expected], f"rank {rank}: callback got {res['callback_events']}"
    ref = reference(run)
    for rank in released:
        res = results[rank]
        # Left fit at the re-pack batch: it trained `at` steps, then freed everything it held.
        assert res["global_step"] == at and len(res["losses"]) == at
        assert res["stage_index"] is None and res["num_params"] == 0 and res["optimizer_state"] == 0
    for rank in active:
        res = results[rank]
        assert res["released_seen_done"] == list(released), "released ranks did not leave fit before the end"
        assert res["global_step"] == run.steps and res["placement"] == final
        diff = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"], strict=True))
        assert diff < TOL, f"rank {rank}: losses differ from the reference by {diff:.3e}"
    worst = max_param_diff([results[r] for r in active], ref)
    assert worst < TOL, f"parameters differ from the reference by up to {worst:.3e}"


@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied-embedding"])
def test_four_stages_repacked_to_two_release_two_ranks(tmp_path: Path, tie_embeddings: bool) -> None:
    # Tied: the head moves from rank 3 to rank 1, which pairs up with rank 0 to keep the copies summed.
    run = Run(
        world_size=4,
        num_layers=8,
        placement="0-1|2-3|4-5|6-7",
        migrations=((3, "0-2|3-7"),),
        steps=8,
        clip=0.05,
        tie_embeddings=tie_embeddings,
    )
    results = fit_with_repack(run, tmp_path)
    check_repack(results, run, released=(2, 3), at=3)
    assert [results[r]["stage_index"] for r in (0, 1)] == [0, 1]


@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied-embedding"])
def test_data_parallel_replicas_repack_to_one_stage_each(tmp_path: Path, tie_embeddings: bool) -> None:
    # 2 replicas x 2 stages -> 2 replicas x 1 stage: ranks 0 and 2 stay, 1 and 3 are released, and the
    # data-parallel gradient average keeps running over the kept ranks 0 and 2. Tied: the head arrives
    # on the rank that holds the embedding and becomes the same parameter again.
    run = Run(
        world_size=4,
        pipeline_size=2,
        use_sampler=True,
        placement="0-1|2-3",
        migrations=((2, "0-3"),),
        steps=6,
        tie_embeddings=tie_embeddings,
    )
    results = fit_with_repack(run, tmp_path)
    check_repack(results, run, released=(1, 3), at=2)


def test_a_tied_head_rejoins_the_embedding_inside_an_accumulation_window(tmp_path: Path) -> None:
    # 2 stages -> 1 at batch 3, between the two micro-steps of an optimizer step: the head's copy arrives
    # on rank 0 holding half a window of gradient, which must join the embedding's.
    run = Run(
        num_layers=4,
        placement="0-1|2-3",
        migrations=((3, "0-3"),),
        accumulate=2,
        steps=4,
        tie_embeddings=True,
    )
    kept = fit_with_repack(run, tmp_path)[0]
    ref = reference(run)
    diff = max(abs(a - b) for a, b in zip(kept["losses"], ref["losses"], strict=True))
    assert len(kept["losses"]) == len(ref["losses"]) and diff < TOL, f"losses differ by {diff:.3e}"
    assert max_param_diff([kept], ref) < TOL


def test_repack_then_migrate_on_the_smaller_pipeline(tmp_path: Path) -> None:
    # 3 stages -> 2 (rank 2 released), then an ordinary migration inside the new 2-rank group.
    run = Run(
        world_size=3,
        num_layers=6,
        placement="0-1|2-3|4-5",
        migrations=((2, "0-2|3-5"), (4, "0-0|1-5")),
        steps=7,
    )
    results = fit_with_repack(run, tmp_path)
    ref = reference(run)
    assert [res["released"] for res in results] == [False, False, True]
    assert results[2]["global_step"] == 2
    for rank in (0, 1):
        assert results[rank]["placement"] == "0-0|1-5"
        diff = max(abs(a - b) for a, b in zip(results[rank]["losses"], ref["losses"], strict=True))
        assert diff < TOL
    assert max_param_diff(results[:2], ref) < TOL


def test_released_rank_refuses_further_placements(tmp_path: Path) -> None:
    run = Run(num_layers=4, placement="0-1|2-3", migrations=((1, "0-3"),), steps=3)
    results = run_distributed(released_then_apply_worker, 2, tmp_path, timeout_s=60, args=(run,))
    assert results[0] == "active"
    assert "which a re-pack released" in results[1]


def _fit_with_forced_placements(rank: int, world_size: int, run: Run) -> DynMoStrategy:
    """Fit ``run`` on this rank with its migrations forced; return the strategy for inspection."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    strategy = make_strategy(run)
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        callbacks=[fitting.ForcePlacement(dict(run.migrations))],
        **run.trainer_kwargs(),
    )
    trainer.fit(run.model(), run.datamodule())
    return strategy


def released_then_apply_worker(rank: int, world_size: int, run: Run) -> str:
    strategy = _fit_with_forced_placements(rank, world_size, run)
    if not strategy.is_released:
        return "active"
    with pytest.raises(RuntimeError, match="which a re-pack released") as info:
        strategy.apply_placement("0-3")
    return str(info.value)


def test_released_rank_collectives_are_local_no_ops(tmp_path: Path) -> None:
    run = Run(num_layers=4, placement="0-1|2-3", migrations=((1, "0-3"),), steps=3)
    results = run_distributed(collectives_worker, 2, tmp_path, timeout_s=60, args=(run,))
    assert results[1] == {"broadcast": "mine", "reduce": 5.0, "decision": True, "gather": (1,)}
    assert results[0]["broadcast"] == "mine"  # the active rank's broadcast runs over itself only


def collectives_worker(rank: int, world_size: int, run: Run) -> dict[str, Any]:
    strategy = _fit_with_forced_placements(rank, world_size, run)
    # None of these may wait for the other rank: rank 1 is released and rank 0 trains alone.
    strategy.barrier()
    return {
        "broadcast": strategy.broadcast("mine"),
        "reduce": float(strategy.reduce(torch.tensor(5.0), reduce_op="sum")),
        "decision": strategy.reduce_boolean_decision(True),
        "gather": tuple(strategy.all_gather(torch.tensor(1.0)).shape),
    }
