"""The machine a check ran on, named: devices, memory, torch / CUDA / cuDNN / NCCL / Lightning versions."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import lightning
import torch


def describe() -> dict[str, Any]:
    """What the projections need to say which hardware measured them (JSON-ready)."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "git_commit": _git("rev-parse", "HEAD"),
        # A copied tree can differ from its clone's HEAD (the device tool copies a working tree): then
        # the commit alone misnames the code that ran, and this is true.
        "git_tree_differs": _tree_differs(),
        "devices": [],
    }
    if torch.cuda.is_available():
        # Both untyped in torch's stubs.
        info["cudnn"] = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
        info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
        info["devices"] = [_device(i) for i in range(torch.cuda.device_count())]
    return info


def _device(index: int) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(index)
    return {
        "index": index,
        "name": torch.cuda.get_device_name(index),
        "total_memory_bytes": int(props.total_memory),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
    }


def _git(*args: str) -> str | None:
    """``git args...`` in this package's clone: its stdout, stripped (``None``: no clone or no git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None  # an installed wheel outside a clone, or no git
    return done.stdout.strip() if done.returncode == 0 else None


def _tree_differs() -> bool | None:
    """Whether tracked files differ from ``HEAD`` (``None``: no clone or no git)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)
