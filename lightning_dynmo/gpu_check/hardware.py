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
        "git_commit": _git_commit(),
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


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None  # an installed wheel outside a clone, or no git
    return done.stdout.strip() or None
