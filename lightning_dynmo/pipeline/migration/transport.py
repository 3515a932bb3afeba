"""Exact live migration of named units (transformer blocks, embedding, head) between ranks.

Read in this order: :class:`UnitMove` and :func:`migrate_units` (the contract the strategy calls), then
:func:`pack_unit` / :func:`unpack_unit` (how one unit becomes bytes plus tensors and back), then the
transport helpers at the bottom.

How a unit travels. There is no layer factory: the receiver rebuilds the module from what the sender
sends. The module object graph (classes, plain attributes such as a ``frozen`` flag, sub-modules) is
pickled with every tensor replaced by a placeholder; that small *structure* goes over the wire as a uint8
tensor. The tensors (parameters, buffers, ``.grad``, optimizer state) then go as separate point-to-point
messages on ``device`` so that NCCL moves device memory directly; on CPU/gloo the same code runs. Tensors
that share storage inside a unit (tied weights, views) are sent once as their common storage span and
rebuilt as views of it, so the sharing survives. Forward/backward and tensor hooks do not travel: a unit
with hooks a user registered is refused, the profiler's own are left behind, and parametrized modules are
rebuilt on arrival (:mod:`lightning_dynmo.pipeline.model.unit_state`); ``state_dict`` hooks travel.

Optimizer state. A sent parameter is removed from every optimizer's ``param_groups`` and its state is
dropped; a received parameter joins the param_group with the hyper-parameters of its sender-side group
(the same index when that one matches; ranks may build different groups, see
:mod:`.param_groups`) with its full state (tensor and non-tensor values alike).
Optimizers are edited in place because Lightning and LR schedulers hold the optimizer objects. Inside a
param_group, parameters end in a deterministic order: parameters that belong to no known unit first (in
their previous relative order), then unit parameters sorted by the natural order of the unit name
(``layers.2`` before ``layers.10``) and then by their position in the unit's ``named_parameters()``.
Known units are those in ``local_units`` plus those received.

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
import io
import logging
import pickle
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.pipeline.migration.param_groups import group_for
from lightning_dynmo.pipeline.model.unit_state import check_no_user_hooks, reduce_parametrized

log = logging.getLogger(__name__)

__all__ = [
    "MigrationReport",
    "PackedUnit",
    "UnitMove",
    "group_ranks",
    "migrate_units",
    "pack_unit",
    "unit_sort_key",
    "unpack_unit",
]

# Forward/backward hooks never travel; user hooks are refused before packing (unit_state), so what is
# left are the profiler's (runtime instrumentation of the sending rank). The receiver gets empty
# tables of the type torch uses (OrderedDict: hook handles keep weak references to the tables, which a
# plain dict does not support), so hooks can be registered on a migrated unit as on any other.
_RUNTIME_HOOK_ATTRS: dict[str, Callable[[], Any]] = {
    "_forward_hooks": OrderedDict,
    "_forward_hooks_with_kwargs": OrderedDict,
    "_forward_hooks_always_called": OrderedDict,
    "_forward_pre_hooks": OrderedDict,
    "_forward_pre_hooks_with_kwargs": OrderedDict,
    "_backward_hooks": OrderedDict,
    "_backward_pre_hooks": OrderedDict,
    "_is_full_backward_hook": lambda: None,
}
_FORMAT = "lightning_dynmo.unit/1"


# ----------------------------------------------------------------------------------------------------
# Public contract
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitMove:
    """One unit changing owner.

    Args:
        name: the unit's global name, e.g. ``"layers.7"``, ``"embed"`` or ``"head"``.
        src: GLOBAL rank that owns the unit now.
        dst: GLOBAL rank that will own it.
    """

    name: str
    src: int
    dst: int


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
                packed[move.name] = pack_unit(move.name, local_units[move.name], optimizers, device=device)
    except (ValueError, TypeError) as err:
        local_error = err
    _agree(moves, local_error, device=device, group=group, members=members)

    received, sent_bytes, recv_bytes = _exchange(moves, packed, rank, device=device, group=group)

    sent_units = {m.name: local_units[m.name] for m in moves if m.src == rank}
    _drop_from_optimizers(sent_units, optimizers)
    modules: dict[str, nn.Module] = {}
    insert_error: Exception | None = None
    try:
        for name, (module, optim_entries) in received.items():
            modules[name] = module
            _insert_into_optimizers(name, module, optim_entries, optimizers, lr_schedulers)
    except (ValueError, TypeError) as err:
        insert_error = err
    # Every rank learns whether every receiver took its units in, so none trains on alone.
    _agree(moves, insert_error, device=device, group=group, members=members, after_transfer=True)
    if modules:  # removal keeps the order; only insertion needs sorting
        known = {**{k: v for k, v in local_units.items() if k not in sent_units}, **modules}
        _sort_param_groups(known, optimizers)

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


def unit_sort_key(name: str) -> tuple[Any, ...]:
    """Natural sort key of a unit or parameter name: ``layers.2`` sorts before ``layers.10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


