"""Placement-independent training state: every unit's tensors and optimizer state keyed by global name.

Read in this order: :class:`FullState` (the format), :func:`gather_full_state` (collect it on one rank),
:func:`load_local_state` (load it into whatever units a rank owns under any placement), then the helpers.

Format (plain dicts of CPU tensors, so it can live inside a Lightning checkpoint written by ``torch.save``)::

    {
      "format": "lightning_dynmo.full_state/1",
      "units": ["embed", "layers.0", ..., "head"],
      "model": {"layers.7.fc1.weight": Tensor, "layers.7._extra_state": {...}, ...},
      "optimizer": [                                   # one entry per optimizer
        {"param_groups": [{"lr": ..., "weight_decay": ...}, ...],   # hyper-parameters, no "params"
         "param_group_of": {"layers.7.fc1.weight": 0, ...},          # every param the optimizer holds
         "state": {"layers.7.fc1.weight": {"step": Tensor, "exp_avg": Tensor, ...}, ...}},
      ],
    }

``model`` has exactly the keys of the single-process model's ``state_dict()`` (unit name + "." + the
unit's own ``state_dict`` key). Optimizer state is keyed by the same parameter FQNs instead of torch's
positional ids, so it survives any change of placement or pipeline size.

Extra per-unit state. Non-tensor state of a unit (a freezing flag, router statistics, a call counter)
is saved through torch's own protocol: a module that defines ``get_extra_state()`` / ``set_extra_state()``
gets an ``"<prefix>_extra_state"`` entry in its ``state_dict`` and receives it back on load. Note that a
live migration (:mod:`~lightning_dynmo.pipeline.migration`) carries plain attributes even without this
protocol; a checkpoint only carries what ``state_dict`` carries (parameters, persistent buffers, extra
state).

Why not ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``/``set_...``: they key state
by FQN too, but expect one ``nn.Module`` whose FQNs match (our units are named ``layers.7``, which no
``ModuleDict`` key may contain), and ``set_optimizer_state_dict`` first initialises missing state by running
``optimizer.step()`` on zero gradients, which gives parameters that had no state a ``step`` of 1 instead of
leaving them untouched. The conversion we need is a few lines of exact dictionary work.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_dynmo.pipeline.migration.transport import group_ranks

log = logging.getLogger(__name__)

__all__ = [
    "FULL_STATE_FORMAT",
    "FullState",
    "OptimizerFullState",
    "gather_full_state",
    "load_local_state",
    "local_full_state",
    "merge_full_states",
]

FULL_STATE_FORMAT = "lightning_dynmo.full_state/1"


class OptimizerFullState(TypedDict):
    """One optimizer's state keyed by parameter FQN."""

    param_groups: list[dict[str, Any]]
    param_group_of: dict[str, int]
    state: dict[str, dict[str, Any]]


class FullState(TypedDict):
    """Every unit's parameters, buffers, extra state and optimizer state, keyed by global FQN."""

    format: str
    units: list[str]
    model: dict[str, Any]
    optimizer: list[OptimizerFullState]


def gather_full_state(
    local_units: Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    dst: int,
    group: dist.ProcessGroup | None = None,
) -> FullState | None:
    """Collective over ``group``: rank ``dst`` receives every unit's state, the other ranks get ``None``.

    Ranks may own any units (a unit owned by several ranks, e.g. data-parallel replicas, is taken from
    the lowest group rank that owns it). A released rank that owns nothing still takes part.

    Args:
        local_units: the units this rank owns, keyed by global unit name.
        optimizers: this rank's optimizers (the same number and param_group layout on every rank).
        dst: GLOBAL rank that receives the full state.
        group: process group; ``None`` means the default group.

    Returns:
        The :class:`FullState` (tensors on CPU) on ``dst``, ``None`` elsewhere.

    Raises:
        ValueError: if ``dst`` is not in ``group`` or an optimizer holds a parameter of no unit.
    """
    members = group_ranks(group)
    if dst not in members:
        raise ValueError(
            f"gather_full_state: dst={dst} is not in the process group (ranks {members}). Pass a GLOBAL "
            "rank that belongs to the group."
        )
    part = local_full_state(local_units, optimizers)
    parts: list[Any] | None = [None] * len(members) if dist.get_rank() == dst else None
    dist.gather_object(part, parts, dst=dst, group=group)
    if parts is None:
        return None
    return merge_full_states(parts)


