"""DemoGPT: the GPT of :mod:`lightning_dynmo.models`, small, with ``"emulated"`` blocks and demo defaults.

:class:`DemoConfig` holds the demo's settings (a tiny shape for CPU tests, an optional emulated cost per
block, AdamW with an optional per-step exponential LR decay) and translates them into the real GPT's
:class:`~lightning_dynmo.models.GPTConfig` and :class:`~lightning_dynmo.models.OptimizerConfig`;
:class:`DemoGPT` is a :class:`~lightning_dynmo.models.GPT` built from them (like Lightning's
``BoringModel``, a model to try things on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from typing_extensions import override

from lightning_dynmo.demos.cost import EmulatedCost, check_emulated_ms
from lightning_dynmo.demos.emulated_block import EmulatedBlockOptions
from lightning_dynmo.models.config import GPTConfig, OptimizerConfig
from lightning_dynmo.models.gpt import GPT
from lightning_dynmo.pipeline.model.contract import HIDDEN

__all__ = ["DemoConfig", "DemoGPT"]


@dataclass(frozen=True)
class DemoConfig:
    """Shape and training settings of :class:`DemoGPT`.

    Attributes:
        vocab_size: Token vocabulary size.
        seq_len: Tokens per input sequence.
        d_model: Hidden width; must be divisible by ``num_heads``.
        num_heads: Attention heads per block.
        num_layers: Number of blocks (``layers["0"]`` .. ``layers[str(num_layers - 1)]``).
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay (of the GPT's decay group: the matrices of Linear layers).
        lr_gamma: If below 1, an ``ExponentialLR`` scheduler multiplies the LR by it every step.
        sleep_ms: Emulated forward cost per block in milliseconds (backward sleeps twice as long);
            empty means no emulation, otherwise one value per block.
        seed: Seed for the initial weights.
        tie_embeddings: The output head reuses the token embedding's weight (GPT-2 style).
        first_sleep_ms: Emulated forward cost of the first-stage part (the embedding) per call, ms
            (backward sleeps twice as long); 0: none, the default.
        last_sleep_ms: The same for the last-stage part (final norm and head, before the loss).
        block_compute: What each block computes before its sleep: ``"dense"`` (a transformer block, the
            default) or ``"linear"`` (one linear: for many ranks on few cores,
            :class:`~lightning_dynmo.demos.emulated_block.EmulatedBlockOptions`).
        split_backward: Each block's cost can sleep part of its backward in the weight-gradient pass of a
            split-backward schedule (``cost.wgrad_ms``; each block gains a zero ``cost.anchor``
            parameter). The parts sleep their whole backward in the input-gradient pass.
    """

    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    num_heads: int = 2
    num_layers: int = 4
    mlp_ratio: int = 2
    lr: float = 1e-2
    weight_decay: float = 0.1
    lr_gamma: float = 1.0
    sleep_ms: Sequence[float] = field(default_factory=tuple)
    seed: int = 0
    tie_embeddings: bool = False
    first_sleep_ms: float = 0.0
    last_sleep_ms: float = 0.0
    block_compute: str = "dense"
    split_backward: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be >= 1.")
        if self.sleep_ms and len(self.sleep_ms) != self.num_layers:
            raise ValueError(
                f"sleep_ms has {len(self.sleep_ms)} values but num_layers={self.num_layers}; give one per "
                "block or none."
            )
        check_emulated_ms(self.first_sleep_ms, None)
        check_emulated_ms(self.last_sleep_ms, None)
        # The shape rules (e.g. d_model divisible by num_heads) are the GPT's: checked by building its config.
        self.gpt_config()
        self.optimizer_config()

    def gpt_config(self) -> GPTConfig:
        """The GPT's shape: every block of kind ``"emulated"``, sleeping its ``sleep_ms`` entry (or not)."""
        sleeps = list(self.sleep_ms) or [0.0] * self.num_layers
        return GPTConfig(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            d_model=self.d_model,
            num_heads=self.num_heads,
            d_ff=self.mlp_ratio * self.d_model,
            tie_embeddings=self.tie_embeddings,
            blocks=tuple(
                EmulatedBlockOptions(
                    fwd_ms=ms, compute=self.block_compute, split_backward=self.split_backward
                )
                for ms in sleeps
            ),
            seed=self.seed,
        )

    def optimizer_config(self) -> OptimizerConfig:
        """AdamW with torch's default betas (the demo's optimizer); the LR decay is added by DemoGPT."""
        return OptimizerConfig(lr=self.lr, betas=(0.9, 0.999), weight_decay=self.weight_decay)


# DemoGPT's hyper-parameter: allow-listed for torch.load(weights_only=True), Lightning's default.
torch.serialization.add_safe_globals([DemoConfig])


class DemoGPT(GPT):
    """A tiny :class:`~lightning_dynmo.models.GPT` with the demo's defaults and emulated block costs.

    Its blocks are ``"emulated"`` blocks (:class:`~lightning_dynmo.demos.emulated_block.EmulatedBlock`):
    ``layers["i"].cost`` is the block's :class:`~lightning_dynmo.demos.EmulatedCost`. ``first_cost`` and
    ``last_cost`` emulate the first-stage part (after the embedding) and the last-stage part (after the
    head); they sleep nothing unless ``first_sleep_ms`` / ``last_sleep_ms`` or a replay sets them.

    Args:
        config: The demo's settings; keyword ``overrides`` replace single fields. The resulting
            :class:`DemoConfig` is the one hyper-parameter (``hparams.config``).

    Attributes:
        demo_config: The settings it was built from (``lr``, ``lr_gamma``, ``sleep_ms``, ...);
            ``config`` is the GPT's :class:`~lightning_dynmo.models.GPTConfig` made from them.
    """

    def __init__(self, config: DemoConfig | None = None, **overrides: Any):
        demo = DemoConfig(**{**(config.__dict__ if config else {}), **overrides})
        super().__init__(demo.gpt_config(), demo.optimizer_config())
        self.demo_config = demo
        # No parameters: they change nothing in the model's units or checkpoints, and every rank has them
        # (only the rank running pipeline_first / pipeline_last ever sleeps in them).
        self.first_cost = EmulatedCost(demo.first_sleep_ms)
        self.last_cost = EmulatedCost(demo.last_sleep_ms)
        # The GPT saved its own arguments, which DemoGPT does not take: the settings are the demo's.
        self.hparams.clear()
        self.save_hyperparameters({"config": demo}, logger=False)  # frozen: see GPT

    @override
    def pipeline_first(self, idx: torch.Tensor) -> Any:
        """The GPT's embedding, then the first part's emulated cost on the hidden state."""
        out = super().pipeline_first(idx)
        if isinstance(out, dict):
            return {**out, HIDDEN: self.first_cost(out[HIDDEN])}
        return self.first_cost(out)

    @override
    def pipeline_last(self, hidden: torch.Tensor) -> torch.Tensor:
        """The GPT's final norm and head, then the last part's emulated cost on the logits."""
        logits: torch.Tensor = self.last_cost(super().pipeline_last(hidden))
        return logits

    @override
    def configure_optimizers(self) -> Any:
        """The GPT's AdamW, decayed by ``lr_gamma`` every step when it is below 1."""
        optimizer = super().configure_optimizers()  # no schedule: the demo's OptimizerConfig has none
        if self.demo_config.lr_gamma >= 1.0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=self.demo_config.lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
