"""What of a unit can migrate: hooks a user registered are refused, parametrized modules are rebuilt.

Read :func:`check_no_user_hooks` (called by the strategy at setup and by :func:`~lightning_dynmo.pipeline.
migration.pack_unit` before every transfer), :func:`check_not_compiled` (called by the strategy at
setup), then :func:`reduce_parametrized` (how a module with ``torch.nn.utils.parametrize``
parametrizations travels).

Hooks. Migration carries a unit's parameters, buffers, parametrizations, plain attributes and optimizer
state; forward/backward hooks on its modules and hooks on its tensors do not travel (they are closures
over the sending process), so a unit that holds state in one would silently lose it. Such units are
refused, naming the module and the hook, with where the state must live instead. The profiler's own
hooks (marked by :func:`lightning_dynmo.runtime_hooks.runtime_hook`) are instrumentation of
the sending rank and are left behind. ``torch.nn.utils.prune`` and the hook-based ``weight_norm`` /
``spectral_norm`` keep their state in forward pre-hooks: the message names their parametrization
replacements.

Compiled modules. A unit holding a module the user compiled with ``torch.compile`` (its ``OptimizedModule``
wrapper, or ``Module.compile()``) is refused: those compile the module's whole call, the forward hooks
DynMo's profiler adds and removes during training included, and torch does not guard compiled code on
hooks by default (``torch._dynamo.config.skip_nnmodule_hook_guards``: hooks added or removed after
compilation may go unnoticed), so the per-layer costs the balancers decide on could silently be missing
or stale. ``DynMoStrategy(compile_blocks=True)`` compiles each block's ``forward`` instead, with the hooks
outside (:mod:`lightning_dynmo.pipeline.model.compiled`).

Parametrizations. ``register_parametrization`` swaps the module's class for a generated subclass that
refuses pickling; :func:`reduce_parametrized` sends the module as its original class plus its state
(the ``parametrizations`` container with the original tensors and the parametrization modules travel
like any submodule), and the receiver re-creates the generated class and properties with torch's own
helpers, so the parametrized tensors behave exactly as on the sender.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize, prune

from lightning_dynmo.runtime_hooks import is_runtime_hook

__all__ = ["check_no_user_hooks", "check_not_compiled", "reduce_parametrized", "user_hooks"]

_MODULE_HOOK_TABLES = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}
_TENSOR_HOOK_TABLES = {
    "_backward_hooks": "gradient hook",
    "_post_accumulate_grad_hooks": "post-accumulate-grad hook",
}
_WHERE_STATE_LIVES = (
    "Hooks do not migrate with a layer. Keep layer state in the module: parameters, buffers "
    "(register_buffer, e.g. a mask), parametrizations (torch.nn.utils.parametrize.register_parametrization, "
    "e.g. weight = original * mask) or plain attributes; apply a gradient mask inside forward (e.g. "
    "F.linear(x, self.weight * self.mask)) or as a parametrization instead of a tensor hook; and register "
    "debugging hooks only while no migration can happen (e.g. DynMoCallback(balancer='static'))."
)


def user_hooks(unit: nn.Module) -> list[tuple[str, str, Any]]:
    """``(where, kind, hook)`` for every hook on ``unit``'s modules and tensors not marked as runtime."""
    found = []
    for path, module in unit.named_modules(remove_duplicate=True):
        for table, kind in _MODULE_HOOK_TABLES.items():
            for hook in (getattr(module, table, None) or {}).values():
                if not (is_runtime_hook(hook) or _lazy_initialiser(hook)):
                    found.append((path or "<the unit itself>", kind, hook))
        for name, tensor in _own_tensors(module):
            where = f"{path}.{name}" if path else name
            for table, kind in _TENSOR_HOOK_TABLES.items():
                for hook in (getattr(tensor, table, None) or {}).values():
                    if not is_runtime_hook(hook):
                        found.append((where, kind, hook))
    return found


