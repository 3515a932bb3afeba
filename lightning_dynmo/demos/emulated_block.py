"""The ``"emulated"`` block kind of the GPT: a dense block followed by an :class:`EmulatedCost`.

Importing this module registers the kind, so ``GPTConfig(blocks=EmulatedBlockOptions(fwd_ms=5.0))``
(or ``blocks="emulated"``, no sleep) builds a :class:`~lightning_dynmo.models.GPT` whose blocks compute
as the dense ones do and sleep for a configured time: pipeline balance can then be measured on a small
machine. :class:`~lightning_dynmo.demos.DemoGPT` is a GPT whose blocks all have this kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lightning_dynmo.demos.cost import EmulatedCost, check_emulated_ms
from lightning_dynmo.models.config import GPTConfig
from lightning_dynmo.models.dense import DenseBlock
from lightning_dynmo.models.registry import register_block

__all__ = ["EmulatedBlock", "EmulatedBlockOptions", "build_emulated_block"]


@dataclass(frozen=True, kw_only=True)
class EmulatedBlockOptions:
    """Settings of one ``"emulated"`` block.

    Attributes:
        fwd_ms: Forward sleep per call, milliseconds (>= 0).
        bwd_ms: Backward sleep per call, milliseconds (>= 0); ``None`` means ``2 * fwd_ms``.
    """

    fwd_ms: float = 0.0
    bwd_ms: float | None = None

    def __post_init__(self) -> None:
        check_emulated_ms(self.fwd_ms, self.bwd_ms)


class EmulatedBlock(DenseBlock):
    """:class:`~lightning_dynmo.models.DenseBlock`, then ``cost`` (an :class:`EmulatedCost`) on its output.

    The sleep times are plain attributes of ``cost``, so a scripted dynamic model can change them during
    training and they travel with the block when it migrates.
    """

    def __init__(self, config: GPTConfig, options: EmulatedBlockOptions):
        super().__init__(config)
        self.cost = EmulatedCost(options.fwd_ms, options.bwd_ms)

    def forward(self, hidden: Tensor) -> Tensor:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; sleeps as ``cost`` says."""
        result: Tensor = self.cost(super().forward(hidden))
        return result


def build_emulated_block(config: GPTConfig, layer_index: int, options: EmulatedBlockOptions) -> EmulatedBlock:
    """The ``"emulated"`` kind's factory."""
    return EmulatedBlock(config, options)


register_block("emulated", build_emulated_block, options_type=EmulatedBlockOptions, replace=True)
