"""Exact live migration of named units (transformer blocks, embedding, head) between ranks.

Read in this order: :func:`migrate_units` (the contract the strategy calls) and :class:`MigrationReport`,
then the validation and agreement, then the exchange at the bottom. How one unit becomes bytes plus
tensors and back is :mod:`.pack`; how the optimizers are edited is :mod:`.optimizer`.

How a unit travels. :func:`~.pack.pack_unit` turns it into a small pickled *structure* and tensor
*payloads*; the structure goes over the wire as a uint8 tensor, the payloads as separate point-to-point
messages on ``device`` so that NCCL moves device memory directly; on CPU/gloo the same code runs.

Optimizer state. A sent parameter is removed from every optimizer's ``param_groups`` and its state is
dropped; a received parameter joins the param_group with the hyper-parameters of its sender-side group
(the same index when that one matches; ranks may build different groups, see
:mod:`.param_groups`) with its full state (tensor and non-tensor values alike), and every group ends in a
deterministic order (:mod:`.optimizer`). Known units are those in ``local_units`` plus those received.

Communication. ``migrate_units`` is collective over ``group``: every rank of the group calls it with the
identical move list. A first tiny all-reduce checks that the lists agree and that every sender could
pack its units, so bad input fails on all ranks at once instead of leaving a peer waiting for data that
never comes. Then three rounds of one ``dist.batch_isend_irecv`` each: structure sizes, structures,
payloads. Within a round every rank posts all its sends and receives at once, in move order, so a rank
that both sends and receives cannot deadlock and moves between non-neighbouring ranks need nothing
special. A last tiny all-reduce tells every rank whether every receiver could take its units in. An empty
move list returns at once without any communication. The agreements carry a few numbers whatever the
group's size; only when one fails are the ranks' flags gathered, to name the ranks in the error.

One plan for all data-parallel replicas. A unit name may appear in several moves when they leave from
different ranks and arrive at different ranks (each replica moves its own copy of ``layers.3``), so the
moves of every replica go in one call and their transfers run at the same time.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.balancing.moves import Move, UnitMove
from lightning_dynmo.pipeline.migration.optimizer import (
    drop_from_optimizers,
    insert_into_optimizers,
    sort_param_groups,
)
from lightning_dynmo.pipeline.migration.pack import PackedUnit, allocate_payloads, pack_unit, unpack_unit
from lightning_dynmo.pipeline.model.units import unit_sort_key

log = logging.getLogger(__name__)

__all__ = ["MigrationReport", "UnitMove", "group_ranks", "migrate_units"]


# ----------------------------------------------------------------------------------------------------
# Public contract
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigrationReport:
    """What one call of :func:`migrate_units` did on this rank.

    Args:
        moves: the full move list (identical on every rank).
        bytes_sent: bytes this rank sent (sizes, structures and tensor payloads).
        bytes_received: bytes this rank received.
        seconds: wall time of the call on this rank, validation and packing included.
    """

    moves: tuple[UnitMove, ...]
    bytes_sent: int
    bytes_received: int
    seconds: float


def migrate_units(
    moves: Sequence[UnitMove],
    local_units: Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    lr_schedulers: Sequence[Any] = (),
) -> tuple[dict[str, nn.Module], MigrationReport]:
    """Run this rank's part of ``moves``; return the units received (on ``device``, ready to attach).

    Collective over ``group``: every rank of the group calls it with the identical ``moves`` (same order).
    For every unit this rank sends, its parameters are removed from ``optimizers``' param_groups and their
    state is dropped; the caller detaches the module from its model afterwards. Every unit received arrives
    bit-identical: parameters, buffers, ``requires_grad`` flags, ``.grad`` if set, plain Python attributes,
    and its parameters join the param_group with their sender-side hyper-parameters (the same index when
    it matches, see :mod:`.param_groups`) together with their full optimizer state.

    Args:
        moves: the moves, identical on every rank of ``group``. Ranks are GLOBAL ranks. A rank sends a
            unit name at most once and receives it at most once (replicas' copies may move together).
        local_units: the units this rank owns now (at least those it sends). Passing all of them gives a
            fully sorted param_group order (see the module docstring).
        optimizers: this rank's optimizers (the same number on every rank; param_groups may differ, e.g.
            one per block with layer-wise learning rates).
        device: where received tensors are placed and payloads travel (``cuda:i`` for NCCL, cpu for gloo).
            Tensors that were on CPU on the sender (e.g. Adam's ``step``) come back on CPU.
        group: a process group containing every ``src`` and ``dst``; ``None`` means the default group.
        lr_schedulers: this rank's LR schedulers; a param_group created for a received parameter is added
            to those of its optimizer.

    Returns:
        ``(received, report)``: the modules this rank received keyed by unit name, and a report.

    Raises:
        ValueError: malformed moves (a unit sent or received twice by one rank, ``src == dst``, a rank
            outside ``group``), a unit this rank must send but does not own, or move lists that differ
            between ranks.
        TypeError: a unit holds something that cannot travel (an unpicklable attribute, a tensor attached
            to an autograd graph, a tensor subclass); the message names the unit and attribute.
        RuntimeError: another rank rejected the migration, or could not take in what it received (its own
            error says why).
    """
    start = time.perf_counter()
    moves = tuple(moves)
    _check_moves(moves)
    if not moves:
        return {}, MigrationReport(moves=(), bytes_sent=0, bytes_received=0, seconds=0.0)
    rank = dist.get_rank()
    members = group_ranks(group)
    if rank not in members:
        raise ValueError(
            f"migrate_units: this rank ({rank}) is not in the process group (ranks {members}). Call it only "
            "on members of `group`, or pass a group that contains this rank."
        )

    packed: dict[str, PackedUnit] = {}
    local_error: Exception | None = None
    try:
        _check_moves_for_rank(moves, rank, members, local_units)
        for move in moves:
            if move.src == rank:
                packed[move.unit] = pack_unit(move.unit, local_units[move.unit], optimizers, device=device)
    except (ValueError, TypeError) as err:
        local_error = err
    _agree(moves, local_error, device=device, group=group, members=members)

    received, sent_bytes, recv_bytes = _exchange(moves, packed, rank, device=device, group=group)

    sent_units = {m.unit: local_units[m.unit] for m in moves if m.src == rank}
    drop_from_optimizers(sent_units, optimizers)
    modules: dict[str, nn.Module] = {}
    insert_error: Exception | None = None
    try:
        for name, (module, optim_entries) in received.items():
            modules[name] = module
            insert_into_optimizers(name, module, optim_entries, optimizers, lr_schedulers)
    except (ValueError, TypeError) as err:
        insert_error = err
    # Every rank learns whether every receiver took its units in, so none trains on alone.
    _agree(moves, insert_error, device=device, group=group, members=members, after_transfer=True)
    if modules:  # removal keeps the order; only insertion needs sorting
        known = {**{k: v for k, v in local_units.items() if k not in sent_units}, **modules}
        sort_param_groups(known, optimizers)

    report = MigrationReport(
        moves=moves, bytes_sent=sent_bytes, bytes_received=recv_bytes, seconds=time.perf_counter() - start
    )
    log.info(
        "rank %d migrated units: sent %s, received %s (%d B out, %d B in, %.3f s)",
        rank,
        sorted(sent_units, key=unit_sort_key),
        sorted(modules, key=unit_sort_key),
        sent_bytes,
        recv_bytes,
        report.seconds,
    )
    return modules, report


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------


def _check_moves(moves: tuple[Any, ...]) -> None:
    """Checks every rank can do on its own and reaches the same verdict on."""
    seen: set[tuple[str, str, int]] = set()
    for i, move in enumerate(moves):
        if not (isinstance(move, Move) and isinstance(move.unit, str)):  # a UnitMove: a Move of a name
            raise TypeError(f"moves[{i}] must be a UnitMove, got {type(move).__name__}: {move!r}.")
        if move.src == move.dst:
            raise ValueError(
                f"moves[{i}] = {move!r} has src == dst ({move.src}): a unit that stays needs no move. "
                "Leave it out of the move list."
            )
        ends = {(move.unit, "src", move.src), (move.unit, "dst", move.dst)}
        if ends & seen:
            raise ValueError(
                f"moves[{i}] = {move!r}: unit {move.unit!r} appears more than once in moves from or to the "
                "same rank. Each copy of a unit may move at most once per call; merge its moves into one "
                "(src = current owner, dst = final one)."
            )
        seen |= ends


def _check_moves_for_rank(
    moves: tuple[UnitMove, ...], rank: int, members: list[int], local_units: Mapping[str, nn.Module]
) -> None:
    for i, move in enumerate(moves):
        for role in ("src", "dst"):
            peer = getattr(move, role)
            if peer not in members:
                raise ValueError(
                    f"moves[{i}] = {move!r}: {role} rank {peer} is not in the process group "
                    f"(ranks {members}). Use GLOBAL ranks and pass a group that contains every src and dst."
                )
        if move.src == rank and move.unit not in local_units:
            raise ValueError(
                f"moves[{i}] = {move!r}: rank {rank} must send unit {move.unit!r} but local_units does not "
                f"hold it (it holds {sorted(local_units, key=unit_sort_key)}). The move list must use the "
                "current owners; pass every unit this rank owns."
            )
        if move.dst == rank and move.unit in local_units:
            raise ValueError(
                f"moves[{i}] = {move!r}: rank {rank} is the destination of unit {move.unit!r} but already "
                "owns it. The move list must use the current owners."
            )


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """GLOBAL ranks of ``group`` (``None``: the default group; empty for new_group's non-member marker)."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # type: ignore[comparison-overlap]  # new_group's marker
        return []
    if group is None or group == dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _digest(moves: tuple[UnitMove, ...]) -> int:
    text = ";".join(f"{m.unit}:{m.src}>{m.dst}" for m in moves)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _agree(
    moves: tuple[UnitMove, ...],
    local_error: Exception | None,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None,
    members: list[int],
    after_transfer: bool = False,
) -> None:
    """All ranks learn whether every rank accepted the same moves; raise everywhere if not.

    One all-reduce (max) of ``[failed, digest, -digest]``: a few bytes whatever the group's size. Only when
    it reports a failure or differing lists are the flags and digests gathered, to name the ranks.
    """
    failed_here, digest = 0 if local_error is None else 1, _digest(moves)
    verdict = torch.tensor([failed_here, digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    any_failed, max_digest, min_digest = int(verdict[0]), int(verdict[1]), -int(verdict[2])
    if not any_failed and max_digest == min_digest:
        return
    mine = torch.tensor([failed_here, digest], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in members]
    dist.all_gather(gathered, mine, group=group)  # the error path only: name the ranks
    if local_error is not None:
        raise local_error
    failed = [members[i] for i, t in enumerate(gathered) if int(t[0]) != 0]
    if failed:
        if after_transfer:
            raise RuntimeError(
                f"Migration failed: rank(s) {failed} could not take in the units they received (see their "
                "errors); the model is now split inconsistently, so training cannot go on."
            )
        raise RuntimeError(
            f"Migration aborted: rank(s) {failed} rejected the moves (see their errors); no unit was moved."
        )
    digests = {members[i]: int(t[1]) for i, t in enumerate(gathered)}
    if len(set(digests.values())) > 1:
        raise ValueError(
            f"migrate_units got different move lists on different ranks (digest per rank: {digests}). "
            "Every rank must pass the identical moves in the same order; decide once and broadcast."
        )


# ----------------------------------------------------------------------------------------------------
# Transport
# ----------------------------------------------------------------------------------------------------


def _exchange(
    moves: tuple[UnitMove, ...],
    packed: Mapping[str, PackedUnit],
    rank: int,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> tuple[dict[str, Any], int, int]:
    """Three rounds (sizes, structures, payloads) of one batch_isend_irecv each, in move order."""
    sending = [m for m in moves if m.src == rank]
    receiving = [m for m in moves if m.dst == rank]
    sent = received = 0

    sizes_out = {
        m.unit: torch.tensor([len(packed[m.unit].structure)], dtype=torch.int64, device=device)
        for m in sending
    }
    sizes_in = {m.unit: torch.empty(1, dtype=torch.int64, device=device) for m in receiving}
    _run_round(moves, rank, sizes_out, sizes_in, group)
    sent += 8 * len(sending)
    received += 8 * len(receiving)

    structs_out = {
        m.unit: torch.frombuffer(bytearray(packed[m.unit].structure), dtype=torch.uint8).to(device)
        for m in sending
    }
    structs_in = {
        m.unit: torch.empty(int(sizes_in[m.unit]), dtype=torch.uint8, device=device) for m in receiving
    }
    _run_round(moves, rank, structs_out, structs_in, group)
    sent += sum(t.numel() for t in structs_out.values())
    received += sum(t.numel() for t in structs_in.values())

    structures = {name: bytes(t.cpu().numpy()) for name, t in structs_in.items()}
    payloads_in = {name: allocate_payloads(s, device) for name, s in structures.items()}
    payload_out: dict[str, list[torch.Tensor]] = {m.unit: packed[m.unit].payloads for m in sending}
    _run_round(moves, rank, payload_out, payloads_in, group)
    sent += sum(packed[m.unit].payload_nbytes for m in sending)
    received += sum(t.numel() * t.element_size() for ts in payloads_in.values() for t in ts)

    units = {name: unpack_unit(structures[name], payloads_in[name], device=device) for name in structures}
    return units, sent, received


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor, so any dtype (bool masks included) goes over any backend."""
    return t.reshape(-1).view(torch.uint8)


def _run_round(
    moves: tuple[UnitMove, ...],
    rank: int,
    outgoing: Mapping[str, torch.Tensor | list[torch.Tensor]],
    incoming: Mapping[str, torch.Tensor | list[torch.Tensor]],
    group: dist.ProcessGroup | None,
) -> None:
    ops = []
    for move in moves:  # the same order on both ends of every pair
        if move.src == rank:
            for t in _listed(outgoing[move.unit]):
                if t.numel():
                    ops.append(dist.P2POp(dist.isend, _as_bytes(t), peer=move.dst, group=group))
        elif move.dst == rank:
            for t in _listed(incoming[move.unit]):
                if t.numel():
                    ops.append(dist.P2POp(dist.irecv, _as_bytes(t), peer=move.src, group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _listed(x: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return x if isinstance(x, list) else [x]