# ----------------------------------------------------------------------------------------------------
# Packing one unit
# ----------------------------------------------------------------------------------------------------


@dataclass
class PackedUnit:
    """One unit ready to travel: a small pickled structure plus the tensors it refers to.

    Args:
        structure: pickled bytes (module graph with tensor placeholders, tensor specs, optimizer entries).
        payloads: contiguous tensors on the transport device, in the order the receiver allocates them.
            Empty tensors are listed too but never sent (``payload_nbytes`` skips them).
    """

    structure: bytes
    payloads: list[torch.Tensor] = field(default_factory=list)

    @property
    def payload_nbytes(self) -> int:
        """Total bytes of the tensor payloads."""
        return sum(t.numel() * t.element_size() for t in self.payloads)


def pack_unit(
    name: str,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    *,
    device: torch.device | None = None,
) -> PackedUnit:
    """Serialize ``module`` and the optimizer state of its parameters without changing either.

    Args:
        name: the unit name, used in error messages.
        module: the unit.
        optimizers: optimizers whose param_groups may hold the unit's parameters.
        device: transport device for the payloads; ``None`` keeps each tensor where it is.

    Returns:
        The packed unit; :func:`unpack_unit` turns it back into an identical module.

    Raises:
        TypeError: if something in the unit cannot travel; the message names the attribute and the fix.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"local_units[{name!r}] must be an nn.Module, got {type(module).__name__}. "
            "Pass the unit modules themselves (e.g. model.layers['7'])."
        )
    check_no_user_hooks({name: module})  # hooks do not travel: state kept in one would be lost
    registry = _TensorRegistry(name, device)
    record = {
        "format": _FORMAT,
        "module": module,
        "optim": _optimizer_entries(module, optimizers),
    }
    body, specs, payloads = _dumps_checked(name, module, record, registry)
    structure = pickle.dumps({"specs": specs, "body": body}, protocol=pickle.HIGHEST_PROTOCOL)
    return PackedUnit(structure=structure, payloads=payloads)


def unpack_unit(
    structure: bytes, payloads: Sequence[torch.Tensor], *, device: torch.device | None = None
) -> tuple[nn.Module, list[tuple[int, int, str, dict[str, Any] | None, dict[str, Any]]]]:
    """Rebuild a unit from :func:`pack_unit`'s output.

    Args:
        structure: the packed structure bytes.
        payloads: the payload tensors (as received, in order).
        device: where tensors that lived on the sender's compute device are placed; ``None`` keeps them
            on the payloads' device.

    Returns:
        ``(module, optimizer_entries)`` where each entry is
        ``(optimizer_index, group_index, param_name, state_or_None, group_hyperparameters)``.
    """
    outer = pickle.loads(structure)
    tensors = _rebuild_tensors(outer["specs"], payloads, device)
    record = _Unpickler(io.BytesIO(outer["body"]), tensors).load()
    if record.get("format") != _FORMAT:
        raise ValueError(f"Unknown unit format {record.get('format')!r}; expected {_FORMAT!r}.")
    return record["module"], record["optim"]


def _optimizer_entries(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
) -> list[tuple[int, int, str, dict[str, Any] | None, dict[str, Any]]]:
    """Where each of the unit's parameters sits in the optimizers, with its state and group settings."""
    entries = []
    for param_name, param in module.named_parameters():
        for opt_index, optimizer in enumerate(optimizers):
            for group_index, group in enumerate(optimizer.param_groups):
                if any(p is param for p in group["params"]):
                    state = optimizer.state.get(param)
                    hyper = {k: v for k, v in group.items() if k != "params"}
                    entries.append(
                        (opt_index, group_index, param_name, dict(state) if state else None, hyper)
                    )
    return entries


