"""Tiny demo models and data that follow DynMo's model contract (like Lightning's ``BoringModel``).

They are sized for CPU tests, docs and benchmarks: :class:`DemoGPT` (the real
:class:`~lightning_dynmo.models.GPT`, small, with the demo's defaults), the :class:`RandomTokenDataModule`
that feeds it fixed-length batches, and :class:`EmulatedCost`, which makes a block sleep for a configured
time so pipeline balance can be measured on a 2-core machine.

Modules:

- :mod:`.gpt`: :class:`DemoGPT` and :class:`DemoConfig`, the demo's settings as the GPT's configs.
- :mod:`.emulated_block`: the GPT's ``"emulated"`` block kind, a dense block followed by an emulated cost.
- :mod:`.cost`: :class:`EmulatedCost`, an identity that sleeps in forward and backward.
- :mod:`.hardware`: emulated heterogeneous hardware, a slow worker and a slow link, per process.
- :mod:`.dynamics`: scripted dynamic models (emulated costs that change at a known step, routing noise).
- :mod:`.replay`: :class:`TraceReplay`, a recorded per-step, per-layer cost trace replayed as emulated costs.
- :mod:`.data`: :class:`RandomTokenDataModule`, random-but-learnable token batches of a fixed shape.
"""

from lightning_dynmo.demos.cost import EmulatedCost
from lightning_dynmo.demos.data import RandomTokenDataModule, RandomTokenDataset
from lightning_dynmo.demos.dynamics import RoutingNoise, ScheduledCostChange
from lightning_dynmo.demos.emulated_block import EmulatedBlock, EmulatedBlockOptions
from lightning_dynmo.demos.gpt import DemoConfig, DemoGPT
from lightning_dynmo.demos.replay import CallOverhead, TraceReplay, measure_call_overhead

__all__ = [
    "CallOverhead",
    "DemoConfig",
    "DemoGPT",
    "EmulatedBlock",
    "EmulatedBlockOptions",
    "EmulatedCost",
    "RandomTokenDataModule",
    "RandomTokenDataset",
    "RoutingNoise",
    "ScheduledCostChange",
    "TraceReplay",
    "measure_call_overhead",
]
