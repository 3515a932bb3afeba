"""DynMoCallback balances what a real model and cluster cost: a heavy head, a slow worker, a slow link.

Costs are emulated (``EmulatedCost`` sleeps, using no CPU), so the expected placements are known. 8
blocks sleep 5 ms forward / 10 ms backward per micro-batch (4 micro-batches, 2 ranks, 1F1B):

- heavy head: the head sleeps 12.5 / 25 ms (2.5 blocks). Blocks alone balance at ``0-3|4-7``; with the
  head on the last stage the optimum is ``0-4|5-7`` (5 | 3 + 2.5 blocks).
- slow worker: rank 1 is an emulated worker 3 times slower (its blocks sleep 3x, and so does the
  reference workload the callback times there). The heaviest stage is lightest at ``0-5|6-7`` (6 | 2 x 3
  blocks), but the step is shortest at ``0-6|7-7``: under 1F1B the last stage's forward and backward of
  the first and last micro-batches sit on the critical path, so the fast rank should carry more. The
  schedule's simulated step (a block 5 + 10 ms per micro-batch): 430 ms (rank 0 busy 4 x 105 ms, idle
  10 ms waiting for the first gradient) against 450 ms ((4 + 1) x 90 ms) for ``0-5|6-7``; 485 against
  495 ms when one block's measured cost drifts by a block.
- slow link: rank 0's sends to rank 1 wait 60 ms each (one per micro-batch: 240 ms a step, 4 blocks of
  sleep on the sender). The sender must be relieved: ``0-1|2-7`` (2 + 4 | 6 blocks) or ``0-2|3-7``. Which
  of the two is not asserted: with the measured blocks (about 17.5 ms a micro-batch, hooks and compute
  beside the sleep) the link is 3.4 blocks, and the schedule's step model ranks them within 0.4% of each
  other (0.522 against 0.526 s with no cost per action), so the window's noise decides. That model also
  predicts ``0-3|4-7`` at 0.56 s where it measures 0.745 s (moving to ``0-1|2-7`` measures +23-25%,
  predicted +2.5-3% once the cost per action absorbs the gap): a miss the step-model issue (#19) tracks.

Each scenario's expected placement stays optimal when the measured costs drift by a block (under load a
block's real compute grows next to its sleep), and the bounds on measured times are as loose.

Training through the resulting migrations equals the single-process reference (float64).
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dynmo.balancing import BalanceProblem, partition
from lightning_dynmo.balancing.policy import decide
from lightning_dynmo.balancing.step_prediction import predict_step
from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.callback import dynmo_callback as callback_module
from lightning_dynmo.demos import DemoGPT, EmulatedCost
from lightning_dynmo.demos.hardware import emulate_slow_link, emulated_speed_probe, set_emulated_slowdown
from lightning_dynmo.profiling import module_has_hooks
from tests.distributed.fitting import TOL, LossRecorder, Run, local_state, make_strategy
from tests.distributed.harness import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUN = Run(num_layers=8, steps=8)
SLEEP_MS = 5.0
CALLBACK = {
    "balancer": "partition",
    "cost": "time",
    "every_n_steps": 2,
    "profiling": ProfilingConfig(steps=2),
    "on_events": False,
}


class HeavyHeadGPT(DemoGPT):
    """DemoGPT whose head sleeps ``head_ms`` forward (twice that backward) after its projection."""

    def __init__(self, head_ms: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head = nn.Sequential(self.head, EmulatedCost(head_ms))


def _model(head_ms: float) -> DemoGPT:
    kwargs = {"num_layers": RUN.num_layers, "lr_gamma": RUN.lr_gamma, "sleep_ms": [SLEEP_MS] * RUN.num_layers}
    return HeavyHeadGPT(head_ms, **kwargs) if head_ms else DemoGPT(**kwargs)


def fit_worker(rank: int, world_size: int, scenario: str, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    if scenario == "slow_worker" and rank == 1:
        set_emulated_slowdown(3.0)
    if scenario == "slow_link" and rank == 0:
        emulate_slow_link(to_rank=1, s_per_byte=0.0, latency_s=0.060)
    recorder, dynmo = LossRecorder(), DynMoCallback(**callback_kwargs)
    decisions: list[dict[str, Any]] = []

    def spied_decide(problem: Any, current: Any, config: Any, m: int, order: Any, **kw: Any) -> Any:
        decision = decide(problem, current, config, m, order, **kw)
        # What the prediction must equal: the schedule's step with the measured cost per action.
        workers = kw.get("stage_workers")
        per_op = problem.hardware.per_op_s
        step = predict_step(problem, current, order, m, workers, per_op).step_s
        bare = predict_step(problem, current, order, m, workers, 0.0).step_s
        decisions.append({"per_op_s": per_op, "predicted": decision.predicted_step_before})
        decisions[-1].update(expected=step, bare=bare)
        return decision

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(callback_module, "decide", spied_decide)
    trainer = pl.Trainer(
        devices=world_size,
        strategy=make_strategy(RUN),
        use_distributed_sampler=False,
        callbacks=[recorder, dynmo],
        **RUN.trainer_kwargs(),
    )
    model = _model(12.5 if scenario == "heavy_head" else 0.0)
    trainer.fit(model, RUN.datamodule())
    hardware = dynmo.last_hardware
    return {
        "losses": recorder.losses,
        "state": local_state(model),
        "placement": str(trainer.strategy.placement),
        "rebalances": [r.to_dict() for r in dynmo.rebalances],
        "costs": dynmo.last_costs,
        "hardware": hardware,
        "hooks_left": any(module_has_hooks(m) for m in [model, *trainer.strategy.local_layers.values()]),
        "update_hooks_left": bool(trainer.optimizers[0]._optimizer_step_post_hooks),
        "decisions": decisions,
        "recorded_per_op_s": [r.per_op_s for r in dynmo.rebalances],
    }


def _single_process_reference(scenario: str) -> dict[str, Any]:
    recorder = LossRecorder()
    trainer = pl.Trainer(devices=1, callbacks=[recorder], **RUN.trainer_kwargs())
    model = _model(12.5 if scenario == "heavy_head" else 0.0)
    trainer.fit(model, RUN.datamodule().train_dataloader())
    return {"losses": recorder.losses, "state": model.state_dict()}


def _assert_equals_reference(results: list[dict[str, Any]], scenario: str) -> None:
    ref = _single_process_reference(scenario)
    for r in results:
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        assert diff < TOL, f"losses differ from the reference by {diff:.3e}"
    merged = {**results[0]["state"], **results[1]["state"]}
    worst = max((merged[k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    assert worst < TOL


def _run(tmp_path: Any, scenario: str, **extra: Any) -> list[dict[str, Any]]:
    kwargs = {**CALLBACK, **extra}
    return run_distributed(fit_worker, 2, tmp_path, timeout_s=180, args=(scenario, kwargs))


def test_the_head_and_loss_are_profiled_and_balanced_with_the_blocks(tmp_path: Any) -> None:
    results = _run(tmp_path, "heavy_head", profiling=ProfilingConfig(steps=2, measure_comm=False))
    first = results[0]
    costs, hardware = first["costs"], first["hardware"]
    assert all(r["costs"] == costs and r["hardware"] == hardware for r in results)
    block = sum(c.time_s for c in costs) / len(costs)
    head = hardware.last_stage_extra
    assert head is not None and hardware.first_stage_extra is not None
    # 2.5 blocks of sleep plus the real projection and loss; 0-4|5-7 stays optimal for 1 to 3 blocks.
    assert 1.8 * block < head.time_s < 3.5 * block
    assert head.memory_bytes > 0 and hardware.first_stage_extra.memory_bytes > 0
    # The optimizer update, timed in the window and shared by entries with a gradient, reaches every rank.
    assert all(c.update_time_s > 0 for c in costs)
    assert head.update_time_s > 0 and hardware.first_stage_extra.update_time_s > 0
    assert not any(r["update_hooks_left"] for r in results)  # the step post-hook went with the window
    assert str(partition(BalanceProblem(costs), 2)) == "0-3|4-7"  # what a block-only balancer keeps
    for r in results:
        assert r["placement"] == "0-4|5-7"
        assert r["rebalances"][0]["applied"] and r["rebalances"][0]["new"] == "0-4|5-7"
        assert not r["hooks_left"]
    # The decisions predict with the runtime's measured cost per action (the schedule, launching an
    # op, its hooks), and each record says which; without it (the negative control) they would differ.
    decided = first["decisions"]  # rank 0 decides
    assert decided and not results[1]["decisions"]
    assert first["recorded_per_op_s"] == [d["per_op_s"] for d in decided][: len(first["recorded_per_op_s"])]
    for d in decided:
        assert d["per_op_s"] > 0
        assert d["predicted"] == pytest.approx(d["expected"], rel=1e-12)
        assert d["predicted"] != pytest.approx(d["bare"], rel=1e-6)
    _assert_equals_reference(results, "heavy_head")


def test_a_slow_worker_is_measured_and_given_fewer_blocks(tmp_path: Any) -> None:
    profiling = ProfilingConfig(
        steps=2, measure_comm=False, measure_speed=True, speed_probe=emulated_speed_probe
    )
    results = _run(tmp_path, "slow_worker", profiling=profiling)
    hardware = results[0]["hardware"]
    assert hardware.worker_slowdown == pytest.approx([1.0, 3.0], rel=0.15)
    # On the reference worker every block costs the same wherever it ran; unscaled, a block timed on the
    # slow rank would cost 3 times one timed on the fast rank (both ran blocks in the window). Under a
    # busy CPU one block's real compute grew by 35% beside its sleep, so the bound is 2x, not 1.3x.
    block_s = [c.time_s for c in results[0]["costs"]]
    assert max(block_s) < 2.0 * min(block_s), block_s
    for r in results:
        assert r["placement"] == "0-6|7-7"  # the schedule's step, not the heaviest stage (docstring)


def test_a_slow_link_is_measured_and_its_sender_relieved(tmp_path: Any) -> None:
    results = _run(tmp_path, "slow_link")
    hardware = results[0]["hardware"]
    send_s = hardware.comm_time_s[0][3]  # link 0, the boundary block's output
    assert 0.055 < send_s < 0.090
    for r in results:
        # The sender gives up blocks (see the module docstring for why 0-1|2-7 and 0-2|3-7 both count).
        assert r["placement"] in ("0-1|2-7", "0-2|3-7"), (hardware, r["rebalances"])
        assert r["rebalances"][0]["old"] == "0-3|4-7" and r["rebalances"][0]["applied"]


def test_speed_probe_is_a_positive_time_on_this_rank() -> None:
    from lightning_dynmo.profiling.speed import time_reference_workload

    assert time_reference_workload("cpu", torch.float64, width=16, repeats=2) > 0
    with pytest.raises(ValueError, match=r"repeats=0, warmup=1: need repeats >= 1"):
        time_reference_workload("cpu", repeats=0)
