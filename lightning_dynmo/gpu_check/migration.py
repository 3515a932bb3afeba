"""Two-process parts of the GPU check: a migration of device tensors, and whether NCCL shares one device.

Rank 0 starts rank 1 (the same worker command, ``DYNMO_GPU_CHECK_RANK=1``), so the runner's timeout kills
both; they meet through a file store. The migration sends two MLP units with their gradients and AdamW
state from rank 1 to rank 0 with :func:`~lightning_dynmo.pipeline.migrate_units`; rank 0 built the same
units from the same seeds and compares what arrived with its own copies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.gpu_check.plan import Sizes
from lightning_dynmo.pipeline import UnitMove, migrate_units

RANK_ENV = "DYNMO_GPU_CHECK_RANK"
STORE_ENV = "DYNMO_GPU_CHECK_STORE"
TIMEOUT = timedelta(seconds=60)
#: What NCCL says when it refuses two ranks on one device (its answer to :func:`nccl_probe`).
DUPLICATE_DEVICE = "Duplicate GPU detected"
SENT = ("layers.2", "layers.3")  # rank 1 owns layers.0-3 and sends these; rank 0 owns layers.4


def rank() -> int:
    """This process's rank in a two-process part (0 when it was not started as a peer)."""
    return int(os.environ.get(RANK_ENV, "0"))


def migrate(options: dict[str, Any], sizes: Sizes, device: str) -> dict[str, Any] | None:
    """Move :data:`SENT` from rank 1 to rank 0 over ``options["backend"]``; compare them bit for bit."""
    backend = options["backend"]
    with _two_processes(backend) as me:
        compute = _compute_device(device, backend, me)
        transport = compute if backend == "nccl" else torch.device("cpu")  # gloo: no CUDA point to point
        owned = ("layers.0", "layers.1", *SENT) if me == 1 else ("layers.4",)
        units, optimizer = _trained_units(owned, sizes, compute)
        moves = [UnitMove(name, 1, 0) for name in SENT]
        start = time.perf_counter()
        received, report = migrate_units(moves, units, [optimizer], device=transport)
        _synchronize(compute)
        seconds = time.perf_counter() - start
        if me != 0:
            return None
        references, reference_optimizer = _trained_units(SENT, sizes, compute)
        return {
            "backend": backend,
            "compute_device": str(compute),
            "transport_device": str(transport),
            "moves": [f"{m.unit}: rank {m.src} -> rank {m.dst}" for m in moves],
            "bytes_received": report.bytes_received,
            "seconds": seconds,
            "received_devices": sorted({str(p.device) for u in received.values() for p in u.parameters()}),
            **_compare(received, optimizer, references, reference_optimizer),
        }


def nccl_probe(options: dict[str, Any], sizes: Sizes, device: str) -> dict[str, Any] | None:
    """Two NCCL ranks on ``cuda:0``: does this NCCL accept them?

    Either answer passes: accepted (with the all-reduce's value), or refused with NCCL's own reason
    (NCCL 2.28 says "Duplicate GPU detected"). Any other error fails the part.
    """
    try:
        with _two_processes("nccl", device=torch.device("cuda", 0)) as me:
            value = torch.ones(1, device="cuda:0")
            dist.all_reduce(value)
            torch.cuda.synchronize()
            return {"two_ranks_on_one_device": "accepted", "all_reduce": float(value)} if me == 0 else None
    except dist.DistBackendError as error:
        reason = next((line for line in str(error).splitlines() if DUPLICATE_DEVICE in line), None)
        if reason is None:
            raise
        return {"two_ranks_on_one_device": "refused", "nccl_says": reason.strip()} if rank() == 0 else None


@contextmanager
def _two_processes(backend: str, device: torch.device | None = None) -> Iterator[int]:
    me = rank()
    peer = _start_peer() if me == 0 else None
    try:
        store = dist.FileStore(os.environ[STORE_ENV], 2)  # type: ignore[attr-defined]  # not in torch's __all__
        options: dict[str, Any] = {"device_id": device} if device is not None else {}
        dist.init_process_group(backend, store=store, rank=me, world_size=2, timeout=TIMEOUT, **options)
        try:
            yield me
            dist.barrier()
        finally:
            dist.destroy_process_group()
    finally:
        if peer is not None:  # also when the group could not start: the peer has failed the same way
            peer.wait(timeout=TIMEOUT.total_seconds())


def _start_peer() -> subprocess.Popen[bytes]:
    os.environ[STORE_ENV] = str(Path(tempfile.mkdtemp(prefix="dynmo-gpu-check-")) / "store")
    command = [sys.executable, "-m", "lightning_dynmo.gpu_check.worker", *sys.argv[1:]]
    return subprocess.Popen(command, env={**os.environ, RANK_ENV: "1"})


def _compute_device(device: str, backend: str, me: int) -> torch.device:
    if device != "cuda":
        return torch.device("cpu")
    index = me if backend == "nccl" else 0  # gloo on one GPU: both ranks on cuda:0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _trained_units(
    names: tuple[str, ...], sizes: Sizes, device: torch.device
) -> tuple[dict[str, nn.Module], torch.optim.Optimizer]:
    """MLP units after one AdamW step, gradients kept; each unit's values depend only on its name."""
    units = {name: _unit(name, sizes.d_model, device) for name in names}
    optimizer = torch.optim.AdamW([p for u in units.values() for p in u.parameters()], lr=1e-3)
    for name, unit in units.items():
        torch.manual_seed(_seed(name) + 1)
        x = torch.randn(sizes.batch_size, sizes.seq_len, sizes.d_model, device=device)
        unit(x).square().mean().backward()
    optimizer.step()
    return units, optimizer


def _unit(name: str, width: int, device: torch.device) -> nn.Module:
    torch.manual_seed(_seed(name))
    return nn.Sequential(
        nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
    ).to(device)


def _seed(name: str) -> int:
    return 1000 * (int(name.rsplit(".", 1)[1]) + 1)


def _compare(
    received: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer,
    references: dict[str, nn.Module],
    reference_optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """Largest difference over parameters, gradients and optimizer state; ``bit_identical`` when all 0."""
    if sorted(received) != sorted(references):
        return {
            "bit_identical": False,
            "error": f"received {sorted(received)}, expected {sorted(references)}",
        }
    worst, compared = 0.0, 0
    for name, unit in received.items():
        for (_, got), (_, want) in zip(
            unit.named_parameters(), references[name].named_parameters(), strict=True
        ):
            pairs = [(got, want), (got.grad, want.grad)]
            state, ref_state = optimizer.state[got], reference_optimizer.state[want]
            pairs += [(state[k], ref_state[k]) for k in sorted(ref_state)]
            for a, b in pairs:
                worst = max(worst, _difference(a, b))
                compared += 1
    return {"bit_identical": worst == 0.0, "max_abs_difference": worst, "tensors_compared": compared}


def _difference(a: Any, b: Any) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = torch.as_tensor(a).detach().double().cpu(), torch.as_tensor(b).detach().double().cpu()
    return float((a - b).abs().max()) if a.numel() else 0.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
