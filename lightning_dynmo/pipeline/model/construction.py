"""Local construction: each rank materialises and initialises only the units it owns, seeded per unit.

Read in this order: the contract (below), :func:`unit_seed`, :func:`materialize_units` (materialise a
rank's units), :func:`keep_local_units` (what ``DynMoStrategy`` calls in ``setup``: materialise, then
drop the other units), :func:`materialize_model` (one process: the reference run, or single-device use),
then the helpers.

The contract. A model may declare its units on the meta device, in ``__init__`` (``with
torch.device("meta"): ...``) or in Lightning's ``configure_model`` hook: nothing is allocated until a
unit is materialised, so a model larger than one host can start. Materialising a unit gives each of its
meta tensors uninitialised storage on the target device (a tensor that several modules share stays one
tensor), then initialises the unit with torch's random generators seeded by
``unit_seed(model.pipeline_init_seed, unit name)``:

``pipeline_init_unit(name, unit) -> None`` (optional method of the model)
    Initialises every parameter and buffer of ``unit`` (named ``name``: ``"layers.7"``, ``"tok_emb"``)
    in place. Without it, every submodule of the unit that defines ``reset_parameters()`` is reset, in
    ``unit.modules()`` order (torch's layers do); tensors no such method covers stay uninitialised, and
    floating-point ones are reported (they are filled with NaN first, so any left over is detected).
``pipeline_init_seed: int`` (optional attribute of the model, default 0)
    The model's seed; every unit's generator state derives from it and the unit's name.

Because each unit's generators are seeded from (seed, name) alone, a unit's initial values depend on
neither the placement nor the order of construction: a rank that materialises ``layers.7`` gets the
values :func:`materialize_model` gives it in one process (on the same device type). Units are
initialised last to first, so a tensor shared by several units (a token embedding tied to the output
head) keeps the value the *first* unit gives it; a rank that owns only the head therefore also
materialises the embedding for a moment, to take the tied values from it (see
:func:`materialize_units`). Dtype: tensors keep the dtype they were declared with; declare the model in
the training dtype (e.g. under ``torch.set_default_dtype``) for true-precision runs, because values
initialised in float32 and then converted differ from values initialised in float64.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_dynmo.pipeline.model.contract import ModelSpec, check_model_contract
from lightning_dynmo.pipeline.model.units import detach_unit, pipeline_units

log = logging.getLogger(__name__)

__all__ = [
    "INIT_HOOK",
    "SEED_ATTR",
    "keep_local_units",
    "materialize_model",
    "materialize_units",
    "meta_tensor_names",
    "unit_seed",
]

#: The optional per-unit initialisation method of a model.
INIT_HOOK = "pipeline_init_unit"
#: The optional seed attribute of a model.
SEED_ATTR = "pipeline_init_seed"


def unit_seed(seed: int, unit: str) -> int:
    """The generator seed of ``unit`` under the model seed ``seed`` (stable across processes and runs)."""
    digest = hashlib.sha256(f"{seed}/{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def materialize_units(
    model: nn.Module, units: Mapping[str, nn.Module], owned: Iterable[str], *, device: torch.device
) -> int:
    """Materialise and initialise the units in ``owned`` that hold meta tensors, in place.

    Units outside ``owned`` that share a meta tensor with an owned unit are materialised and
    initialised too (the caller detaches them afterwards), so the shared tensor takes the value the
    first unit holding it gives it, as in one process. Units without meta tensors are left untouched.

    Args:
        model: The model (its ``pipeline_init_unit`` and ``pipeline_init_seed`` are used if defined).
        units: Every unit of the model, by global name, in pipeline order (first parts, blocks, last parts).
        owned: The names of the units this rank keeps.
        device: Where the storage is allocated.

    Returns:
        The number of bytes materialised in ``owned`` units.

    Raises:
        TypeError: if a unit has tensors that neither ``pipeline_init_unit`` nor any ``reset_parameters``
            initialised (floating-point tensors left at NaN), naming them.
    """
    owned = set(owned)
    todo = [name for name in units if name in owned and _has_meta(units[name])]
    shared = _meta_ids(units[name] for name in todo)
    todo += [n for n in units if n not in owned and _meta_ids([units[n]]) & shared and n not in todo]
    order = [name for name in units if name in todo]  # pipeline order
    fresh: dict[int, torch.Tensor] = {}
    for name in order:
        _allocate(units[name], device, fresh)
    seed = _model_seed(model)
    for name in reversed(order):  # last to first: the first holder of a shared tensor sets it
        _initialise(model, name, units[name], seed, device)
    for name in order:
        _check_initialised(name, units[name], fresh)
    built = sum(_unique_bytes(units[name]) for name in order if name in owned)
    if built:
        log.info(
            "materialised %.1f MiB of units %s from the meta device",
            built / 2**20,
            sorted(owned & set(order)),
        )
    return built


def keep_local_units(model: nn.Module, spec: ModelSpec, owned: Iterable[str], *, device: torch.device) -> int:
    """Materialise this rank's units (see :func:`materialize_units`) and remove every other unit.

    Returns:
        The number of bytes materialised (0 for a model built on a real device).

    Raises:
        TypeError: if a unit is left uninitialised, or a meta tensor belongs to no unit.
    """
    owned = set(owned)
    units = pipeline_units(model, spec)
    materialised = materialize_units(model, units, owned, device=device)
    for name in units:
        if name not in owned:
            detach_unit(model, name)
    left = meta_tensor_names(model)
    if left:
        raise TypeError(
            f"{type(model).__name__} still has meta tensors outside its pipeline units: {left[:5]}. Only "
            "units (layers and the first/last parts) are materialised; create other tensors on a real "
            "device, or make them part of a unit."
        )
    return materialised


def materialize_model(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Materialise every meta unit of ``model`` with the values each unit's owner gives it under DynMo.

    Use it where no ``DynMoStrategy`` runs: the single-process reference, single-device use, or in
    ``configure_model`` when the Trainer's strategy is not a ``DynMoStrategy``.

    Returns:
        ``model``.

    Raises:
        TypeError: if ``model`` breaks the model contract, a unit is left uninitialised (see
            :func:`materialize_units`), or a meta tensor belongs to no unit.
    """
    spec = check_model_contract(model)
    keep_local_units(model, spec, pipeline_units(model, spec), device=torch.device(device))
    return model


