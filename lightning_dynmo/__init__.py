"""lightning_dynmo: keep pipeline-parallel training of dynamic LLMs balanced while it trains.

The public entry points are :class:`DynMoStrategy` and :class:`DynMoCallback`. They are imported
lazily so that ``lightning_dynmo.balancing`` (pure Python) can be used without torch or lightning.
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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_dynmo' has no attribute {name!r}")
