"""The unsharded skeleton of a sharded unit: what a receiving stage rebuilds a migrated unit from.

A unit sharded with ``fully_shard`` is no longer picklable (its class is one FSDP made on the fly, its
FSDP state holds process groups), and a factory that builds the unit anew would lose what the unit became
while training (a pruned width, a frozen flag, a router's statistics in plain attributes). The sender
therefore sends a *skeleton*: the same module classes and plain attributes, its parameters and buffers
as ``meta`` tensors of the whole (unsharded) shape, no hooks and no FSDP state. It costs no memory; the
receiver shards it over its own data-parallel mesh, gives it storage for its shard only, and copies the
sender's shards in (:mod:`.migrate`).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["unit_skeleton"]

#: Tables of forward/backward hooks: FSDP's own hooks live there, and runtime hooks never travel.
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
#: Tables of state_dict hooks: FSDP adds its own (left behind), others travel.
_STATE_DICT_HOOK_TABLES = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_FSDP_CODE = "torch.distributed.fsdp"
#: Plain attributes ``fully_shard`` adds to a module (its state lives under a ``__composable_api_state``
#: key, dropped by prefix).
_FSDP_ATTRS = ("_fsdp_use_orig_params", "_is_fsdp_managed_module")
_FSDP_STATE_PREFIX = "__composable_api_state_key"


def unit_skeleton(unit: nn.Module) -> nn.Module:
    """A ``meta``-device, unsharded copy of ``unit``'s structure, to pickle and send.

    Every module keeps its class (an FSDP class gives way to the class it was made from) and its plain
    attributes (deep-copied); every parameter and buffer becomes a ``meta`` tensor of the whole tensor's
    shape and dtype (a parameter keeps ``requires_grad``; one shared by two submodules stays shared);
    forward/backward hooks, FSDP's state_dict hooks and its state are left behind.

    Args:
        unit: A unit, sharded with :func:`~.apply.shard_unit` or not.
    """
    memo: dict[int, Any] = {}
    skeleton = _copy_module(unit, memo)
    assert isinstance(skeleton, nn.Module)
    return skeleton


def _copy_module(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]  # type: ignore[no-any-return]
    cls = _unsharded_class(type(module))
    copied = cls.__new__(cls)
    memo[id(module)] = copied
    state: dict[str, Any] = {}
    for key, value in vars(module).items():
        if key.startswith(_FSDP_STATE_PREFIX) or key in _FSDP_ATTRS:
            continue
        if key in _HOOK_TABLES:
            state[key] = OrderedDict() if value is not None else None
        elif key in _STATE_DICT_HOOK_TABLES and value is not None:
            kept = [(k, h) for k, h in value.items() if not _is_fsdp_hook(h)]
            state[key] = copy.deepcopy(type(value)(kept), memo)
        elif key == "_parameters":
            state[key] = {n: None if p is None else _meta_parameter(p, memo) for n, p in value.items()}
        elif key == "_buffers":
            state[key] = {n: None if b is None else _meta_tensor(b, memo) for n, b in value.items()}
        elif key == "_modules":
            state[key] = {n: None if m is None else _copy_module(m, memo) for n, m in value.items()}
        else:
            state[key] = copy.deepcopy(value, memo)
    copied.__dict__.update(state)
    return copied


def _is_fsdp_hook(hook: Any) -> bool:
    function = getattr(hook, "__func__", hook)
    return str(getattr(function, "__module__", "")).startswith(_FSDP_CODE)


def _unsharded_class(cls: type[nn.Module]) -> type[nn.Module]:
    if not issubclass(cls, FSDPModule):
        return cls
    # fully_shard swaps the class for ``type("FSDP<Name>", (FSDPModule, <Name>), ...)``.
    original = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    assert issubclass(original, nn.Module)
    return original


def _meta_tensor(tensor: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
    if id(tensor) not in memo:
        memo[id(tensor)] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return memo[id(tensor)]  # type: ignore[no-any-return]


def _meta_parameter(param: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
    if id(param) not in memo:
        data = torch.empty(param.shape, dtype=param.dtype, device="meta")
        memo[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
    return memo[id(param)]  # type: ignore[no-any-return]