class _TensorRegistry:
    """Assigns placeholders to tensors while pickling and later lays out their payloads.

    Tensors sharing a storage are grouped: the group travels once as the span of storage they cover,
    and each tensor is rebuilt as a view of it (offset, shape, stride), so tied weights stay tied.
    """

    def __init__(self, unit: str, device: torch.device | None) -> None:
        self.unit = unit
        self.device = device
        self.tensors: list[torch.Tensor] = []
        self.index: dict[int, int] = {}
        self.extra: list[dict[str, Any]] = []

    def placeholder(self, tensor: torch.Tensor) -> int:
        key = id(tensor)
        if key in self.index:
            return self.index[key]
        self._check_travels(tensor)
        idx = len(self.tensors)
        self.index[key] = idx
        self.tensors.append(tensor)
        extra: dict[str, Any] = {"param": isinstance(tensor, nn.Parameter), "grad": None}
        self.extra.append(extra)
        if extra["param"] and tensor.grad is not None:
            extra["grad"] = self.placeholder(tensor.grad)
        return idx

    def _check_travels(self, tensor: torch.Tensor) -> None:
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            raise _TravelError(
                tensor, f"a tensor subclass {type(tensor).__name__}", "convert it to a plain tensor"
            )
        if tensor.layout != torch.strided:
            raise _TravelError(tensor, f"a {tensor.layout} tensor", "store it dense (strided)")
        if tensor.grad_fn is not None:
            raise _TravelError(
                tensor, "a tensor attached to an autograd graph", "detach it or clear it before migrating"
            )

    def layout(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Specs (pickled with the structure) and payloads (sent as tensors) for the tensors seen."""
        groups: dict[Any, list[int]] = {}
        for i, t in enumerate(self.tensors):
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr()) if storage.nbytes() > 0 else ("empty", i)
            groups.setdefault(key, []).append(i)
        buffers: list[dict[str, Any]] = []
        views: list[dict[str, Any]] = [{} for _ in self.tensors]
        payloads: list[torch.Tensor] = []
        for members in groups.values():
            first = self.tensors[members[0]].detach()
            if len(members) == 1:
                payload, base = first.contiguous(), None
            else:
                payload, base = self._span(members)
            buf_index = len(buffers)
            buffers.append(
                {
                    "numel": payload.numel(),
                    "dtype": payload.dtype,
                    "cpu": first.device.type == "cpu" and (self.device is None or self.device.type != "cpu"),
                }
            )
            payloads.append(payload if self.device is None else payload.to(self.device))
            for i in members:
                t = self.tensors[i]
                views[i] = {
                    "buffer": buf_index,
                    "view": None if base is None else (t.storage_offset() - base, tuple(t.shape), t.stride()),
                    "shape": tuple(t.shape),
                    "requires_grad": t.requires_grad,
                    **self.extra[i],
                }
        return {"buffers": buffers, "tensors": views}, payloads

    def _span(self, members: list[int]) -> tuple[torch.Tensor, int]:
        """The smallest storage span covering every tensor of a shared-storage group, as one flat tensor."""
        tensors = [self.tensors[i].detach() for i in members]
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise _TravelError(
                self.tensors[members[0]],
                f"tensors of different dtypes {sorted(map(str, dtypes))} sharing one storage",
                "give each its own storage (.clone()) before migrating",
            )
        lo = int(min(t.storage_offset() for t in tensors))
        hi = int(max(t.storage_offset() + _extent(t) for t in tensors))
        flat = torch.as_strided(tensors[0], (hi - lo,), (1,), lo)
        return flat.clone(), lo


def _extent(t: torch.Tensor) -> int:
    """Number of storage elements from a tensor's offset to its last element (inclusive)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


class _TravelError(Exception):
    """Raised inside pickling; turned into a TypeError that names the unit attribute."""

    def __init__(self, obj: Any, what: str, fix: str) -> None:
        super().__init__(what)
        self.obj, self.what, self.fix = obj, what, fix


class _Pickler(pickle.Pickler):
    """Pickler that swaps tensors for placeholders and strips runtime hooks from modules."""

    def __init__(self, file: io.BytesIO, registry: _TensorRegistry) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.registry = registry

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return ("tensor", self.registry.placeholder(obj))
        return None

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, nn.Module):
            return NotImplemented
        parametrized = reduce_parametrized(obj, _without_runtime_hooks(obj.__dict__))
        if parametrized is not None:
            return parametrized
        reduced = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        if not (isinstance(reduced, tuple) and len(reduced) >= 3 and isinstance(reduced[2], dict)):
            return NotImplemented
        return (reduced[0], reduced[1], _without_runtime_hooks(reduced[2]), *reduced[3:])