def check_no_user_hooks(units: Mapping[str, nn.Module]) -> None:
    """Refuse units whose modules or tensors carry hooks a user registered (they would not migrate).

    Raises:
        TypeError: naming the unit, the module or tensor, the hook, and where the state must live.
    """
    for unit_name, unit in units.items():
        found = user_hooks(unit)
        if not found:
            continue
        where, kind, hook = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise TypeError(
            f"unit {unit_name!r}: {where!r} carries a {kind} {_describe(hook)}{more}, which cannot migrate "
            f"between pipeline ranks. {_fix_for(hook)}"
        )


def check_not_compiled(units: Mapping[str, nn.Module]) -> None:
    """Refuse units holding a module compiled with ``torch.compile`` (see the module docstring).

    Raises:
        TypeError: naming the compiled modules, why, and what to do instead.
    """
    compiled = [
        f"{unit_name}.{path}".rstrip(".")
        for unit_name, unit in units.items()
        for path, module in unit.named_modules()
        if hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None
    ]
    if compiled:
        raise TypeError(
            f"DynMoStrategy cannot train modules compiled by the user: {compiled[:5]} were compiled with "
            "torch.compile (an OptimizedModule, or Module.compile()), which compiles the module's whole call "
            "with the forward hooks DynMo's profiler adds and removes during training, and compiled code may "
            "not notice hooks changed after compilation (torch._dynamo.config.skip_nnmodule_hook_guards), so "
            "the per-layer costs its balancers use could silently be missing or stale. Pass the blocks "
            "uncompiled and DynMoStrategy(compile_blocks=True) (or a dict of torch.compile options): it "
            "compiles each block's forward with the profiler's hooks outside, and recompiles a block that "
            "migrates on arrival."
        )


def reduce_parametrized(module: nn.Module, state: dict[str, Any]) -> tuple[Any, ...] | None:
    """A pickle reduction of a parametrized module (``None`` if it has no parametrizations).

    Args:
        module: The module being pickled.
        state: Its ``__dict__`` as it should travel (runtime hook tables already emptied).
    """
    if not parametrize.is_parametrized(module):
        return None
    return (_rebuild_parametrized, (type(module).__bases__[0], state))


def _rebuild_parametrized(cls: type[nn.Module], state: dict[str, Any]) -> nn.Module:
    module = cls.__new__(cls)
    module.__dict__.update(state)
    parametrize._inject_new_class(module)
    parametrizations = module.parametrizations
    assert isinstance(parametrizations, nn.ModuleDict)
    for tensor_name in parametrizations:
        parametrize._inject_property(module, tensor_name)
    return module


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for table in ("_parameters", "_buffers"):
        for name, tensor in module.__dict__.get(table, {}).items():
            if tensor is not None:
                yield name, tensor


def _lazy_initialiser(hook: Any) -> bool:
    # A lazy module's own shape-inference hook: it removes itself at the first forward.
    return getattr(hook, "__func__", None) is LazyModuleMixin._infer_parameters


def _describe(hook: Any) -> str:
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return f"({name})"


def _fix_for(hook: Any) -> str:
    if isinstance(hook, prune.BasePruningMethod):
        return (
            "It is torch.nn.utils.prune's mask, kept in a forward pre-hook. Make the pruning permanent with "
            f"torch.nn.utils.prune.remove(module, {hook._tensor_name!r}) before fitting (the zeros stay in "
            "the weight but are not enforced any more), or keep the mask in the module: a buffer used in "
            "forward, or a parametrization (register_parametrization(module, 'weight', Mask(mask)) whose "
            "forward returns weight * self.mask), which migrates with the layer."
        )
    kind = type(hook).__name__
    if kind in ("WeightNorm", "SpectralNorm"):
        modern = "weight_norm" if kind == "WeightNorm" else "spectral_norm"
        return (
            f"It is the hook-based torch.nn.utils.{modern}; use torch.nn.utils.parametrizations.{modern}, "
            "which keeps the same state as a parametrization and migrates with the layer."
        )
    return _WHERE_STATE_LIVES
