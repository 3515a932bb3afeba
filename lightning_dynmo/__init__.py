"""lightning_dynmo: keep pipeline-parallel training of dynamic LLMs balanced while it trains.

The public entry points are :class:`DynMoStrategy` and :class:`DynMoCallback`; :class:`RunReport` adds the
run's summary table and ``summary.json`` to one's own Trainer.

``import lightning_dynmo`` registers the strategy under the name ``"dynmo"`` (so
``Trainer(strategy="dynmo")`` works) whenever torch and lightning are installed. The pure balancing core,
``lightning_dynmo.balancing``, needs neither: without them only the registration is skipped, and the
public classes are still resolved lazily on first access.

Packages, from the Lightning glue down (imports point down only):

- :mod:`.strategy`: :class:`DynMoStrategy`, pipeline-parallel training inside Lightning.
- :mod:`.callback`: :class:`DynMoCallback`, when to profile and rebalance, and what it gained.
- :mod:`.dynamism`, :mod:`.dynamism_callbacks`: the six dynamic cases and their Lightning controllers.
- :mod:`.models`, :mod:`.data`, :mod:`.demos`: the GPT and the Hugging Face adapter, data modules, demos.
- :mod:`.app`, :mod:`.train`: the Hydra application behind ``python -m lightning_dynmo.train``.
- :mod:`.pipeline`: the runtime on torch.distributed (no lightning).
- :mod:`.profiling`: per-layer costs measured inside real pipeline steps (no lightning).
- :mod:`.balancing`: placements from costs, pure Python (neither torch nor lightning).

Modules at the top: :mod:`.events` (the public "the model changed" API), :mod:`.throughput` (Lightning's
``ThroughputMonitor`` aware of pipelines), :mod:`.runtime_hooks` (a mark on the hooks DynMo registers),
:mod:`.console_log` (DynMo's INFO lines on rank 0's console when the user configured no logging),
:mod:`.plots` (figures of the logged ``dynmo/*`` metrics from CSV logs, as PNG files), and the GPU check
:mod:`.gpu_check` (``python -m lightning_dynmo.gpu_check``: the CUDA/NCCL paths, one JSON report).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "DynMoStrategy": "lightning_dynmo.strategy",
    "DynMoCallback": "lightning_dynmo.callback",
    "LayerCost": "lightning_dynmo.balancing",
    "Placement": "lightning_dynmo.balancing",
    "RunReport": "lightning_dynmo.app.report",
}

__all__ = ["__version__", *_LAZY]


def _register_strategy() -> None:
    if os.environ.get("_LIGHTNING_DYNMO_HELPER"):
        return  # DynMo's helper process (lightning_dynmo.balancing.background): pure Python, no torch
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
