"""``python -m lightning_dynmo.train`` end to end: a multirun sweep and a torchrun launch, tiny sizes.

Each test runs the application as a user does, in a fresh interpreter with ``tmp_path`` as the working
directory, and reads what the runs wrote. No timing is asserted.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dynmo.data import TextDataModule
from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.pipeline import export_full_checkpoint
from lightning_dynmo.train import _check_test_split

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: Seconds, and a small corpus; every other size comes from ``experiment=tiny``.
TINY = ["experiment=tiny", "trainer.max_steps=3", "data.corpus.max_bytes=32768"]
#: Lines a user must not see (warnings they cannot act on, Lightning's advertising).
NOISE = ("Tip:", "val_dataloader", "LeafSpec", "Warning", "GPU available")


def _run(argv: list[str], cwd: Path, timeout: float = 400) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    return out


def test_a_sweep_of_two_cases_writes_one_result_per_job(tmp_path: Path) -> None:
    out = _run(
        [
            "-m",
            "lightning_dynmo.train",
            "-m",
            "dynamism=early_exit,pruning",
            "balancer=diffusion_time",  # not the default; each job's summary must say it
            *TINY,
        ],
        cwd=tmp_path,
    )
    summaries = sorted(tmp_path.glob("multirun/*/*/*/summary.json"))
    assert len(summaries) == 2, out[-4000:]
    jobs = set()
    for path in summaries:
        summary = json.loads(path.read_text())
        jobs.add((summary["dynamism"], summary["balancer"]))
        assert summary["steps"] == 3
        assert summary["final_placement"] and summary["tokens_per_s"] > 0
        assert Path(summary["summary"]) == path
        # every job ran its own two ranks: each wrote its log into the job's directory
        assert {p.name for p in path.parent.glob("train_rank*.log")} == {"train_rank0.log", "train_rank1.log"}
        assert (path.parent / "csv" / "metrics.csv").exists()
    assert jobs == {("early_exit", "diffusion_time"), ("pruning", "diffusion_time")}
    # one table per job, printed once (by the launching process), and nothing a user cannot act on
    assert out.count("DynMo run summary") == 2
    assert out.count("rank 0: placement 0-1|2-3") == 2
    for noise in NOISE:
        assert noise not in out, noise


def test_torchrun_starts_the_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = _run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "lightning_dynmo.train",
            *TINY,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["dynamism"] == "freezing"
    assert out.count("DynMo run summary") == 1  # rank 0 prints it
    # Hydra's job logging is the app's configuration: the strategy adds no console handler of its own.
    assert out.count("rank 0: placement 0-1|2-3,") == 1
    assert {p.name for p in run_dir.glob("train_rank*.log")} == {"train_rank0.log", "train_rank1.log"}


def test_run_outputs_are_ignored_by_git() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "outputs/2026-01-01/00-00-00/summary.json", "multirun/x/0_a/summary.json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.stdout.split() == [
        "outputs/2026-01-01/00-00-00/summary.json",
        "multirun/x/0_a/summary.json",
    ]


def test_a_rank_that_fails_fails_the_run_naming_it(tmp_path: Path) -> None:
    # composes (a string is a valid balancer name for the schema), fails in the ranks' constructor
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dynmo.train", *TINY, "callbacks.dynmo.balancer=best"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "balancer" in out and "best" in out  # the rank's own error
    assert re.search(r"LaunchFailed: .*rank \d \(exit code 1\).* of the 2 ranks failed", out), out[-3000:]


#: A dense float64 GPT on a static split, epochs of 3 steps (a checkpoint at an epoch's end resumes exactly).
RESUMABLE = [
    "model=gpt_tiny",
    "dynamism=none",
    "balancer=static_uniform",
    "logger=csv",
    "data.seq_len=16",
    "data.batch_size=4",
    "data.corpus.max_bytes=32768",
    "trainer.precision=64-true",
    "trainer.limit_train_batches=3",
    "trainer.log_every_n_steps=1",
]


def _train_losses(run_dir: Path) -> dict[int, float]:
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    return {int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")}


def _final_weights(run_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    last = run_dir / "checkpoints" / "last.ckpt"
    exported = export_full_checkpoint(last, tmp_path / f"{run_dir.name}.ckpt")
    state: dict[str, torch.Tensor] = torch.load(exported, weights_only=True)["state_dict"]
    return state


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of 6 uninterrupted steps (2 epochs) of :data:`RESUMABLE`."""
    whole = tmp_path_factory.mktemp("uninterrupted") / "whole"
    _run(
        ["-m", "lightning_dynmo.train", *RESUMABLE, "trainer.max_steps=6", f"hydra.run.dir={whole}"],
        whole.parent,
    )
    return whole


def _assert_resumed_as_uninterrupted(resumed: Path, whole: Path, tmp_path: Path, out: str) -> None:
    expected, got = _train_losses(whole), _train_losses(resumed)
    assert sorted(expected) == list(range(6)) and sorted(got) == [3, 4, 5], out[-3000:]
    # float64 on the same split and batches: the resumed steps are the uninterrupted run's, bit for bit
    assert {step: expected[step] for step in got} == got
    weights, reference = _final_weights(resumed, tmp_path), _final_weights(whole, tmp_path)
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


def test_ckpt_path_last_starts_a_run_and_resumes_it_exactly_there(
    tmp_path: Path, uninterrupted: Path
) -> None:
    # what a requeue loop runs: one command, a fixed run directory, ckpt_path=last
    run_dir = tmp_path / "run"
    command = ["-m", "lightning_dynmo.train", *RESUMABLE, "ckpt_path=last", f"hydra.run.dir={run_dir}"]
    out = _run([*command, "trainer.max_steps=3"], tmp_path)
    assert 'ckpt_path="last") is set, but there is no last checkpoint available' in out  # starts fresh
    first, expected = _train_losses(run_dir), _train_losses(uninterrupted)
    assert sorted(first) == [0, 1, 2] and first == {step: expected[step] for step in first}
    last = run_dir / "checkpoints" / "last.ckpt"
    # a sharded checkpoint, saved in on_train_end (save_top_k=0: nothing at the epoch's end), which
    # DynMoStrategy resumes at epoch 1's first batch (lightning_dynmo/strategy/loop_state.py)
    assert last.is_dir()

    # The same command again, with more steps and a test run after fitting: it resumes its own run
    # directory. (A checkpoint path given explicitly resumes through the same Trainer.fit(ckpt_path=...),
    # which the distributed checkpoint tests run.)
    out = _run([*command, "trainer.max_steps=6", "run_test=true", "trainer.limit_test_batches=2"], tmp_path)
    assert f"Restored all states from the checkpoint at {last}" in out
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    assert any(r.get("test_loss") for r in rows), "run_test=true must log the test loss"
    _assert_resumed_as_uninterrupted(run_dir, uninterrupted, tmp_path, out)


def test_run_test_without_a_test_split_is_refused_before_training() -> None:
    _check_test_split(TextDataModule())  # the app's datamodule serves its held-out blocks
    with pytest.raises(ValueError, match=r"run_test=true, but the datamodule RandomTokenDataModule has no"):
        _check_test_split(RandomTokenDataModule())