def _without_runtime_hooks(state: dict[str, Any]) -> dict[str, Any]:
    # A copy of the state: the sender's module keeps its hooks while it is still in use.
    state = dict(state)
    for attr, empty in _RUNTIME_HOOK_ATTRS.items():
        if attr in state:
            state[attr] = empty()
    return state


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        kind, index = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown placeholder {pid!r}")
        return self.tensors[index]


def _dumps_checked(
    name: str, module: nn.Module, record: Any, registry: _TensorRegistry
) -> tuple[bytes, dict[str, Any], list[torch.Tensor]]:
    """Pickle ``record`` and lay out its tensors; on failure raise a TypeError naming the attribute."""
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, registry).dump(record)
        specs, payloads = registry.layout()
    except Exception as err:  # any pickling failure: locate it for a useful message
        path, culprit = _find_culprit(module, err.obj if isinstance(err, _TravelError) else None)
        what = err.what if isinstance(err, _TravelError) else f"an unpicklable {type(culprit).__name__}"
        fix = (
            err.fix
            if isinstance(err, _TravelError)
            else "make it picklable, keep it outside the module, or delete it before migrating "
            "(forward/backward hooks are stripped automatically; re-register them on the receiving rank)"
        )
        where = (
            f"attribute {path!r}"
            if path
            else f"the module itself (class {type(module).__qualname__}) or its optimizer state"
        )
        raise TypeError(f"Cannot migrate unit {name!r}: {where} holds {what} ({err}). Fix: {fix}.") from err
    return buffer.getvalue(), specs, payloads


def _find_culprit(module: nn.Module, obj: Any) -> tuple[str, Any]:
    """Dotted path of the attribute holding ``obj``, else of the first attribute that cannot be packed."""
    attributes = list(_walk(module, ""))
    for path, value in attributes:
        if obj is not None and value is obj:
            return path, value
    for path, value in attributes:
        probe = _TensorRegistry("probe", None)
        try:
            _Pickler(io.BytesIO(), probe).dump(value)
            probe.layout()
        except Exception:
            return path, value
    return "", None


def _walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, Any]]:
    """(path, value) of a module's own attributes, recursing into sub-modules first."""
    for child_name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{child_name}.")
    for key in ("_parameters", "_buffers"):
        for attr, value in module.__dict__[key].items():
            yield f"{prefix}{attr}", value
    for attr, value in module.__dict__.items():
        if attr not in _RUNTIME_HOOK_ATTRS and attr not in ("_modules", "_parameters", "_buffers"):
            yield f"{prefix}{attr}", value


def _rebuild_tensors(
    specs: dict[str, Any], payloads: Sequence[torch.Tensor], device: torch.device | None
) -> list[torch.Tensor]:
    bases = []
    for spec, payload in zip(specs["buffers"], payloads, strict=True):
        bases.append(payload.cpu() if spec["cpu"] else payload if device is None else payload.to(device))
    tensors: list[torch.Tensor] = []
    for spec in specs["tensors"]:
        base = bases[spec["buffer"]]
        if spec["view"] is None:
            t = base.view(spec["shape"])
        else:
            offset, shape, stride = spec["view"]
            t = base.as_strided(shape, stride, base.storage_offset() + offset)
        if spec["param"]:
            t = nn.Parameter(t, requires_grad=spec["requires_grad"])
        elif spec["requires_grad"]:
            t = t.requires_grad_(True)
        tensors.append(t)
    for t, spec in zip(tensors, specs["tensors"], strict=True):
        if spec["grad"] is not None:
            t.grad = tensors[spec["grad"]]
    return tensors


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------


