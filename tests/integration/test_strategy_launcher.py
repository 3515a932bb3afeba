"""Trainer(strategy="dynmo", devices=2) launched by Lightning itself (``python script.py``).

The distributed suite runs Trainer.fit inside forked workers on an existing process group; this test
covers the path users take: Lightning's subprocess launcher re-runs the script for rank 1 and the
strategy initialises the process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed.test_strategy_equivalence import TOL, Run, reference

pytestmark = pytest.mark.distributed

_SCRIPT = textwrap.dedent(
    """
    import sys

    import lightning.pytorch as pl
    import torch

    import lightning_dynmo.strategy  # registers "dynmo"
    from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
    from tests.distributed.test_strategy_equivalence import LossRecorder, Run

    torch.set_num_threads(1)
    run = Run()
    recorder = LossRecorder()
    trainer = pl.Trainer(
        devices=2, strategy="dynmo", use_distributed_sampler=False, callbacks=[recorder],
        **run.trainer_kwargs(),
    )
    model = run.model()
    trainer.fit(model, RandomTokenDataModule(batch_size=run.batch_size, num_samples=run.num_samples))
    result = {"losses": recorder.losses, "state": model.state_dict()}
    torch.save(result, f"{sys.argv[1]}/rank{trainer.global_rank}.pt")
    """
)


def test_lightning_launcher_runs_the_pipeline(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref = reference(Run())
    for res in ranks:
        assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"], strict=True)) < TOL
    merged = {**ranks[0]["state"], **ranks[1]["state"]}
    assert set(merged) == set(ref["state"])
    assert max((merged[k] - ref["state"][k]).abs().max().item() for k in merged) < TOL