def meta_tensor_names(module: nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``module`` that are still on the meta device."""
    tensors = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    return [name for name, t in tensors if t.is_meta]


# ----------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _meta_ids(modules: Iterable[nn.Module]) -> set[int]:
    return {id(t) for m in modules for t in (*m.parameters(), *m.buffers()) if t.is_meta}


def _model_seed(model: nn.Module) -> int:
    seed = getattr(model, SEED_ATTR, 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(
            f"{type(model).__name__}.{SEED_ATTR} is {seed!r}; it must be an int (the seed every unit's "
            "initial values derive from), e.g. `self.pipeline_init_seed = config.seed`."
        )
    return seed


def _allocate(unit: nn.Module, device: torch.device, fresh: dict[int, torch.Tensor]) -> None:
    """Replace the unit's meta tensors by uninitialised ones (NaN where floating); sharing is kept.

    ``fresh`` maps id(meta tensor) -> its replacement, across units, so a tied tensor stays one tensor.
    """
    for module in unit.modules():
        tables: tuple[tuple[dict[str, Any], bool], ...] = (
            (module._parameters, True),
            (module._buffers, False),
        )
        for table, wrap in tables:
            for key, t in table.items():
                if t is None or not t.is_meta:
                    continue
                new = fresh.get(id(t))
                if new is None:
                    data = torch.empty_like(t, device=device)
                    if data.is_floating_point() or data.is_complex():
                        data.fill_(float("nan"))
                    new = nn.Parameter(data, requires_grad=t.requires_grad) if wrap else data
                    fresh[id(t)] = new
                table[key] = new


def _initialise(model: nn.Module, name: str, unit: nn.Module, seed: int, device: torch.device) -> None:
    hook = getattr(model, INIT_HOOK, None)
    devices = [device] if device.type == "cuda" else []  # the caller's generators are left as they were
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(unit_seed(seed, name))
        if callable(hook):
            hook(name, unit)
            return
        for module in unit.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def _check_initialised(name: str, unit: nn.Module, fresh: Mapping[int, torch.Tensor]) -> None:
    new = {id(t) for t in fresh.values()}
    tensors = [*unit.named_parameters(), *unit.named_buffers()]
    left = [n for n, t in tensors if id(t) in new and t.is_floating_point() and bool(torch.isnan(t).any())]
    if left:
        raise TypeError(
            f"unit {name!r} was materialised from the meta device but {left[:5]} were not initialised: "
            f"define `{INIT_HOOK}(self, name, unit)` on the model to initialise every parameter and "
            "buffer of a unit, or give the submodules that hold them a `reset_parameters()` method."
        )


def _unique_bytes(unit: nn.Module) -> int:
    seen: dict[int, int] = {}
    for t in (*unit.parameters(), *unit.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())
