"""A job whose rank is killed mid-training restarts by itself under torchrun and ends where it would have.

``torchrun --max-restarts 1`` runs a 2-rank DynMo job that rewrites ``last.ckpt`` at every epoch's end and
resumes from it when it exists (what a restarted job, or a requeued SLURM job, does). On the first attempt
rank 1 SIGKILLs itself in the middle of epoch 2; torchrun stops rank 0 and starts both again, which resume
from the checkpoint of epoch 1 and recompute epoch 2. The final parameters must equal the single-process
uninterrupted run's (float64, 1e-9). Negative control: without ``--max-restarts`` the killed job fails.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.distributed.fitting import TOL, reference
from tests.distributed.test_checkpoint import EpochRun
from tests.integration.test_strategy_launcher import _clean_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUN = EpochRun(num_layers=4, steps=2, epochs=3)

_SCRIPT = textwrap.dedent(
    """
    import os
    import signal
    import sys
    from pathlib import Path

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_dynmo.strategy  # registers "dynmo"
    from tests.integration.test_elastic_restart import RUN

    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


    class KillRankOneOnce(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if attempt == 0 and trainer.global_rank == 1 and trainer.current_epoch == 1 and batch_idx == 1:
                os.kill(os.getpid(), signal.SIGKILL)


    last = out / "checkpoints" / "last.ckpt"
    checkpoint = ModelCheckpoint(dirpath=last.parent, filename="last", enable_version_counter=False)
    trainer = pl.Trainer(
        devices=2,
        strategy="dynmo",
        use_distributed_sampler=False,
        callbacks=[KillRankOneOnce(), checkpoint],
        **{**RUN.trainer_kwargs(), "enable_checkpointing": True},
    )
    model = RUN.model()
    trainer.fit(model, RUN.datamodule(), ckpt_path=last if last.exists() else None)
    torch.save({"state": model.state_dict(), "attempt": attempt}, out / f"rank{trainer.global_rank}.pt")
    """
)


def _torchrun(tmp_path: Path, max_restarts: int) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", str(max_restarts), str(script), str(tmp_path)]
    return subprocess.run(cmd, env=_clean_env(root), cwd=root, capture_output=True, text=True, timeout=300)


def test_a_killed_rank_restarts_under_torchrun_and_ends_with_the_uninterrupted_parameters(
    tmp_path: Path,
) -> None:
    proc = _torchrun(tmp_path, max_restarts=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["attempt"] for r in ranks] == [1, 1], "the job must have been restarted once"
    ref = reference(replace(RUN, checkpoint_callback=False))
    merged = {**ranks[0]["state"], **ranks[1]["state"]}
    assert set(merged) == set(ref["state"])
    worst = max((merged[k] - ref["state"][k]).abs().max().item() for k in merged)
    assert worst < TOL, f"final parameters differ from the uninterrupted run by {worst:.3e}"


def test_without_restarts_the_killed_job_fails(tmp_path: Path) -> None:
    # Negative control: the kill is real, so without a restart the job ends in failure, with no result.
    proc = _torchrun(tmp_path, max_restarts=0)
    assert proc.returncode != 0
    assert not (tmp_path / "rank0.pt").exists() and not (tmp_path / "rank1.pt").exists()
