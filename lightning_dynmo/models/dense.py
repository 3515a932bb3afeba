"""The dense GPT-2 block (registered as ``"dense"``) and the pieces block variants reuse.

``DenseBlock``: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))`` (pre-norm), with :class:`CausalSelfAttention`
(torch's ``scaled_dot_product_attention``, causal) and :class:`MLP` (GELU). A variant replaces a piece
(an MoE block swaps ``mlp`` for experts) or wraps the whole block (early exit, Mixture of Depths).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.models.config import GPTConfig
from lightning_dynmo.models.registry import register_block

__all__ = ["MLP", "AttentionProjections", "CausalSelfAttention", "DenseBlock", "build_dense_block"]


class AttentionProjections(nn.Module):
    """The parameters of a multi-head self-attention: fused ``qkv``, output ``proj`` and residual dropout.

    Attention variants share them (so a dense block's weights load into any of them) and differ only in
    ``forward``, which a subclass defines.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(d, 3 * d, bias=config.bias)
        self.proj = nn.Linear(d, d, bias=config.bias)
        self.proj.residual_projection = True  # type: ignore[assignment]  # read by gpt2_init_
        self.resid_drop = nn.Dropout(config.dropout)


class CausalSelfAttention(AttentionProjections):
    """Multi-head causal self-attention: fused ``qkv`` projection, SDPA, output projection ``proj``."""

    def forward(self, x: Tensor) -> Tensor:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; position ``t`` attends to ``<= t``."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        result: Tensor = self.resid_drop(self.proj(out.transpose(1, 2).reshape(b, t, d)))
        return result


class MLP(nn.Module):
    """``fc_out(gelu(fc_in(x)))`` with hidden width ``config.mlp_width``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc_in = nn.Linear(config.d_model, config.mlp_width, bias=config.bias)
        self.fc_out = nn.Linear(config.mlp_width, config.d_model, bias=config.bias)
        self.fc_out.residual_projection = True  # type: ignore[assignment]  # read by gpt2_init_
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., d_model] -> [..., d_model]``."""
        result: Tensor = self.drop(self.fc_out(F.gelu(self.fc_in(x))))
        return result


class DenseBlock(nn.Module):
    """Pre-norm transformer block of GPT-2: attention and MLP, each on a LayerNorm, each residual."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, hidden: Tensor) -> Tensor:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``."""
        hidden = hidden + self.attn(self.ln_1(hidden))
        result: Tensor = hidden + self.mlp(self.ln_2(hidden))
        return result


def build_dense_block(config: GPTConfig, layer_index: int, options: Any) -> DenseBlock:
    """The ``"dense"`` kind's factory (it has no options)."""
    return DenseBlock(config)


register_block("dense", build_dense_block, replace=True)
