"""Tiny demo models and data that follow DynMo's model contract (like Lightning's ``BoringModel``).

They are sized for CPU tests, docs and benchmarks: :class:`DemoGPT` (a pre-LN GPT), the
:class:`RandomTokenDataModule` that feeds it fixed-length batches, and :class:`EmulatedCost`, which
makes a block sleep for a configured time so pipeline balance can be measured on a 2-core machine.
"""

from lightning_dynmo.demos.cost import EmulatedCost
from lightning_dynmo.demos.data import RandomTokenDataModule, RandomTokenDataset
from lightning_dynmo.demos.dynamics import RoutingNoise, ScheduledCostChange
from lightning_dynmo.demos.gpt import Block, DemoGPT, GPTConfig

__all__ = [
    "Block",
    "DemoGPT",
    "EmulatedCost",
    "GPTConfig",
    "RandomTokenDataModule",
    "RandomTokenDataset",
    "RoutingNoise",
    "ScheduledCostChange",
]