def local_full_state(
    local_units: Mapping[str, nn.Module], optimizers: Sequence[torch.optim.Optimizer], *, copy: bool = True
) -> FullState:
    """This rank's part of the full state (a complete one on a single process), detached.

    Args:
        local_units: the units this rank owns, keyed by global unit name.
        optimizers: this rank's optimizers.
        copy: tensors are CPU copies (a state to keep); ``False`` gives the live tensors, detached, where
            they are (a state to write out at once, e.g. by a sharded save, without a second copy).

    Raises:
        ValueError: if an optimizer holds a parameter that belongs to none of ``local_units``.
    """
    convert = _to_cpu if copy else _detached
    model: dict[str, Any] = {}
    for unit_name, unit in local_units.items():
        for key, value in unit.state_dict().items():
            model[f"{unit_name}.{key}"] = convert(value)
    names = _param_names(local_units)
    opt_states = [_optimizer_full_state(k, opt, names, convert) for k, opt in enumerate(optimizers)]
    return FullState(format=FULL_STATE_FORMAT, units=list(local_units), model=model, optimizer=opt_states)


def merge_full_states(parts: Sequence[FullState]) -> FullState:
    """Merge per-rank parts; for a key present in several parts the first part wins.

    Raises:
        ValueError: if the parts disagree on format, number of optimizers or param_groups.
    """
    if not parts:
        raise ValueError("merge_full_states needs at least one part, got none.")
    layouts = {(p["format"], tuple(len(o["param_groups"]) for o in p["optimizer"])) for p in parts}
    if len(layouts) != 1:
        raise ValueError(
            f"Cannot merge full-state parts with different formats or optimizer layouts: {sorted(layouts)}. "
            "Every rank must build the same optimizers with the same param_groups."
        )
    units: list[str] = []
    model: dict[str, Any] = {}
    optimizers = [
        OptimizerFullState(param_groups=copy.deepcopy(o["param_groups"]), param_group_of={}, state={})
        for o in parts[0]["optimizer"]
    ]
    for part in parts:
        units += [u for u in part["units"] if u not in units]
        for key, value in part["model"].items():
            model.setdefault(key, value)
        for merged, opt in zip(optimizers, part["optimizer"], strict=True):
            for fqn, index in opt["param_group_of"].items():
                merged["param_group_of"].setdefault(fqn, index)
            for fqn, state in opt["state"].items():
                merged["state"].setdefault(fqn, state)
    return FullState(format=parts[0]["format"], units=units, model=model, optimizer=optimizers)


def load_local_state(
    full: Mapping[str, Any],
    local_units: Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Load the state of the units this rank owns (any placement) from ``full``, in place, exactly.

    Parameters and buffers are copied into the existing tensors (the optimizer keeps pointing at them);
    ``set_extra_state`` receives a copy of the saved extra state; each optimizer gets the saved param_group
    hyper-parameters and, for every parameter of ``local_units`` it holds, exactly the saved state (none if
    none was saved).

    Args:
        full: a :class:`FullState` (e.g. from :func:`gather_full_state`, possibly after ``torch.load``).
        local_units: the units this rank owns, keyed by global unit name.
        optimizers: this rank's optimizers, built like the ones that were saved.
        aliases: another name to look a parameter's optimizer state up under when the full state has
            none under its own (a tied parameter saved by a single process under its first name).

    Raises:
        ValueError: unknown format, a unit or parameter missing from ``full``, a shape mismatch, a different
            number of optimizers or param_groups, or a parameter in another param_group than when saved.
    """
    if not isinstance(full, Mapping) or full.get("format") != FULL_STATE_FORMAT:
        got = full.get("format") if isinstance(full, Mapping) else type(full).__name__
        raise ValueError(
            f"load_local_state: full state format {got!r} is not {FULL_STATE_FORMAT!r}. Pass the dict "
            "produced by gather_full_state (or local_full_state)."
        )
    for unit_name, unit in local_units.items():
        _load_unit(unit_name, unit, full["model"], full.get("units", []))
    saved_opts = full["optimizer"]
    if len(saved_opts) != len(optimizers):
        raise ValueError(
            f"load_local_state: the full state has {len(saved_opts)} optimizer(s) but {len(optimizers)} were "
            "passed. Build the same optimizers as when saving (configure_optimizers)."
        )
    names = _param_names(local_units)
    for k, (optimizer, saved) in enumerate(zip(optimizers, saved_opts, strict=True)):
        _load_optimizer(k, optimizer, saved, names, aliases or {})


# ----------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------


def _to_cpu(value: Any) -> Any:
    """A detached CPU copy of a (nested) value, so the saved state never aliases live tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)


