"""Trainer(strategy="dynmo", devices=2) started the ways users start it, each matching the reference.

The distributed suite runs Trainer.fit inside forked workers on an existing process group; these tests
cover the launch paths users take, where the strategy initialises the process group itself:

- ``lightning``: ``python script.py``; Lightning's subprocess launcher re-runs the script for rank 1.
- ``torchrun``: ``torchrun --standalone --nproc-per-node 2 script.py``; Lightning's
  ``TorchElasticEnvironment`` reads the ranks torchrun sets.
- ``slurm``: two processes started with the variables ``srun`` sets for a 2-task job step; Lightning's
  ``SLURMEnvironment`` reads them (no cluster needed, only what srun would export).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from subprocess import PIPE

import pytest
import torch

from tests.distributed.fitting import TOL, Run, reference

pytestmark = pytest.mark.distributed

_SCRIPT = textwrap.dedent(
    """
    import sys

    import lightning.pytorch as pl
    import torch

    import lightning_dynmo.strategy.dynmo_strategy  # registers "dynmo"
    from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
    from tests.distributed.fitting import LossRecorder, Run

    torch.set_num_threads(1)
    run = Run()
    recorder = LossRecorder()
    trainer = pl.Trainer(
        devices=2, strategy="dynmo", use_distributed_sampler=False, callbacks=[recorder],
        **run.trainer_kwargs(),
    )
    model = run.model()
    trainer.fit(model, RandomTokenDataModule(batch_size=run.batch_size, num_samples=run.num_samples))
    env = type(trainer.strategy.cluster_environment).__name__
    result = {"losses": recorder.losses, "state": model.state_dict(), "env": env}
    torch.save(result, f"{sys.argv[1]}/rank{trainer.global_rank}.pt")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env(root: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for var in list(env):
        if var.startswith(("SLURM_", "TORCHELASTIC_")) or var in {
            "LOCAL_RANK",
            "RANK",
            "NODE_RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
        }:
            del env[var]
    return env


def _launch(launcher: str, script: Path, out: Path, root: Path) -> list[subprocess.CompletedProcess[str]]:
    env = _clean_env(root)
    common = {"cwd": root, "capture_output": True, "text": True, "timeout": 180}
    if launcher == "lightning":
        return [subprocess.run([sys.executable, str(script), str(out)], env=env, **common)]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        return [subprocess.run([*cmd, str(script), str(out)], env=env, **common)]
    # slurm: what `srun --ntasks 2` exports to each task of a one-node job step.
    port = str(_free_port())
    procs = []
    for rank in range(2):
        slurm = {
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "dynmo-test",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        cmd = [sys.executable, str(script), str(out)]
        procs.append(
            subprocess.Popen(cmd, env={**env, **slurm}, cwd=root, stdout=PIPE, stderr=PIPE, text=True)
        )
    done = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


@pytest.mark.parametrize("launcher", ["lightning", "torchrun", "slurm"])
def test_launchers_run_the_pipeline(launcher: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    for proc in _launch(launcher, script, tmp_path, root):
        assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    expected_env = {"lightning": "LightningEnvironment", "torchrun": "TorchElasticEnvironment"}
    assert {r["env"] for r in ranks} == {expected_env.get(launcher, "SLURMEnvironment")}
    ref = reference(Run())
    for res in ranks:
        assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"], strict=True)) < TOL
    merged = {**ranks[0]["state"], **ranks[1]["state"]}
    assert set(merged) == set(ref["state"])
    assert max((merged[k] - ref["state"][k]).abs().max().item() for k in merged) < TOL
