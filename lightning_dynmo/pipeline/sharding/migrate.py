"""Move FSDP2-sharded units between pipeline stages shard for shard, with their optimizer state.

Data-parallel rank ``i`` of the source stage sends its local shards to data-parallel rank ``i`` of the
destination stage. Both stages shard over data-parallel meshes of the same size, so the shards have the
same shapes at both ends and nothing is gathered: each rank sends exactly the bytes it holds.

What travels, per unit: every parameter's local shard, its local gradient shard if ``.grad`` is set, every
buffer (FSDP2 does not shard buffers), and every optimizer state tensor (Adam's ``exp_avg`` and
``exp_avg_sq`` are sharded like their parameter; ``step`` is a scalar). The receiver builds the unit from the
sender's skeleton (:mod:`.skeleton`: its classes and plain attributes, ``meta`` tensors) or with the
caller's factory (on the ``meta`` device it costs no memory), shards it with
:func:`~.apply.shard_unit` over its own data-parallel mesh, copies the shards in and rebuilds the sharded
gradients and optimizer state with :meth:`DTensor.from_local
<torch.distributed.tensor.DTensor.from_local>`. With a factory, plain Python attributes of the unit are
not carried: the factory's values stand.

Communication is collective over ``group``: every rank calls with the identical moves. An all-reduce first
checks that every sender owns what it must send, then three rounds of ``dist.batch_isend_irecv``:
structure sizes, structures, tensors; every rank posts all its operations of a round at once, in move
order, so a rank that both sends and receives cannot deadlock.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_dynmo.balancing.moves import UnitMove
from lightning_dynmo.pipeline.migration.optimizer import (
    OptimizerEntry,
    drop_from_optimizers,
    insert_into_optimizers,
    optimizer_entries,
    sort_param_groups,
)
from lightning_dynmo.pipeline.sharding.apply import shard_unit
from lightning_dynmo.pipeline.sharding.skeleton import unit_skeleton

log = logging.getLogger(__name__)

__all__ = ["migrate_sharded_units"]


@dataclass(frozen=True)
class _Structure:
    """What the receiver needs besides the tensors, in the order the tensors travel."""

    #: ``(name, local shape, has_grad)`` of every parameter, in ``named_parameters()`` order.
    params: list[tuple[str, tuple[int, ...], bool]]
    buffers: list[str]
    #: Optimizer entries whose tensor state values are replaced by :class:`_TensorSlot` markers.
    entries: list[OptimizerEntry]
    #: ``(shape, dtype, device type)`` of every tensor, in travel order.
    specs: list[tuple[tuple[int, ...], torch.dtype, str]]
    #: The unit's unsharded ``meta`` skeleton (:func:`~.skeleton.unit_skeleton`) when the receiver has no
    #: factory, else ``None``.
    skeleton: nn.Module | None


@dataclass(frozen=True)
class _TensorSlot:
    """Stands in a travelling optimizer state for a tensor that travels as the next payload."""

    sharded: bool


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().contiguous()


def _pack(
    name: str, unit: nn.Module, optimizers: Sequence[torch.optim.Optimizer], with_skeleton: bool
) -> tuple[_Structure, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    params = []
    for param_name, param in unit.named_parameters():
        if not isinstance(param, DTensor):
            raise TypeError(
                f"Unit {name!r} parameter {param_name!r} is not sharded (a {type(param).__name__}); "
                "migrate_sharded_units moves units sharded with shard_unit. Move unsharded units with "
                "lightning_dynmo.pipeline.migrate_units."
            )
        tensors.append(_local(param))
        has_grad = param.grad is not None
        if param.grad is not None:
            tensors.append(_local(param.grad))
        params.append((param_name, tuple(param.to_local().shape), has_grad))
    buffers = []
    for buffer_name, buffer in unit.named_buffers():
        buffers.append(buffer_name)
        tensors.append(_local(buffer))
    entries: list[OptimizerEntry] = []
    for opt_index, group_index, param_name, state, hyper in optimizer_entries(unit, optimizers):
        marked: dict[str, Any] | None = None
        if state is not None:
            marked = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    marked[key] = _TensorSlot(sharded=isinstance(value, DTensor))
                    tensors.append(_local(value))
                else:
                    marked[key] = value
        entries.append((opt_index, group_index, param_name, marked, hyper))
    specs = [(tuple(t.shape), t.dtype, t.device.type) for t in tensors]
    skeleton = unit_skeleton(unit) if with_skeleton else None
    return _Structure(params, buffers, entries, specs, skeleton), tensors


def _unpack(
    name: str,
    structure: _Structure,
    tensors: list[torch.Tensor],
    unit: nn.Module,
) -> list[OptimizerEntry]:
    """Copy the received shards into the freshly sharded ``unit``; return its optimizer entries."""
    stream = iter(tensors)
    params = dict(unit.named_parameters())
    if sorted(params) != sorted(p[0] for p in structure.params):
        raise ValueError(
            f"Unit {name!r} arrived with parameters {[p[0] for p in structure.params]} but the factory "
            f"built {sorted(params)}; build_unit({name!r}) must build the unit the sender holds."
        )
    with torch.no_grad():
        for param_name, shape, has_grad in structure.params:
            param = params[param_name]
            assert isinstance(param, DTensor)
            local = param.to_local()
            if tuple(local.shape) != shape:
                raise ValueError(
                    f"Unit {name!r} parameter {param_name!r}: the sender's shard has shape {shape}, this "
                    f"rank's {tuple(local.shape)} (shape {tuple(param.shape)} over {param.device_mesh}). A "
                    "sharded unit moves between stages whose data-parallel meshes have the same size."
                )
            local.copy_(next(stream))
            if has_grad:
                param.grad = _dtensor_like(next(stream), param)
        own_buffers = dict(unit.named_buffers())
        for buffer_name in structure.buffers:
            own_buffers[buffer_name].copy_(next(stream))
    entries: list[OptimizerEntry] = []
    for opt_index, group_index, param_name, marked, hyper in structure.entries:
        state: dict[str, Any] | None = None
        if marked is not None:
            state = {}
            for key, value in marked.items():
                if isinstance(value, _TensorSlot):
                    tensor, param = next(stream), params[param_name]
                    assert isinstance(param, DTensor)
                    state[key] = _dtensor_like(tensor, param) if value.sharded else tensor
                else:
                    state[key] = value
        entries.append((opt_index, group_index, param_name, state, hyper))
    return entries


def _dtensor_like(local: torch.Tensor, param: DTensor) -> DTensor:
    """``local`` as a shard laid out like ``param`` (same mesh, placements, global shape and stride)."""
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def migrate_sharded_units(
    moves: Sequence[UnitMove],
    local_units: Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    mesh: DeviceMesh,
    build_unit: Callable[[str], nn.Module] | None = None,
    data_parallel_rank: Callable[[int], int],
    group: dist.ProcessGroup | None = None,
    lr_schedulers: Sequence[Any] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = False,
) -> dict[str, nn.Module]:
    """Run this rank's part of ``moves`` of sharded units; return the units received, sharded.

    Collective over ``group``: every rank calls it with the identical ``moves``. A sent unit's
    parameters leave ``optimizers`` (the caller then detaches the unit from its model); a received unit's
    parameters join the optimizer group their sender's group describes, with their sharded state, and every
    group ends sorted as :func:`~lightning_dynmo.pipeline.migration.optimizer.sort_param_groups` orders it.

    Args:
        moves: The moves, identical on every rank; ranks are GLOBAL ranks. Every data-parallel replica moves
            its own shard, so a unit appears once per data-parallel rank, and ``src`` and ``dst`` of a move
            have the same data-parallel index.
        local_units: The units this rank holds now (at least those it sends), sharded with
            :func:`~.apply.shard_unit`.
        optimizers: This rank's optimizers (the same number on every rank).
        mesh: This rank's data-parallel mesh (the received units are sharded over it).
        build_unit: Builds a fresh unit by name, on the ``meta`` device (then it is materialised empty after
            sharding, costing only the shard) or a real one; its values are overwritten. ``None``
            (default): the sender's skeleton travels (:func:`~.skeleton.unit_skeleton`), so the unit
            arrives with the classes, shapes and plain attributes it has now.
        data_parallel_rank: The data-parallel index of a global rank (e.g. ``RankGrid.data_parallel_rank``).
        group: A process group holding every ``src`` and ``dst``; ``None`` means the default group.
        lr_schedulers: This rank's LR schedulers (a param_group created for a received parameter joins them).
        mp_policy: The mixed-precision policy received units are sharded with (as the stage's other units).
        reshard_after_forward: As for :func:`~.apply.shard_unit`.

    Returns:
        The units this rank received, by name, sharded and holding the sender's shards.

    Raises:
        ValueError: a move whose ``src`` equals its ``dst`` or whose ends have different data-parallel
            indices; a unit a rank must send but does not hold (raised on every rank); a received unit
            whose parameters or shard shapes differ from the sender's.
        TypeError: a unit to send whose parameters are not sharded.
    """
    for move in moves:
        if move.src == move.dst:
            raise ValueError(f"Move {move} has src == dst; drop it from the move list.")
        src_dp, dst_dp = data_parallel_rank(move.src), data_parallel_rank(move.dst)
        if src_dp != dst_dp:
            raise ValueError(
                f"Move {move}: rank {move.src} has data-parallel index {src_dp} but rank {move.dst} has "
                f"{dst_dp}. A sharded unit moves shard for shard, to the rank with the same data-parallel "
                "index on the destination stage; plan one move per data-parallel rank."
            )
    if not moves:
        return {}
    me = dist.get_rank()
    device = torch.device(mesh.device_type)
    # Pack before the agreement: a unit that cannot travel fails on every rank, not on its sender only.
    problem: Exception | None = None
    sends: list[tuple[UnitMove, _Structure, list[torch.Tensor]]] = []
    try:
        for m in moves:
            if m.src != me:
                continue
            if m.unit not in local_units:
                raise ValueError(f"rank {me} must send unit {m.unit!r} but holds {sorted(local_units)}")
            sends.append((m, *_pack(m.unit, local_units[m.unit], optimizers, build_unit is None)))
    except (TypeError, ValueError) as error:
        problem = error
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, group=group)
    if problem is not None:
        raise problem
    if int(flag) > 0:
        raise ValueError(
            f"migrate_sharded_units: {int(flag)} rank(s) could not pack the units they must send (their "
            "errors name the units); every rank must call with the same moves, planned from the current "
            "placement."
        )

    receives = [m for m in moves if m.dst == me]

    blobs = [torch.frombuffer(bytearray(pickle.dumps(s)), dtype=torch.uint8).to(device) for _, s, _ in sends]
    sizes_out = [torch.tensor([b.numel()], dtype=torch.int64, device=device) for b in blobs]
    sizes_in = [torch.zeros(1, dtype=torch.int64, device=device) for _ in receives]
    _exchange(
        [(t, m.dst) for (m, _, _), t in zip(sends, sizes_out, strict=True)],
        [(t, m.src) for m, t in zip(receives, sizes_in, strict=True)],
        group,
    )
    blobs_in = [torch.empty(int(n), dtype=torch.uint8, device=device) for n in sizes_in]
    _exchange(
        [(b, m.dst) for (m, _, _), b in zip(sends, blobs, strict=True)],
        [(b, m.src) for m, b in zip(receives, blobs_in, strict=True)],
        group,
    )
    structures: list[_Structure] = [pickle.loads(b.cpu().numpy().tobytes()) for b in blobs_in]
    payloads_in = [
        [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, _ in s.specs] for s in structures
    ]
    _exchange(
        [(t.to(device), m.dst) for m, _, tensors in sends for t in tensors],
        [(t, m.src) for m, tensors in zip(receives, payloads_in, strict=True) for t in tensors],
        group,
    )

    drop_from_optimizers({m.unit: local_units[m.unit] for m, _, _ in sends}, optimizers)
    received: dict[str, nn.Module] = {}
    for move, structure, tensors in zip(receives, structures, payloads_in, strict=True):
        unit = build_unit(move.unit) if build_unit is not None else structure.skeleton
        assert unit is not None
        shard_unit(unit, mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
        if any(t.is_meta for t in [*unit.parameters(), *unit.buffers()]):
            unit.to_empty(device=device)
        on_origin = [t.to(spec[2]) for t, spec in zip(tensors, structure.specs, strict=True)]
        entries = _unpack(move.unit, structure, on_origin, unit)
        insert_into_optimizers(move.unit, unit, entries, optimizers, lr_schedulers)
        received[move.unit] = unit
    sent = {m.unit for m, _, _ in sends}
    known = {k: v for k, v in local_units.items() if k not in sent} | received
    sort_param_groups(known, optimizers)
    log.debug("migrated sharded units: sent %s, received %s", sorted(sent), sorted(received))
    return received


def _exchange(
    outgoing: list[tuple[torch.Tensor, int]],
    incoming: list[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None,
) -> None:
    """One round: post every send and receive at once, wait for all."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in outgoing]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in incoming]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