def _detached(value: Any) -> Any:
    """The live tensors of a (nested) value, detached; other values deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_detached(v) for v in value)
    return copy.deepcopy(value)


def _param_names(units: Mapping[str, nn.Module]) -> dict[int, str]:
    """id(parameter) -> global FQN (a tied parameter keeps its first name, as ``state_dict`` order does)."""
    names: dict[int, str] = {}
    for unit_name, unit in units.items():
        for name, param in unit.named_parameters():
            names.setdefault(id(param), f"{unit_name}.{name}")
    return names


def _optimizer_full_state(
    k: int, optimizer: torch.optim.Optimizer, names: Mapping[int, str], convert: Callable[[Any], Any]
) -> OptimizerFullState:
    groups, group_of, state = [], {}, {}
    for i, group in enumerate(optimizer.param_groups):
        groups.append({key: _to_cpu(v) for key, v in group.items() if key != "params"})
        for param in group["params"]:
            fqn = names.get(id(param))
            if fqn is None:
                raise ValueError(
                    f"optimizers[{k}].param_groups[{i}] holds a parameter of shape {tuple(param.shape)} that "
                    "belongs to none of local_units, so it has no global name. Pass every unit whose "
                    "parameters the optimizer holds."
                )
            group_of[fqn] = i
            if optimizer.state.get(param):
                state[fqn] = convert(dict(optimizer.state[param]))
    return OptimizerFullState(param_groups=groups, param_group_of=group_of, state=state)


def _load_unit(unit_name: str, unit: nn.Module, model: Mapping[str, Any], saved_units: Sequence[str]) -> None:
    prefix = f"{unit_name}."
    own = {key[len(prefix) :]: value for key, value in model.items() if key.startswith(prefix)}
    if not own and unit.state_dict():
        raise ValueError(
            f"load_local_state: the full state has no entries for unit {unit_name!r} (it holds units "
            f"{list(saved_units)}). Load a full state saved from the same model."
        )
    # Copies for extra state: set_extra_state may keep the object, and the checkpoint must stay pristine.
    own = {k: v if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in own.items()}
    current = unit.state_dict()
    own = {k: _shard_like(current.get(k), v) for k, v in own.items()}
    try:
        unit.load_state_dict(own, strict=True)
    except RuntimeError as err:
        raise ValueError(
            f"load_local_state: unit {unit_name!r} does not match the saved state: {err}. Resume with the "
            "same model definition as when saving."
        ) from err


def _load_optimizer(
    k: int,
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    names: Mapping[int, str],
    aliases: Mapping[str, str],
) -> None:
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"load_local_state: optimizers[{k}] has {len(optimizer.param_groups)} param_groups but the full "
            f"state has {len(saved['param_groups'])}. Build the param_groups as when saving (empty is fine)."
        )
    for i, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved["param_groups"], strict=True)):
        group.update(copy.deepcopy(saved_group))
        for param in group["params"]:
            fqn = names.get(id(param))
            if fqn is None:
                continue  # not one of the units being loaded (the caller loads those elsewhere)
            if fqn not in saved["state"] and fqn not in saved["param_group_of"] and fqn in aliases:
                fqn = aliases[fqn]
            saved_index = saved["param_group_of"].get(fqn)
            if saved_index is not None and saved_index != i:
                raise ValueError(
                    f"load_local_state: parameter {fqn!r} is in optimizers[{k}].param_groups[{i}] but was "
                    f"saved in param_groups[{saved_index}]. Split parameters into groups as when saving."
                )
            optimizer.state.pop(param, None)
            if fqn in saved["state"]:
                optimizer.state[param] = _state_for(param, group, saved["state"][fqn])


def _state_for(param: torch.Tensor, group: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    """Saved per-parameter state placed like torch's own ``load_state_dict`` does, without dtype casts."""
    on_param_device = bool(group.get("capturable")) or bool(group.get("fused"))
    state: dict[str, Any] = {}
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            # Adam-style ``step`` lives on CPU unless capturable/fused; everything else next to the param.
            device = param.device if key != "step" or on_param_device else value.device
            state[key] = _shard_like(param, value.to(device=device, copy=True))
        else:
            state[key] = copy.deepcopy(value)
    return state


def _shard_like(target: Any, value: Any) -> Any:
    """``value`` (a whole tensor) as this rank's shard laid out like ``target`` when ``target`` is sharded
    (FSDP2) and of the same shape; anything else unchanged. Each rank cuts its own rows, no communication."""
    if (
        isinstance(target, DTensor)
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and tuple(value.shape) == tuple(target.shape)
    ):
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    return value
