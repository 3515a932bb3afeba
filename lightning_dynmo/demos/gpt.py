"""DemoGPT: a tiny pre-LN GPT that follows DynMo's model contract.

``tok_emb + pos_emb`` (first stage) -> ``layers["0"] .. layers[str(n-1)]`` (pre-LN blocks with causal
attention and an MLP) -> ``ln_f + head`` (last stage) -> cross-entropy. Built under its own seed, so a
single-process reference run can rebuild the identical model; trains single-process with its own
``training_step`` and pipelined under :class:`~lightning_dynmo.DynMoStrategy`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.demos.cost import EmulatedCost


@dataclass(frozen=True)
class GPTConfig:
    """Shape and training settings of :class:`DemoGPT`.

    Attributes:
        vocab_size: Token vocabulary size.
        seq_len: Tokens per input sequence.
        d_model: Hidden width; must be divisible by ``num_heads``.
        num_heads: Attention heads per block.
        num_layers: Number of blocks (``layers["0"]`` .. ``layers[str(num_layers - 1)]``).
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        lr_gamma: If below 1, an ``ExponentialLR`` scheduler multiplies the LR by it every step.
        sleep_ms: Emulated forward cost per block in milliseconds (backward sleeps twice as long);
            empty means no emulation, otherwise one value per block.
        seed: Seed for the initial weights.
        tie_embeddings: The output head reuses the token embedding's weight (GPT-2 style); the head
            then has no bias.
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

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; pick a d_model "
                "that is a multiple of num_heads."
            )
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be >= 1.")
        if self.sleep_ms and len(self.sleep_ms) != self.num_layers:
            raise ValueError(
                f"sleep_ms has {len(self.sleep_ms)} values but num_layers={self.num_layers}; give one per "
                "block or none."
            )


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, plus an emulated cost."""

    def __init__(self, config: GPTConfig, sleep_ms: float = 0.0):
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.mlp_ratio * d)
        self.fc2 = nn.Linear(config.mlp_ratio * d, d)
        self.cost = EmulatedCost(sleep_ms)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self._attention(self.ln1(x))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.cost(x)

    def _attention(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class DemoGPT(pl.LightningModule):
    """A tiny GPT following the DynMo model contract (see :mod:`lightning_dynmo.pipeline.model.contract`).

    Args:
        config: Model and optimizer settings; keyword ``overrides`` replace single fields.
    """

    pipeline_first_parts = ("tok_emb", "pos_emb")
    pipeline_last_parts = ("ln_f", "head")

    def __init__(self, config: GPTConfig | None = None, **overrides: Any):
        super().__init__()
        cfg = GPTConfig(**{**(config.__dict__ if config else {}), **overrides})
        self.config = cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            sleeps = list(cfg.sleep_ms) or [0.0] * cfg.num_layers
            self.layers = nn.ModuleDict({str(i): Block(cfg, sleeps[i]) for i in range(cfg.num_layers)})
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=not cfg.tie_embeddings)
            if cfg.tie_embeddings:
                self.head.weight = self.tok_emb.weight
            for name, p in self.named_parameters():
                if name.endswith("proj.weight") or name.endswith("fc2.weight"):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_layers))

    # -- the pipeline contract ------------------------------------------------------------------

    def pipeline_batch(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        """Token rows of length ``seq_len + 1`` -> (inputs, next-token targets)."""
        return batch[:, :-1], batch[:, 1:]

    def pipeline_first(self, idx: Tensor) -> Tensor:
        """Token plus position embeddings."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(positions)

    def pipeline_last(self, hidden: Tensor) -> Tensor:
        """Final norm and the vocabulary head."""
        return self.head(self.ln_f(hidden))

    def pipeline_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """Mean next-token cross-entropy."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    # -- ordinary LightningModule ---------------------------------------------------------------

    def forward(self, idx: Tensor) -> Tensor:
        x = self.pipeline_first(idx)
        for block in self.layers.values():
            x = block(x)
        return self.pipeline_last(x)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        inputs, target = self.pipeline_batch(batch)
        loss = self.pipeline_loss(self(inputs), target)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        # The single-process counterpart of DynMoStrategy's pipelined validation (same name, same value).
        return self._evaluation_loss(batch, "val_loss")

    def test_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self._evaluation_loss(batch, "test_loss")

    def _evaluation_loss(self, batch: Tensor, name: str) -> Tensor:
        inputs, target = self.pipeline_batch(batch)
        loss = self.pipeline_loss(self(inputs), target)
        self.log(name, loss, prog_bar=True, batch_size=inputs.shape[0])
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay)
        if self.config.lr_gamma >= 1.0:
            return opt
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=self.config.lr_gamma)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
