"""Blocks compiled with ``torch.compile``, one block at a time, with the profiler's hooks outside.

Read :func:`check_compile_option` (what ``DynMoStrategy(compile_blocks=...)`` accepts), then
:func:`compile_blocks` (how a block is compiled: its ``forward`` only) and :func:`without_compiled_forward`
(how a compiled block travels: without its compiled code, which the receiver rebuilds).

Why the forward only. ``Module.compile()`` compiles the module's whole call, forward hooks included, and
torch does not guard compiled code on hooks added later (``torch._dynamo.config.skip_nnmodule_hook_guards``),
so the profiler's hooks, added and removed with every profiling window, could go unseen. Compiling the
block's ``forward`` and setting it on the instance leaves ``nn.Module.__call__`` and its hooks in eager
Python around the compiled region: the profiler times each block from outside it, as it times an
uncompiled one. The block's parameters, buffers and submodules are unchanged, so ``state_dict`` keys stay
plain (no ``_orig_mod.``) and checkpoints load into uncompiled models and back.

What recompiles when. The compiled function is built once per block object, at setup for the blocks a
rank starts with and on arrival for a block a migration brings (the compiled code does not travel: it is
dropped when the block is packed). Blocks that stay where they are keep their compiled ``forward`` through
migrations, re-packs and pipeline rebuilds. torch's compiler caches compiled code by the ``forward``'s
code object and guards, not by block object, so a block of a class already compiled on the rank with the
same input shapes reuses that code; a new input shape (another micro-batch size, a smaller last batch) or
an evaluation pass without gradients compiles once more, as for any ``torch.compile``'d module.

What it costs. The first forward of a block class on a rank pays the compile (Dynamo's capture, then the
backend's code generation: with inductor, seconds on a GPU and up to a minute or more on a busy CPU);
every later call pays a guard check. A block that arrives by migration is wrapped anew in microseconds
and, when a block of its class already ran on the rank with the same shapes, runs the cached code at once
(``tests/unit/pipeline/test_compiled_blocks.py`` counts the graphs); only a block of a class new to the
rank compiles on its first step there, and that step is slower by the compile time.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["check_compile_option", "compile_blocks", "is_compiled_block", "without_compiled_forward"]

_MARK = "_dynmo_compiled_forward"


def check_compile_option(value: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments of ``compile_blocks``, or ``None`` when it is off.

    Raises:
        TypeError: naming the value and what to pass instead.
    """
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        if "fullgraph" in value and not isinstance(value["fullgraph"], bool):
            raise TypeError(f"compile_blocks['fullgraph']={value['fullgraph']!r} must be a bool.")
        return dict(value)
    raise TypeError(
        f"compile_blocks={value!r} must be a bool or a dict of torch.compile keyword arguments, e.g. "
        "compile_blocks=True or compile_blocks={'backend': 'inductor', 'mode': 'max-autotune-no-cudagraphs'}."
    )


def is_compiled_block(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` is one :func:`compile_blocks` set."""
    forward = vars(module).get("forward")
    return getattr(getattr(forward, "__func__", None), _MARK, False) is True


def compile_blocks(blocks: Mapping[str, nn.Module], options: Mapping[str, Any]) -> list[str]:
    """Compile the ``forward`` of each block that is not compiled yet, in place; the names compiled.

    Args:
        blocks: The blocks, by name.
        options: ``torch.compile`` keyword arguments.
    """
    compiled = []
    for name, block in blocks.items():
        if is_compiled_block(block):
            continue  # stayed on this rank: keeps its compiled code
        fn = torch.compile(type(block).forward, **options)
        setattr(fn, _MARK, True)
        object.__setattr__(block, "forward", types.MethodType(fn, block))
        compiled.append(name)
    return compiled


def without_compiled_forward(state: dict[str, Any]) -> dict[str, Any]:
    """A module's ``__dict__`` to pickle, without a compiled ``forward`` (the receiver compiles anew)."""
    forward = state.get("forward")
    if getattr(getattr(forward, "__func__", None), _MARK, False) is True:
        state = dict(state)
        del state["forward"]
    return state
