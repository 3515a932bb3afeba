"""The block registry: which kinds of transformer block a :class:`~lightning_dynmo.models.GPT` can use.

Read in this order: :func:`register_block` (how a module adds a kind), :class:`BlockKind`,
:func:`resolve_block` (how one entry of ``GPTConfig.blocks`` becomes a kind and its options).

A *kind* has a name (``"dense"``, later ``"moe"``, ``"early_exit"``, ...), a factory and, optionally, an
options dataclass of its own settings. ``GPTConfig.blocks`` names a kind per layer, either by name (the
kind's default options) or by an options instance (its type selects the kind)::

    register_block("moe", build_moe_block, options_type=MoEOptions)     # in lightning_dynmo/dynamism/moe.py
    GPTConfig(num_layers=4, blocks=["dense", MoEOptions(num_experts=8), "dense", "moe"])

The factory is called as ``factory(config, layer_index, options)`` (``options`` is ``None`` for a kind
without an options type) inside the layer's seeded RNG scope and returns the block module. What a block
must honour (the pipeline moves it between ranks one by one):

- ``block(hidden) -> hidden`` with ``hidden`` of shape ``[batch, seq, d_model]`` (the stage interface of
  :mod:`lightning_dynmo.pipeline.model.contract`; richer blocks will declare side inputs/state there);
- all its state lives in the module (parameters, buffers, plain attributes), never in hooks or globals;
- no parameter shared with another block or part;
- initial weights: the GPT applies GPT-2's init (:func:`~lightning_dynmo.models.init.gpt2_init_`) to
  every ``nn.Linear``, ``nn.Embedding`` and ``nn.LayerNorm`` of the block (a ``Linear`` that writes into
  the residual stream sets ``residual_projection = True`` to get the scaled std), then calls the block's
  ``init_weights(config)`` if it has one, for anything else. All of it runs under the block's own seed,
  so the weights do not depend on which rank builds the block or in which order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_dynmo.models.config import GPTConfig

__all__ = ["BlockFactory", "BlockKind", "block_kinds", "register_block", "resolve_block", "unregister_block"]

#: ``factory(config, layer_index, options) -> block``.
BlockFactory = Callable[["GPTConfig", int, Any], nn.Module]


@dataclass(frozen=True)
class BlockKind:
    """One registered kind of block.

    Attributes:
        name: The name used in ``GPTConfig.blocks``.
        factory: Builds a block: ``factory(config, layer_index, options)``.
        options_type: The kind's options dataclass (instantiable without arguments for the defaults),
            or ``None`` when the kind has no options (the factory then receives ``None``).
    """

    name: str
    factory: BlockFactory
    options_type: type | None = None

    def default_options(self) -> Any:
        """A default options instance, or ``None`` for a kind without options."""
        return self.options_type() if self.options_type is not None else None


_KINDS: dict[str, BlockKind] = {}


def register_block(
    name: str, factory: BlockFactory, *, options_type: type | None = None, replace: bool = False
) -> BlockKind:
    """Make a block kind available to ``GPTConfig.blocks`` (call it at import time of its module).

    Args:
        name: The kind's name: a non-empty identifier, e.g. ``"moe"``.
        factory: ``factory(config, layer_index, options) -> nn.Module``.
        options_type: The kind's options class; each options class belongs to one kind. It is
            allow-listed for ``torch.load(weights_only=True)``, since a GPT's checkpoint holds it in its
            hyper-parameters.
        replace: Allow re-registering an existing name (e.g. a module reloaded in a notebook).

    Raises:
        ValueError: a bad name, a name or options type already registered to another kind (without
            ``replace``).
        TypeError: ``factory`` is not callable or ``options_type`` is not a class.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_block: name={name!r} must be a non-empty identifier such as 'moe'.")
    if not callable(factory):
        raise TypeError(f"register_block({name!r}): factory={factory!r} is not callable.")
    if options_type is not None and not isinstance(options_type, type):
        raise TypeError(f"register_block({name!r}): options_type={options_type!r} must be a class (or None).")
    if name in _KINDS and not replace:
        raise ValueError(
            f"register_block: a block kind named {name!r} is already registered ({_KINDS[name].factory!r}); "
            "pick another name, or pass replace=True to override it on purpose."
        )
    owner = next((k for k in _KINDS.values() if k.options_type is options_type), None)
    if options_type is not None and owner is not None and owner.name != name:
        raise ValueError(
            f"register_block({name!r}): options_type {options_type.__name__} already selects the kind "
            f"{owner.name!r}; give each kind its own options class."
        )
    kind = BlockKind(name=name, factory=factory, options_type=options_type)
    _KINDS[name] = kind
    if options_type is not None:  # options travel in checkpoints (GPTConfig.blocks in the hyper-parameters)
        torch.serialization.add_safe_globals([options_type])
    return kind


def unregister_block(name: str) -> None:
    """Remove a kind (for tests and notebooks); unknown names are an error."""
    if name not in _KINDS:
        raise KeyError(f"unregister_block: no block kind named {name!r} (registered: {block_kinds()}).")
    del _KINDS[name]


def block_kinds() -> tuple[str, ...]:
    """The registered kind names, sorted."""
    return tuple(sorted(_KINDS))


def resolve_block(entry: Any, where: str = "blocks") -> tuple[BlockKind, Any]:
    """The kind and options of one entry of ``GPTConfig.blocks``: a kind name or an options instance.

    Raises:
        ValueError: an unknown name or options type, naming ``where`` and the registered kinds.
    """
    if isinstance(entry, str):
        if entry not in _KINDS:
            raise ValueError(
                f"{where}={entry!r} is not a registered block kind (registered: {list(block_kinds())}); "
                "import the module that registers it (e.g. `import lightning_dynmo.dynamism.moe`) or call "
                "lightning_dynmo.models.register_block(name, factory)."
            )
        kind = _KINDS[entry]
        return kind, kind.default_options()
    for kind in _KINDS.values():
        if kind.options_type is not None and type(entry) is kind.options_type:
            return kind, entry
    raise ValueError(
        f"{where}={entry!r} is neither a block kind name nor the options of a registered kind (registered: "
        f"{list(block_kinds())}); pass a name such as 'dense' or an instance of a kind's options_type."
    )
