"""The application's pure pieces: who launched us, how many ranks, the run summary and its table."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_dynmo.app.launch import (
    check_multi_node,
    external_launcher,
    local_processes,
    rank_of_this_process,
    run_id,
)
from lightning_dynmo.app.report import RunReport, build_summary, format_summary


def test_external_launcher_tells_torchrun_slurm_and_scripts_apart() -> None:
    assert external_launcher({}) is None
    assert external_launcher({"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"}) == "torchrun"
    assert external_launcher({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_NAME": "job"}) == "slurm"
    # an interactive allocation (salloc; bash) is not a launcher: the application starts its ranks
    assert external_launcher({"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_NAME": "bash"}) is None
    assert external_launcher({"LOCAL_RANK": "1"}) == "script"


def test_rank_and_run_id_follow_the_launcher() -> None:
    assert rank_of_this_process({}) == 0
    assert rank_of_this_process({"RANK": "3", "LOCAL_RANK": "1"}) == 3
    assert rank_of_this_process({"SLURM_PROCID": "2"}) == 2
    torchrun = {"TORCHELASTIC_RUN_ID": "abc", "LOCAL_RANK": "0"}
    assert run_id("2026/x", torchrun) == "torchrun-abc"
    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"}
    assert run_id("2026/x", slurm) == "slurm-77-1"
    assert run_id("2026/x", {}) == "2026/x"


@pytest.mark.parametrize(
    ("trainer", "cuda", "expected"),
    [
        ({"accelerator": "cpu", "devices": 2}, 0, 2),
        ({"accelerator": "cpu", "devices": "2"}, 0, 2),
        ({"accelerator": "cpu", "devices": -1}, 0, 1),
        ({"accelerator": "gpu", "devices": -1}, 4, 4),
        ({"accelerator": "gpu", "devices": "auto"}, 8, 8),
        ({"accelerator": "gpu", "devices": [0, 2]}, 4, 2),
    ],
)
def test_local_processes(trainer: dict[str, Any], cuda: int, expected: int) -> None:
    assert local_processes(trainer, cuda_devices=cuda) == expected


def test_local_processes_rejects_a_bad_device_count() -> None:
    with pytest.raises(ValueError, match=r"trainer\.devices=0 must be a number of devices"):
        local_processes({"accelerator": "cpu", "devices": 0}, cuda_devices=0)
    with pytest.raises(ValueError, match=r"trainer\.devices='many'"):
        local_processes({"accelerator": "cpu", "devices": "many"}, cuda_devices=0)


def test_run_report_rejects_a_bad_window() -> None:
    with pytest.raises(ValueError, match=r"RunReport\(window_steps=0\) must be an integer >= 1"):
        RunReport(window_steps=0)


def _steps(placements: list[str], seconds: list[float]) -> list[dict[str, Any]]:
    return [
        {"step": i, "placement": p, "tokens": 1000, "step_s": s}
        for i, (p, s) in enumerate(zip(placements, seconds, strict=True))
    ]


def test_the_summary_compares_the_steps_around_the_first_rebalance() -> None:
    # steps 0-5 at 0-3|4-7 (1 s each, the first 2 s), steps 6-11 at 0-1|2-7 (0.5 s, the first 3 s)
    steps = _steps(["0-3|4-7"] * 6 + ["0-1|2-7"] * 6, [2.0] + [1.0] * 5 + [3.0] + [0.5] * 5)
    rebalance = {
        "step": 6,
        "applied": True,
        "reason": "event",
        "old": "0-3|4-7",
        "new": "0-1|2-7",
        "predicted_gain": 0.4,
        "measured_gain": 0.5,
        "migration_s": 0.01,
    }
    kept = {"step": 3, "applied": False}
    summary = build_summary(
        steps,
        [kept, rebalance],
        released=[],
        window_steps=3,
        final_placement="0-1|2-7",
        fit_s=20.0,
        paths={"logs": ["/r/csv"], "checkpoints": "/r/last.ckpt", "summary": "/r/summary.json"},
        info={"dynamism": "early_exit"},
    )
    assert summary["initial_placement"] == "0-3|4-7" and summary["final_placement"] == "0-1|2-7"
    assert [(p["first_step"], p["last_step"]) for p in summary["placements"]] == [(0, 5), (6, 11)]
    assert [p["median_step_s"] for p in summary["placements"]] == [1.0, 0.5]  # first step left out
    assert summary["rebalances"] == [{k: v for k, v in rebalance.items() if k != "applied"}]
    assert summary["decisions_kept"] == 1
    versus = summary["static_vs_dynmo"]
    # steps 3-5 (1000 tokens/s) against 7-9 (2000 tokens/s); step 6, the first on the new placement, is out
    assert (versus["static_tokens_per_s"], versus["dynmo_tokens_per_s"], versus["speedup"]) == (1000, 2000, 2)
    assert versus["within_noise"] is False  # every step after is faster than every step before
    table = format_summary(summary)
    assert "0-3|4-7 -> 0-1|2-7" in table and "+40.0%" in table and "+50.0%" in table
    assert "2.00x" in table and "/r/last.ckpt" in table and "dynamism=early_exit" in table
    assert "(the 3 steps before step 6 vs the 3 after)" in table


@pytest.mark.parametrize(
    ("after", "window", "why"),
    [
        ([0.5, 1.2, 0.5, 0.5, 0.5], 3, "a step after as slow as the slowest before: the windows overlap"),
        ([0.5] * 5, 2, "two steps a side are too few to judge"),
    ],
)
def test_a_gain_the_windows_cannot_tell_from_noise_is_marked(
    after: list[float], window: int, why: str
) -> None:
    steps = _steps(
        ["0-3|4-7"] * 6 + ["0-1|2-7"] * 6, [2.0] + [1.0] * 5 + [3.0] + after + [0.5] * (5 - len(after))
    )
    summary = build_summary(
        steps,
        [{"step": 6, "applied": True, "reason": "event", "old": "0-3|4-7", "new": "0-1|2-7"}],
        released=[],
        window_steps=window,
        final_placement="0-1|2-7",
        fit_s=20.0,
        paths={},
        info={},
    )
    assert summary["static_vs_dynmo"]["within_noise"] is True, why
    assert "after; within noise)" in format_summary(summary)


def test_without_a_rebalance_there_is_no_comparison() -> None:
    summary = build_summary(
        _steps(["0-1|2-3"] * 3, [1.0] * 3),
        [{"step": 1, "applied": False}],
        released=[],
        window_steps=5,
        final_placement="0-1|2-3",
        fit_s=3.0,
        paths={},
        info={},
    )
    assert summary["static_vs_dynmo"] is None and summary["rebalances"] == []
    assert "no rebalance: DynMo kept 0-1|2-3 (1 decisions)" in format_summary(summary)


def test_a_multi_node_job_needs_a_launcher() -> None:
    with pytest.raises(ValueError, match=r"trainer\.num_nodes=2 needs its ranks started on every node"):
        check_multi_node(2, {})
    check_multi_node(2, {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"})  # torchrun started it
    check_multi_node(1, {})
