"""Time to send one micro-batch's activation across each pipeline stage boundary.

Measured, not modelled: for boundary ``b`` (stage ``b`` -> stage ``b + 1``), the two ranks play
ping-pong with a buffer of the boundary's activation size, and the one-way time is half the mean
round trip. Boundaries are measured one after the other, so they do not compete for the link. The
result is shared over the pipeline group so every rank holds the same list. Assumes one stage per
rank, stage ``s`` being group rank ``s`` (how the strategy builds pipeline groups).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


def measure_boundary_comm_s(
    boundary_bytes: Sequence[int],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    repeats: int = 5,
    warmup: int = 1,
) -> list[float]:
    """One-way seconds to send each boundary's activation; a collective over the pipeline group.

    Args:
        boundary_bytes: Bytes crossing boundary ``b`` per micro-batch, for ``b = 0 .. num_stages - 2``
            (the same list on every rank).
        group: The pipeline group (stage ``s`` is group rank ``s``); ``None`` means the default group.
        device: Where the buffer lives (the stage's device).
        repeats: Timed round trips per boundary.
        warmup: Untimed round trips per boundary first (connection set-up, allocator).

    Returns:
        One-way seconds per boundary, identical on every rank of the group.
    """
    num_stages = dist.get_world_size(group)
    if len(boundary_bytes) != num_stages - 1:
        raise ValueError(
            f"boundary_bytes has {len(boundary_bytes)} entries but the pipeline group has {num_stages} "
            f"stages, i.e. {num_stages - 1} boundaries; pass one size per boundary."
        )
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1 and warmup >= 0.")
    me = dist.get_rank(group)
    measured: dict[int, float] = {}
    for boundary, nbytes in enumerate(boundary_bytes):
        if me not in (boundary, boundary + 1):
            continue
        peer = boundary + 1 if me == boundary else boundary
        buf = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
        _ping_pong(buf, peer, group, sender=me == boundary, rounds=warmup)
        _sync(buf.device)
        t0 = time.perf_counter()
        _ping_pong(buf, peer, group, sender=me == boundary, rounds=repeats)
        _sync(buf.device)
        if me == boundary:
            measured[boundary] = (time.perf_counter() - t0) / (2 * repeats)
    gathered: list[dict[int, float] | None] = [None] * num_stages
    dist.all_gather_object(gathered, measured, group=group)
    merged: dict[int, float] = {}
    for part in gathered:
        merged.update(part or {})
    return [merged[b] for b in range(num_stages - 1)]


def _ping_pong(
    buf: torch.Tensor, peer: int, group: dist.ProcessGroup | None, sender: bool, rounds: int
) -> None:
    for _ in range(rounds):
        if sender:
            dist.send(buf, group=group, group_dst=peer)
            dist.recv(buf, group=group, group_src=peer)
        else:
            dist.recv(buf, group=group, group_src=peer)
            dist.send(buf, group=group, group_dst=peer)


def _sync(device: torch.device) -> None:
    # Outside the training step: a synchronise here perturbs nothing we measure.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
