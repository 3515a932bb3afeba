"""Start two ranks the ways users do, make one fail at a chosen point, and time how every rank ends.

``launch(launcher, where, culprit, out)`` writes :data:`RANK_SCRIPT` and starts it under Lightning's
launcher (``python script.py``: rank 0 starts rank 1 and hosts the TCPStore the ranks meet through) or
``torchrun --standalone`` (torch's elastic agent hosts the store). Each rank writes its pid; the culprit
writes the time of its fault just before it raises or kills itself (``SIGKILL``, what the OOM killer
sends). The driver polls every rank's pid and returns when each one has ended (or a deadline passed, then
it kills the stragglers), with each rank's end time after the fault and the launcher's whole output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FAULT_POINTS", "RANK_SCRIPT", "Outcome", "launch"]

#: Where the culprit fails: an exception at setup, in the first forward, in backward, in
#: ``apply_placement`` called on that rank only, during a checkpoint save; or a SIGKILL mid-step.
FAULT_POINTS = ("setup", "forward", "backward", "apply_placement", "checkpoint", "sigkill")

RANK_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from datetime import timedelta
    from pathlib import Path

    import lightning.pytorch as pl
    import torch
    from torch import nn

    from lightning_dynmo.strategy import DynMoStrategy
    from tests.distributed.fitting import Run, make_strategy

    out, where, culprit = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    control_s = float(sys.argv[4])
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    (out / f"pid{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    AT_BATCH = 1


    def fault(what):
        with open(out / "fault", "x") as f:
            f.write(repr(time.time()))
        if where == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"injected fault on rank {rank} {what}")


    class RaiseInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            fault("in backward")


    class Tripwire(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block
            self.armed = False

        def forward(self, x):
            if self.armed and where in ("forward", "sigkill"):
                fault("in forward")
            y = self.block(x)
            return RaiseInBackward.apply(y) if self.armed and where == "backward" else y


    class Fault(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            if where == "setup" and rank == culprit:
                fault("at setup")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if rank != culprit or batch_idx != AT_BATCH:
                return
            if where == "apply_placement":
                with open(out / "fault", "x") as f:
                    f.write(repr(time.time()))
                trainer.strategy.apply_placement("0-0|1-3")
            for layer in trainer.strategy.local_layers.values():
                layer.armed = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if where == "checkpoint" and batch_idx == AT_BATCH:
                trainer.save_checkpoint(out / "ckpt")

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            if rank == culprit:
                fault("during a checkpoint save")


    run = Run(steps=4)
    model = run.model()
    for name in list(model.layers):
        model.layers[name] = Tripwire(model.layers[name])
    strategy = make_strategy(run, control_timeout=timedelta(seconds=control_s))
    trainer = pl.Trainer(devices=2, strategy=strategy, callbacks=[Fault()], **run.trainer_kwargs())
    trainer.fit(model, run.datamodule())
    """
)


@dataclass(frozen=True)
class Outcome:
    """How a launch ended.

    Attributes:
        ended_after: Per rank, seconds from the fault until its process ended (``None``: killed by the
            driver at the deadline).
        returncode: The launching process's exit code.
        output: The launching process's stdout and stderr (every rank's, interleaved).
    """

    ended_after: dict[int, float | None]
    returncode: int
    output: str


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def launch(
    launcher: str,
    where: str,
    culprit: int,
    out: Path,
    *,
    root: Path,
    env: dict[str, str],
    control_s: float = 5.0,
    deadline_s: float = 120.0,
) -> Outcome:
    """Run the rank script under ``launcher`` (``"lightning"``, ``"torchrun"``), failing on ``culprit``."""
    script = out / "ranks.py"
    script.write_text(RANK_SCRIPT)
    args = [str(script), str(out), where, str(culprit), str(control_s)]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    else:
        cmd = [sys.executable, *args]
    log = out / "output.txt"
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT)
        ended: dict[int, float] = {}
        stop = time.monotonic() + deadline_s
        while time.monotonic() < stop:
            proc.poll()
            for rank in range(2):
                pid_file = out / f"pid{rank}"
                known = rank not in ended and pid_file.exists() and pid_file.read_text()
                if known and _ended(int(pid_file.read_text())):
                    ended[rank] = time.time()
            if len(ended) == 2 and proc.returncode is not None:
                break
            time.sleep(0.05)
        for rank in range(2):
            pid_file = out / f"pid{rank}"
            if rank not in ended and pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)  # a straggler this driver started
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    fault_file = out / "fault"
    fault = float(fault_file.read_text()) if fault_file.exists() else float("nan")
    after = {rank: (ended[rank] - fault if rank in ended else None) for rank in range(2)}
    return Outcome(after, proc.returncode, log.read_text())
