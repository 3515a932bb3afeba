"""Re-pack and release under Lightning's own launcher (``python script.py``, devices=2).

Rank 0 is the launching process and holds rank 1's ``Popen`` handle. The pipeline is re-packed from 2
stages to 1 at batch 2; rank 1 is released, leaves ``fit`` and its process exits. Before its last batch,
rank 0 waits (bounded) for that process to end and records its exit code: 0, while training is still
running. Rank 0's losses must equal the single-process reference.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed.fitting import TOL, Run, reference
from tests.integration.test_strategy_launcher import _clean_env

pytestmark = pytest.mark.distributed

RUN = Run(num_layers=4, placement="0-1|2-3", migrations=((2, "0-3"),), steps=6)

_SCRIPT = textwrap.dedent(
    """
    import logging, sys, time

    import lightning.pytorch as pl
    import torch

    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy
    from tests.distributed.fitting import ForcePlacement, LossRecorder, Run, make_strategy
    from tests.integration.test_release_launcher import RUN

    class WaitForReleasedChild(pl.Callback):
        exit_codes = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx != RUN.steps - 1 or trainer.global_rank != 0:
                return
            procs = trainer.strategy.launcher.procs
            deadline = time.monotonic() + 60
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.exit_codes = [p.poll() for p in procs]

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO)  # the release announcement is an INFO line of lightning_dynmo
    events = []
    recorder, waiter = LossRecorder(), WaitForReleasedChild()
    trainer = pl.Trainer(
        devices=2, strategy=make_strategy(RUN, on_release=events.append), use_distributed_sampler=False,
        callbacks=[recorder, ForcePlacement(dict(RUN.migrations)), waiter], **RUN.trainer_kwargs(),
    )
    model = RUN.model()
    trainer.fit(model, RUN.datamodule())
    result = {
        "losses": recorder.losses, "state": model.state_dict(), "released": trainer.strategy.is_released,
        "child_exit_codes": waiter.exit_codes, "events": [e.released_ranks for e in events],
        "global_step": trainer.global_step,
    }
    torch.save(result, f"{sys.argv[1]}/rank{trainer.global_rank}.pt")
    """
)


def test_released_rank_process_exits_zero_while_rank_zero_trains_on(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=_clean_env(root),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert rank1["released"] and rank1["global_step"] == 2 and rank1["events"] == [(1,)]
    assert not rank0["released"] and rank0["global_step"] == RUN.steps and rank0["events"] == [(1,)]
    assert rank0["child_exit_codes"] == [0], "rank 1's process must have exited 0 before the last batch"
    assert "DynMo re-packed the pipeline 0-1|2-3 -> 0-3 at step 2: released ranks [1]" in proc.stderr
    ref = reference(RUN)
    assert max(abs(a - b) for a, b in zip(rank0["losses"], ref["losses"], strict=True)) < TOL
    assert max((rank0["state"][k] - v).abs().max().item() for k, v in ref["state"].items()) < TOL
