"""Time to send one micro-batch's activation across each pipeline stage boundary, link by link.

Measured, not modelled: for boundary ``b`` (stage ``b`` -> stage ``b + 1``), stage ``b`` streams
``repeats`` buffers of the boundary's activation size to stage ``b + 1`` back to back, which answers
with one byte once it has them all; the one-way time is the sender's elapsed time over ``repeats``. A
stream, not a ping-pong: a pipeline sends one activation per micro-batch in a row, so what it pays is the
link's throughput in the forward direction, and a link that is slower one way (a congested uplink) is
not averaged with its other direction. Boundaries are measured one after the other, so they do not
compete. The result is shared over the pipeline group so every rank holds the same list. Assumes one
stage per rank, stage ``s`` being group rank ``s`` (how the strategy builds pipeline groups).
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
    """One-way seconds to send each boundary's activation downstream; a collective over the pipeline group.

    Args:
        boundary_bytes: Bytes crossing boundary ``b`` per micro-batch, for ``b = 0 .. num_stages - 2``
            (the same list on every rank).
        group: The pipeline group (stage ``s`` is group rank ``s``); ``None`` means the default group.
        device: Where the buffer lives (the stage's device).
        repeats: Buffers streamed per boundary in the timed round.
        warmup: Buffers streamed first, untimed (connection set-up, allocator).

    Returns:
        One-way seconds per boundary (link ``b``: stage ``b`` -> ``b + 1``), identical on every rank.
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
        sender = me == boundary
        peer = boundary + 1 if sender else boundary
        buf = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
        ack = torch.zeros(1, dtype=torch.uint8, device=device)
        if warmup:
            _stream(buf, ack, peer, group, sender, warmup)
        _sync(buf.device)
        t0 = time.perf_counter()
        _stream(buf, ack, peer, group, sender, repeats)
        _sync(buf.device)
        if sender:
            measured[boundary] = (time.perf_counter() - t0) / repeats
    gathered: list[dict[int, float] | None] = [None] * num_stages
    dist.all_gather_object(gathered, measured, group=group)
    merged: dict[int, float] = {}
    for part in gathered:
        merged.update(part or {})
    return [merged[b] for b in range(num_stages - 1)]


def _stream(
    buf: torch.Tensor,
    ack: torch.Tensor,
    peer: int,
    group: dist.ProcessGroup | None,
    sender: bool,
    rounds: int,
) -> None:
    """``rounds`` buffers from the sender to the peer, then one acknowledging byte back."""
    for _ in range(rounds):
        if sender:
            dist.send(buf, group=group, group_dst=peer)
        else:
            dist.recv(buf, group=group, group_src=peer)
    if sender:
        dist.recv(ack, group=group, group_src=peer)
    else:
        dist.send(ack, group=group, group_dst=peer)


def _sync(device: torch.device) -> None:
    # Outside the training step: a synchronise here perturbs nothing we measure.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
