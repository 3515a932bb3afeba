"""The GPU check: its plan per machine, its timeout, and its CPU dry run with the report's fields."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dynmo.gpu_check.plan import (
    CASES,
    DRY_RUN_SIZES,
    GPU_SIZES,
    STALL_CASES,
    STALL_STEPS,
    cost_steps,
    parts,
)
from lightning_dynmo.gpu_check.runner import run_part
from lightning_dynmo.gpu_check.stalls import ALLOCATOR_COUNTERS, step_stalls


def _by_name(device: str, num_devices: int) -> dict[str, object]:
    return {p.name: p for p in parts(device, num_devices)}


def test_one_gpu_skips_the_two_process_training_and_migrates_over_gloo() -> None:
    plan = _by_name("cuda", 1)
    assert plan["train_2proc_bf16-mixed"].skipped and "needs two" in plan["train_2proc_bf16-mixed"].skipped
    assert plan["migration"].options == {"backend": "gloo"}
    assert plan["nccl_probe"].skipped is None
    assert {f"costs_{case}" for case in CASES} <= set(plan)
    assert {f"stalls_{case}" for case in STALL_CASES} <= set(plan)


def test_two_gpus_run_everything_on_nccl_but_the_probe() -> None:
    plan = _by_name("cuda", 2)
    assert plan["train_2proc_16-mixed"].skipped is None
    assert plan["migration"].options == {"backend": "nccl"}
    assert plan["nccl_probe"].skipped is not None


def test_the_gpu_sizes_are_realistic() -> None:
    assert GPU_SIZES.d_model >= 1024 and GPU_SIZES.seq_len >= 1024 and GPU_SIZES.batch_size == 8


@pytest.mark.parametrize("name", ["migration", "costs_moe"])  # a fresh interpreter; a forked child
def test_a_part_past_its_timeout_is_killed_and_recorded(tmp_path: Path, name: str) -> None:
    part = _by_name("cpu", 0)[name]
    result = run_part(part, DRY_RUN_SIZES, "cpu", tmp_path, timeout_s=0.5)
    assert result["ok"] is False
    assert result["error"] == "timed out after 0 s (killed)"
    assert result["wall_s"] < 30


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_dry_run_passes_and_records_every_field(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lightning_dynmo.gpu_check", "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=850, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "dry-run (cpu, gloo)"
    assert {"torch", "cuda", "devices", "lightning", "git_commit", "git_tree_differs"} <= set(
        report["hardware"]
    )
    assert report["sizes"]["d_model"] == DRY_RUN_SIZES.d_model
    results = report["parts"]
    assert results.pop("nccl_probe")["ok"] is None  # asked on a one-GPU machine only
    failed = {name: r.get("error") for name, r in results.items() if r["ok"] is not True}
    assert not failed
    assert report["passed"] == len(results)
    for name, result in results.items():
        if name.startswith(("train", "costs")):
            steps = cost_steps(DRY_RUN_SIZES) if name.startswith("costs") else DRY_RUN_SIZES.steps
            assert result["losses_finite"] and result["steps"] == steps, name
            marks = result["clock_marks"]
            assert marks["perf_counter"] > 0 and "cuda_event" not in marks, name
            assert result["memory_capacity_bytes"] is None, name  # no cap on CPU
    for case in CASES:
        costs = results[f"costs_{case}"]["layer_costs"]
        assert len(costs) == DRY_RUN_SIZES.num_layers
        assert all(c["fwd_time_s"] > 0 and c["bwd_time_s"] >= 0 and c["num_params"] > 0 for c in costs), case
        windows = results[f"costs_{case}"]["cost_windows"]
        assert len(windows) == DRY_RUN_SIZES.cost_windows, case  # each window recorded, unsmoothed
        assert all(len(w["layer_ms"]) == DRY_RUN_SIZES.num_layers for w in windows), case
        assert windows[-1]["layer_ms"] == [
            round(1e3 * (c["fwd_time_s"] + c["bwd_time_s"]), 3) for c in costs
        ], case
    for case in STALL_CASES:
        stalls = results[f"stalls_{case}"]
        assert [r["step"] for r in stalls["steps"]] == list(range(STALL_STEPS)), case
        assert stalls["max_wall_ms"] >= stalls["median_wall_ms"] > 0, case
    assert results["train_2proc_bf16-mixed"]["devices"] == 2
    moved = results["train_2proc_16-mixed"]["migration"]
    assert moved["before"] == "0-1|2-3" and moved["after"] == "0-2|3-3" and moved["bytes_received"] > 0
    migration = results["migration"]
    # 2 units x 6 parameters x (value, grad, AdamW's step, exp_avg, exp_avg_sq)
    assert migration["bit_identical"] and migration["tensors_compared"] == 2 * 6 * 5
    assert (tmp_path / "train_1proc_bf16-mixed.log").exists()


def test_the_stall_part_records_every_step_and_block_and_the_allocator() -> None:
    result = step_stalls({"case": "mod", "steps": 3}, DRY_RUN_SIZES, "cpu")
    assert result["case"] == "mod" and len(result["steps"]) == 3
    for row in result["steps"]:
        assert row["wall_ms"] > 0 and set(row["allocator"]) == set(ALLOCATOR_COUNTERS)
        assert all(v == 0 for v in row["allocator"].values())  # no CUDA allocator on CPU
        forward, slowest = row["block_fwd_ms"], row["block_slowest_call_ms"]
        assert len(forward) == DRY_RUN_SIZES.num_layers
        # every block ran once per micro-batch: the sum of its calls is at least its slowest one
        assert all(total >= worst > 0 for total, worst in zip(forward, slowest, strict=True))


@pytest.mark.parametrize(
    ("message", "answer"),
    [
        (
            "NCCL error ... invalid usage\nLast error:\n"
            "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60",
            "refused",
        ),
        ("NCCL error ... unhandled system error", None),
    ],
)
def test_the_nccl_probe_reports_a_refusal_and_fails_on_any_other_error(
    monkeypatch: pytest.MonkeyPatch, message: str, answer: str | None
) -> None:
    import torch.distributed as dist

    from lightning_dynmo.gpu_check import migration

    def refuse(backend: str, device: object = None) -> object:
        raise dist.DistBackendError(message)

    monkeypatch.setattr(migration, "_two_processes", refuse)
    monkeypatch.setattr(migration, "rank", lambda: 0)
    if answer is None:
        with pytest.raises(dist.DistBackendError, match="unhandled"):
            migration.nccl_probe({}, DRY_RUN_SIZES, "cuda")
        return
    result = migration.nccl_probe({}, DRY_RUN_SIZES, "cuda")
    assert result == {
        "two_ranks_on_one_device": "refused",
        "nccl_says": "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60",
    }
