"""Who starts the ranks of ``python -m lightning_dynmo.train``, and where a run writes.

Read in this order: :func:`external_launcher` (were we started by torchrun, SLURM or a launching
script?), :func:`local_processes` (how many ranks this node runs), :func:`start_local_ranks` (start them
with torch's elastic agent, what ``torchrun --standalone`` does), :func:`run_id` (the run directory name
every rank of one job agrees on).

Why the application starts its ranks itself instead of Lightning's script launcher: under Hydra,
Lightning's launcher re-runs ``sys.argv`` for each extra rank, which inside a multirun sweep re-launches
the whole sweep (``-m a=1,2``) from every job, and it leaves ``LOCAL_RANK``, ``WORLD_SIZE`` and
``MASTER_PORT`` in the environment and the process group open, so the sweep's next job, run in the same
Python process, believes its ranks were started externally and waits for peers that never come
(Lightning-AI/pytorch-lightning#11617, #18175, facebookresearch/hydra#2070). Here the Hydra process
never trains: it starts every rank as a fresh ``python -m lightning_dynmo.train`` with the job's own
overrides (``HydraConfig.overrides.task``, no sweep) and the job's directory, through torch's elastic
agent (a free port per job, every rank stopped if one fails), waits for them, and keeps nothing behind.
Each sweep job therefore launches and reaps its own processes.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from lightning_dynmo.pipeline.faults.death import death_line

log = logging.getLogger(__name__)

__all__ = [
    "CHILD_ENV",
    "LaunchFailed",
    "check_multi_node",
    "external_launcher",
    "local_processes",
    "rank_of_this_process",
    "run_id",
    "start_local_ranks",
]

#: Set in the environment of the ranks :func:`start_local_ranks` starts (their launcher reports the run).
CHILD_ENV = "DYNMO_APP_RANK"


class LaunchFailed(RuntimeError):
    """A rank started by :func:`start_local_ranks` failed; its own traceback was printed above."""


def external_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """The launcher that started this process and its peers, or ``None`` when nothing did.

    ``"torchrun"`` (torch's elastic agent: torchrun, or this module), ``"slurm"`` (``srun``), ``"script"``
    (another launcher that sets ``LOCAL_RANK``, e.g. Lightning's).
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env and "LOCAL_RANK" in env:
        return "torchrun"
    if (
        "SLURM_NTASKS" in env
        and "SLURM_PROCID" in env
        and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    ):
        return "slurm"
    if "LOCAL_RANK" in env:
        return "script"
    return None


def rank_of_this_process(environ: Mapping[str, str] | None = None) -> int:
    """The global rank a launcher gave this process (0 when none did)."""
    env = os.environ if environ is None else environ
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


def local_processes(trainer: Mapping[str, Any], cuda_devices: int | None = None) -> int:
    """The ranks one node runs for a ``trainer`` config (its ``accelerator`` and ``devices``).

    Args:
        trainer: The trainer node (``accelerator``, ``devices``).
        cuda_devices: Visible CUDA devices (``None``: ask torch).

    Raises:
        ValueError: ``devices`` is not a count, a list of indices, ``"auto"`` or ``-1``.
    """
    devices = trainer.get("devices", "auto")
    accelerator = str(trainer.get("accelerator", "auto"))
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return devices
    if devices in (-1, "auto", "-1"):
        if accelerator == "cpu":
            return 1
        if cuda_devices is None:
            cuda_devices = torch.cuda.device_count()
        return max(cuda_devices, 1)
    raise ValueError(
        f"trainer.devices={devices!r} must be a number of devices (e.g. 2), a list of device indices, "
        "'auto' or -1."
    )


def check_multi_node(num_nodes: Any, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a multi-node job that no launcher started (it would wait forever for the other nodes).

    Raises:
        ValueError: ``num_nodes > 1`` and this process was not started by torchrun or ``srun``.
    """
    if isinstance(num_nodes, int) and num_nodes > 1 and external_launcher(environ) is None:
        raise ValueError(
            f"trainer.num_nodes={num_nodes} needs its ranks started on every node by a launcher: run "
            "`torchrun --nnodes N --nproc-per-node G --rdzv-id ID --rdzv-backend c10d --rdzv-endpoint "
            "HOST:PORT -m lightning_dynmo.train ...` on each node, or `srun python -m lightning_dynmo.train "
            "...` under SLURM (docs/guides/configuration.md); on one node, set trainer.num_nodes=1."
        )


def start_local_ranks(nproc: int, argv: Sequence[str], *, run_dir: str) -> None:
    """Run ``python -m lightning_dynmo.train <argv>`` as ``nproc`` ranks of one job; return when all end.

    Args:
        nproc: Ranks on this node.
        argv: The job's own overrides (no sweep, no ``-m``).
        run_dir: The job's output directory; every rank uses it.

    Raises:
        LaunchFailed: a rank exited with an error (every other rank was stopped).
    """
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"dynmo-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # a free port for each job
        max_restarts=0,
        monitor_interval=0.5,
    )
    args = [
        "-m",
        "lightning_dynmo.train",
        *argv,
        f"hydra.run.dir={_quote(run_dir)}",
        "hydra.output_subdir=null",  # the launching process wrote the job's .hydra/ already
    ]
    previous = os.environ.get(CHILD_ENV)
    os.environ[CHILD_ENV] = "1"
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as err:
        for rank, failure in err.failures.items():
            if (
                failure.exitcode < 0
            ):  # killed by a signal: no traceback says so (see pipeline/faults/death.py)
                log.error(death_line(rank, failure.pid, failure.exitcode))
        failures = ", ".join(f"rank {rank} (exit code {f.exitcode})" for rank, f in err.failures.items())
        raise LaunchFailed(
            f"{failures} of the {nproc} ranks failed; the error is printed above this line. The run "
            f"directory is {run_dir}."
        ) from None
    finally:
        if previous is None:
            os.environ.pop(CHILD_ENV, None)
        else:
            os.environ[CHILD_ENV] = previous


def run_id(default: str, environ: Mapping[str, str] | None = None) -> str:
    """A run-directory name every rank of one externally launched job computes alike.

    Ranks started by torchrun or ``srun`` each compose the config; a timestamp could differ between
    them, so they use the job's id: ``torchrun-<rdzv id>`` (``--standalone`` draws one; multi-node runs
    pass ``--rdzv-id``), ``slurm-<job>-<step>``. Otherwise (a single process, or the launching
    process of :func:`start_local_ranks`, which hands its directory to its ranks) ``default``.
    """
    env = os.environ if environ is None else environ
    if external_launcher(env) == "torchrun" and env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if external_launcher(env) == "slurm" and "SLURM_JOB_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '0')}"
    return default


def _quote(value: str) -> str:
    """A Hydra override value that keeps any path intact (quoted, quotes and backslashes escaped)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
