"""One unit as bytes plus tensors and back: :func:`pack_unit`, :func:`unpack_unit` and their pickler.

Read in this order: :class:`PackedUnit`, :func:`pack_unit` and :func:`unpack_unit`, then the tensor
registry and the pickler below them.

There is no layer factory: the receiver rebuilds the module from what the sender sends. The module object
graph (classes, plain attributes such as a ``frozen`` flag, sub-modules) is pickled with every tensor
replaced by a placeholder; that small *structure* travels as bytes. The tensors (parameters, buffers,
``.grad``, optimizer state) become separate *payloads* on the transport device so that NCCL can move
device memory directly. Tensors that share storage inside a unit (tied weights, views) travel once as
their common storage span and are rebuilt as views of it, so the sharing survives. Forward/backward and
tensor hooks do not travel: a unit with hooks a user registered is refused, the profiler's own are left
behind, and parametrized modules are rebuilt on arrival (:mod:`lightning_dynmo.pipeline.model.unit_state`);
``state_dict`` hooks travel.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_dynmo.pipeline.migration.optimizer import OptimizerEntry, optimizer_entries
from lightning_dynmo.pipeline.model.compiled import without_compiled_forward
from lightning_dynmo.pipeline.model.unit_state import check_no_user_hooks, reduce_parametrized

__all__ = ["PackedUnit", "allocate_payloads", "pack_unit", "unpack_unit"]

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
        "optim": optimizer_entries(module, optimizers),
    }
    body, specs, payloads = _dumps_checked(name, module, record, registry)
    structure = pickle.dumps({"specs": specs, "body": body}, protocol=pickle.HIGHEST_PROTOCOL)
    return PackedUnit(structure=structure, payloads=payloads)


def unpack_unit(
    structure: bytes, payloads: Sequence[torch.Tensor], *, device: torch.device | None = None
) -> tuple[nn.Module, list[OptimizerEntry]]:
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


def allocate_payloads(structure: bytes, device: torch.device) -> list[torch.Tensor]:
    """Empty payload tensors on ``device`` for a received structure, to receive its tensors into."""
    specs = pickle.loads(structure)["specs"]
    return [torch.empty(b["numel"], dtype=b["dtype"], device=device) for b in specs["buffers"]]


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
    # A copy of the state: the sender's module keeps its hooks while it is still in use. A forward
    # compiled by DynMo stays behind too: the receiver compiles the block anew (pipeline.model.compiled).
    state = dict(without_compiled_forward(state))
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
            if attr == "forward" and not without_compiled_forward({attr: value}):
                continue  # a forward compiled by DynMo does not travel
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