def _check_moves(moves: tuple[Any, ...]) -> None:
    """Checks every rank can do on its own and reaches the same verdict on."""
    seen: set[tuple[str, str, int]] = set()
    for i, move in enumerate(moves):
        if not isinstance(move, UnitMove):
            raise TypeError(f"moves[{i}] must be a UnitMove, got {type(move).__name__}: {move!r}.")
        if move.src == move.dst:
            raise ValueError(
                f"moves[{i}] = {move!r} has src == dst ({move.src}): a unit that stays needs no move. "
                "Leave it out of the move list."
            )
        ends = {(move.name, "src", move.src), (move.name, "dst", move.dst)}
        if ends & seen:
            raise ValueError(
                f"moves[{i}] = {move!r}: unit {move.name!r} appears more than once in moves from or to the "
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
        if move.src == rank and move.name not in local_units:
            raise ValueError(
                f"moves[{i}] = {move!r}: rank {rank} must send unit {move.name!r} but local_units does not "
                f"hold it (it holds {sorted(local_units, key=unit_sort_key)}). The move list must use the "
                "current owners; pass every unit this rank owns."
            )
        if move.dst == rank and move.name in local_units:
            raise ValueError(
                f"moves[{i}] = {move!r}: rank {rank} is the destination of unit {move.name!r} but already "
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
    text = ";".join(f"{m.name}:{m.src}>{m.dst}" for m in moves)
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
        m.name: torch.tensor([len(packed[m.name].structure)], dtype=torch.int64, device=device)
        for m in sending
    }
    sizes_in = {m.name: torch.empty(1, dtype=torch.int64, device=device) for m in receiving}
    _run_round(moves, rank, sizes_out, sizes_in, group)
    sent += 8 * len(sending)
    received += 8 * len(receiving)

    structs_out = {
        m.name: torch.frombuffer(bytearray(packed[m.name].structure), dtype=torch.uint8).to(device)
        for m in sending
    }
    structs_in = {
        m.name: torch.empty(int(sizes_in[m.name]), dtype=torch.uint8, device=device) for m in receiving
    }
    _run_round(moves, rank, structs_out, structs_in, group)
    sent += sum(t.numel() for t in structs_out.values())
    received += sum(t.numel() for t in structs_in.values())

    structures = {name: bytes(t.cpu().numpy()) for name, t in structs_in.items()}
    payloads_in = {name: _allocate_payloads(s, device) for name, s in structures.items()}
    payload_out: dict[str, list[torch.Tensor]] = {m.name: packed[m.name].payloads for m in sending}
    _run_round(moves, rank, payload_out, payloads_in, group)
    sent += sum(packed[m.name].payload_nbytes for m in sending)
    received += sum(t.numel() * t.element_size() for ts in payloads_in.values() for t in ts)

    units = {name: unpack_unit(structures[name], payloads_in[name], device=device) for name in structures}
    return units, sent, received


def _allocate_payloads(structure: bytes, device: torch.device) -> list[torch.Tensor]:
    specs = pickle.loads(structure)["specs"]
    return [torch.empty(b["numel"], dtype=b["dtype"], device=device) for b in specs["buffers"]]


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
            for t in _listed(outgoing[move.name]):
                if t.numel():
                    ops.append(dist.P2POp(dist.isend, _as_bytes(t), peer=move.dst, group=group))
        elif move.dst == rank:
            for t in _listed(incoming[move.name]):
                if t.numel():
                    ops.append(dist.P2POp(dist.irecv, _as_bytes(t), peer=move.src, group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _listed(x: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return x if isinstance(x, list) else [x]


# ----------------------------------------------------------------------------------------------------
# Optimizer editing (in place)
# ----------------------------------------------------------------------------------------------------


def _drop_from_optimizers(
    units: Mapping[str, nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    gone = {id(p) for unit in units.values() for p in unit.parameters()}
    if not gone:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"][:] = [p for p in group["params"] if id(p) not in gone]
        for p in [p for p in optimizer.state if id(p) in gone]:
            del optimizer.state[p]


def _insert_into_optimizers(
    name: str,
    module: nn.Module,
    entries: list[tuple[int, int, str, dict[str, Any] | None, dict[str, Any]]],
    optimizers: Sequence[torch.optim.Optimizer],
    lr_schedulers: Sequence[Any],
) -> None:
    params = dict(module.named_parameters())
    for opt_index, group_index, param_name, state, hyper in entries:
        if opt_index >= len(optimizers):
            raise ValueError(
                f"Unit {name!r} parameter {param_name!r} was in optimizers[{opt_index}] on the sender, but "
                f"this rank has {len(optimizers)} optimizer(s). Every rank must build the same optimizers."
            )
        what = f"unit {name!r} parameter {param_name!r}"
        group = group_for(optimizers[opt_index], group_index, hyper, lr_schedulers, what)
        param = params[param_name]
        group["params"].append(param)
        if state is not None:
            optimizers[opt_index].state[param] = state


def _sort_param_groups(known: Mapping[str, nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Deterministic order: foreign params first (stable), then unit params by (unit name, position)."""
    order: dict[int, tuple[Any, ...]] = {}
    for unit_name, unit in known.items():
        for position, param in enumerate(unit.parameters()):
            order.setdefault(id(param), (unit_sort_key(unit_name), position))
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = group["params"]
            foreign = [p for p in params if id(p) not in order]
            ours = sorted((p for p in params if id(p) in order), key=lambda p: order[id(p)])
            params[:] = foreign + ours
