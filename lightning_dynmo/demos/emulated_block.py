"""The ``"emulated"`` block kind of the GPT: a dense block followed by an :class:`EmulatedCost`.

Importing this module registers the kind, so ``GPTConfig(blocks=EmulatedBlockOptions(fwd_ms=5.0))``
(or ``blocks="emulated"``, no sleep) builds a :class:`~lightning_dynmo.models.GPT` whose blocks compute
as the dense ones do and sleep for a configured time: pipeline balance can then be measured on a small
machine. :class:`~lightning_dynmo.demos.DemoGPT` is a GPT whose blocks all have this kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lightning_dynmo.demos.cost import EmulatedCost, check_emulated_ms
from lightning_dynmo.models.config import GPTConfig
from lightning_dynmo.models.dense import DenseBlock
from lightning_dynmo.models.registry import register_block

__all__ = ["COMPUTES", "EmulatedBlock", "EmulatedBlockOptions", "LinearEmulatedBlock", "build_emulated_block"]

#: What an emulated block may compute before its sleep (:attr:`EmulatedBlockOptions.compute`).
COMPUTES = ("dense", "linear")


@dataclass(frozen=True, kw_only=True)
class EmulatedBlockOptions:
    """Settings of one ``"emulated"`` block.

    Attributes:
        fwd_ms: Forward sleep per call, milliseconds (>= 0).
        bwd_ms: Backward sleep per call, milliseconds (>= 0); ``None`` means ``2 * fwd_ms``.
        compute: What the block computes before it sleeps: ``"dense"``, a dense transformer block
            (:class:`EmulatedBlock`); ``"linear"``, one ``d_model x d_model`` linear with a residual
            (:class:`LinearEmulatedBlock`, about a seventh of a tiny dense block's CPU time a call), for
            many ranks sharing few cores, where the blocks' own compute would otherwise set the step.
        split_backward: Give the block's :class:`~lightning_dynmo.demos.EmulatedCost` its zero ``anchor``
            parameter, so part of its backward (``cost.wgrad_ms``) sleeps in the weight-gradient pass of a
            split-backward schedule.
    """

    fwd_ms: float = 0.0
    bwd_ms: float | None = None
    compute: str = "dense"
    split_backward: bool = False

    def __post_init__(self) -> None:
        check_emulated_ms(self.fwd_ms, self.bwd_ms)
        if self.compute not in COMPUTES:
            raise ValueError(f"compute={self.compute!r} must be one of {COMPUTES}.")


class EmulatedBlock(DenseBlock):
    """:class:`~lightning_dynmo.models.DenseBlock`, then ``cost`` (an :class:`EmulatedCost`) on its output.

    The sleep times are plain attributes of ``cost``, so a scripted dynamic model can change them during
    training and they travel with the block when it migrates.
    """

    def __init__(self, config: GPTConfig, options: EmulatedBlockOptions):
        super().__init__(config)
        self.cost = EmulatedCost(options.fwd_ms, options.bwd_ms, options.split_backward)

    def forward(self, hidden: Tensor) -> Tensor:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; sleeps as ``cost`` says."""
        result: Tensor = self.cost(super().forward(hidden))
        return result


class LinearEmulatedBlock(nn.Module):
    """One ``d_model x d_model`` linear with a residual, then ``cost``: an emulated block computing little.

    Its cost is the sleep; ``cost`` is an attribute as in :class:`EmulatedBlock`, so replays and scripted
    dynamics drive both alike.
    """

    def __init__(self, config: GPTConfig, options: EmulatedBlockOptions):
        super().__init__()
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.cost = EmulatedCost(options.fwd_ms, options.bwd_ms, options.split_backward)

    def forward(self, hidden: Tensor) -> Tensor:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; sleeps as ``cost`` says."""
        result: Tensor = self.cost(hidden + self.proj(hidden))
        return result


def build_emulated_block(
    config: GPTConfig, layer_index: int, options: EmulatedBlockOptions
) -> EmulatedBlock | LinearEmulatedBlock:
    """The ``"emulated"`` kind's factory: the block its options' ``compute`` names."""
    if options.compute == "linear":
        return LinearEmulatedBlock(config, options)
    return EmulatedBlock(config, options)


register_block("emulated", build_emulated_block, options_type=EmulatedBlockOptions, replace=True)
