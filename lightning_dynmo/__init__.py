"""lightning_dynmo: keep pipeline-parallel training of dynamic LLMs balanced while it trains.

The public entry points are :class:`DynMoStrategy` and :class:`DynMoCallback`.

``import lightning_dynmo`` registers the strategy under the name ``"dynmo"`` (so
``Trainer(strategy="dynmo")`` works) whenever torch and lightning are installed. The pure balancing core,
``lightning_dynmo.balancing``, needs neither: without them only the registration is skipped, and the
public classes are still resolved lazily on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "DynMoStrategy": "lightning_dynmo.strategy",
    "DynMoCallback": "lightning_dynmo.callback",
    "LayerCost": "lightning_dynmo.balancing",
    "Placement": "lightning_dynmo.balancing",
}

__all__ = ["__version__", *_LAZY]


def _register_strategy() -> None:
    try:
        importlib.import_module("lightning_dynmo.strategy")
    except ModuleNotFoundError as err:
        # Only a missing torch/lightning is expected here (balancing-only installs); anything else is a bug.
        if (err.name or "").split(".")[0] not in {"torch", "lightning"}:
            raise


_register_strategy()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_dynmo' has no attribute {name!r}")
