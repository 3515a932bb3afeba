"""The GPU kernel check's CPU dry run: every part runs on tiny shapes and the JSON names the command, the
device, the shape and each part's result with its bounds; the budget skips parts; a part's error is
recorded, not raised."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lightning_dynmo.gpu_check.kernels import cli, parts
from lightning_dynmo.gpu_check.kernels.curves import read_cost_curves
from lightning_dynmo.gpu_check.kernels.timing import DRY_RUN_SHAPE, PAPER_SHAPE, Timer


def test_the_paper_shape_is_the_issues() -> None:
    assert (PAPER_SHAPE.d_model, PAPER_SHAPE.num_heads, PAPER_SHAPE.seq_len) == (1024, 32, 2048)
    assert (PAPER_SHAPE.micro_batch, PAPER_SHAPE.dtype, PAPER_SHAPE.vocab_size) == (2, "bfloat16", 50257)
    assert PAPER_SHAPE.tile % 16 == 0 and PAPER_SHAPE.seq_len % PAPER_SHAPE.tile == 0


def test_the_dry_run_runs_every_part_and_writes_one_json(tmp_path: Path) -> None:
    path = cli.main(["--dry-run", "--out", str(tmp_path)])
    report = json.loads(path.read_text())
    assert report["label"] == "real compute" and report["shape"] == DRY_RUN_SHAPE.to_dict()
    assert report["command"].startswith("python -m lightning_dynmo.gpu_check.kernels --dry-run")
    assert "torch" in report["device"] and report["device"]["cuda_available"] in (True, False)
    results = {name: part["result"] for name, part in report["parts"].items() if part["ok"]}
    assert set(results) == {name for name, _, _ in cli.PARTS}, report["parts"]
    attention = results["attention"]
    assert attention["auto_kernel"] == "gather" and attention["errors_vs_float32_reference"]["within"]
    assert set(attention["attention"]) == {"dense_sdpa", "gather"}
    assert set(attention["must_show"]) == {"attention_ratio_at_most_0.5", "block_cheaper"}
    pruning = results["pruning"]
    assert "semi_structured@0.5" in pruning["failed"], "no 2:4 kernel on a CPU: recorded, not hidden"
    assert {"bsr@0.5", "bsr@0.9", "csr@0.9"} <= set(pruning["ratio_to_dense"])
    stalls = results["stalls"]
    for name in ("mod/bucket=64", "mod/bucket=None", "early_exit/bucket=64", "early_exit/bucket=None"):
        steps = stalls[name]["steps"]
        assert steps and {"wall_ms", "processed_tokens", "mlp_rows", "allocator"} <= set(steps[0])
        bucket = 64 if name.endswith("=64") else None
        for step in steps:  # the MLP's rows are the real count, or it rounded up to the bucket
            for layer, count in step["processed_tokens"].items():
                want = count if bucket is None or count == 0 else min(-(-count // bucket) * bucket, 128)
                assert step["mlp_rows"][layer] == ([want] if count else []), (name, step)
    assert set(results["moe"]["router_scale=20.0"]["timed"]) == {"padded", "grouped"}
    curves = results["cost_curves"]
    for name in ("sparse_attention", "mod", "early_exit", "early_exit_padded_vocab", "dense_and_freezing"):
        assert len(curves[name]["points"]) == 2 and not curves[name]["failed"], name
    # The exit heads: as wide as the vocabulary (64 in the dry run), and padded as the head is.
    assert (curves["early_exit"]["vocab_size"], curves["early_exit_padded_vocab"]["vocab_size"]) == (64, 128)
    head = curves["head_loss_and_embedding"]
    assert set(head["timed"]) == {
        "head_and_loss",
        "embedding",
        "head_matmul",
        "head_and_loss_padded_vocab",
        "head_matmul_padded_vocab",
    }
    assert head["padded_vocab_size"] == 128  # the dry run's vocabulary of 64, rounded up to 128
    read = read_cost_curves(path)
    assert set(read) == {
        "sparse_attention",
        "mod",
        "early_exit",
        "early_exit_padded_vocab",
        "dense_and_freezing",
    }
    assert read["mod"].statistic == "processed_fraction" and len(read["mod"].points) == 2


def _report(points: list[dict[str, float]], ok: bool = True) -> dict[str, Any]:
    curve = {"statistic": "active_fraction", "points": points, "failed": {}}
    part = {"ok": True, "result": {"early_exit": curve}} if ok else {"ok": None, "skipped": "out of budget"}
    return {"device": {"devices": [{"name": "NVIDIA H200"}]}, "parts": {"cost_curves": part}}


def test_a_cost_curve_interpolates_between_measured_points_and_never_beyond(tmp_path: Path) -> None:
    path = tmp_path / "kernels.json"
    points = [{"active_fraction": 1.0, "median_ms": 10.0}, {"active_fraction": 0.25, "median_ms": 4.0}]
    path.write_text(json.dumps(_report(points)))
    curve = read_cost_curves(path)["early_exit"]
    assert curve.device == "NVIDIA H200" and curve.points == ((0.25, 4.0), (1.0, 10.0))
    assert curve.ms_at(0.25) == 4.0 and curve.ms_at(1.0) == 10.0
    assert curve.ms_at(0.5) == pytest.approx(6.0, abs=1e-12)
    with pytest.raises(ValueError, match=r"active_fraction was measured on \[0.25, 1.0\] only"):
        curve.ms_at(0.1)
    path.write_text(json.dumps(_report(points, ok=False)))
    with pytest.raises(ValueError, match=r"has no measured cost curves \(cost_curves part: out of budget\)"):
        read_cost_curves(path)


def test_the_budget_skips_parts_and_a_failing_part_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(shape: Any, timer: Timer, device: str) -> dict[str, Any]:
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(cli, "PARTS", (("broken", broken, 0.0), ("late", parts.moe, 1e9)))
    report = cli.run_kernels("cpu", 10.0, "test")
    assert report["parts"]["broken"]["ok"] is False
    assert report["parts"]["broken"]["error"] == "RuntimeError: no such kernel"
    assert report["parts"]["late"]["skipped"].endswith("left of the 10 s budget")


def test_the_prepared_gpu_session_dry_runs_and_records_the_padded_exit_heads(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(root / "benchmarks/gpu_session.sh"), "--dry-run"], cwd=root, env=env, timeout=300
    )
    assert done.returncode == 0
    assert "cost_curves rc=0" in (tmp_path / "env.txt").read_text()
    curves = read_cost_curves(tmp_path / "cost_curves.json")
    assert {"early_exit", "early_exit_padded_vocab"} <= set(curves)
