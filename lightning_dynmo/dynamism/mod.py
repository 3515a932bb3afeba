"""Mixture of Depths (Raposo et al. 2024): a router picks the tokens a block processes; the rest skip it.

Read in this order: :class:`MoDOptions` (every knob), :class:`MoDBlock` (what one routed layer does),
:func:`mod_config` (the ready configuration, routing every other block), then the registry factory.

What a routed block does, per micro-batch (anchors in ``shared/notes/dynamism_anchors.md``, A6):

1. **Router.** A scalar ``router`` (``Linear(d_model, 1)``) scores every token of the block's input.
   In ``"topk"`` routing (the paper's training rule) each sequence sends its ``k = capacity * seq``
   best-scored tokens through the block: expert choice over the sequence, so the count per layer is
   fixed (12.5% by default).
2. **Processing.** The chosen tokens are gathered and run through the GPT-2 block on their own:
   attention sees only the chosen tokens, causal among them in sequence order (positions are learned
   embeddings added before the first block, so nothing else needs the original positions), then the
   MLP. The block's output (attention plus MLP contributions) is multiplied by the token's raw router
   output and added to the residual: ``x + r * f(x)``, which puts the router on the gradient path. The
   other tokens pass unchanged, bit for bit. The router's bias starts at 1, so a routed block starts as
   a plain block on the tokens it processes. The gathered token count (and the attention's row
   width) is padded to a multiple of ``token_bucket`` so a GPU sees few shapes; the padding is
   dropped (:mod:`lightning_dynmo.dynamism.tokens`).
3. **Causal predictor.** Top-k over the sequence looks at future tokens, which autoregressive use
   cannot. A small MLP ``predictor`` on the detached input (stop-gradient: it trains only itself)
   learns, with a binary cross-entropy auxiliary loss (``train_aux/mod_predictor``), whether the token
   is among the top k. In ``"predictor"`` routing the predictor decides instead (logit > 0), at
   training time too: then the number of tokens a block processes varies by layer, by step and while
   the predictor learns. That is where a pipeline's Mixture-of-Depths imbalance comes from (the DynMo
   paper's "prediction inaccuracies"); with ``"topk"`` every routed layer costs the same at every step.

Validation and prediction route as training does (the same rule in both modes).

Work signal: ``processed_tokens``, the tokens a routed layer runs (:class:`TokenCounts` in
``block.token_counts``; :func:`~lightning_dynmo.dynamism.tokens.token_counts` collects them per layer).
A routed layer costs about ``capacity`` of a dense one (attention less: it shrinks quadratically), so a
split by layer count is balanced only when every stage holds as many routed layers as the others, and
under ``"predictor"`` routing the loads move every step: rebalance every step
(``DynMoCallback(every_step=True)``). Blocks send no events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.dynamism.tokens import (
    TokenCounts,
    attend_within_subset,
    check_token_bucket,
    select_tokens,
    touch_parameters,
    training_forward,
)
from lightning_dynmo.models.config import GPTConfig
from lightning_dynmo.models.dense import DenseBlock
from lightning_dynmo.models.registry import register_block
from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss

__all__ = [
    "PREDICTOR_LOSS",
    "ROUTINGS",
    "WORK_SIGNAL",
    "MoDBlock",
    "MoDOptions",
    "build_mod_block",
    "mod_config",
]

#: The auxiliary loss of the causal predictor (logged as ``train_aux/mod_predictor``).
PREDICTOR_LOSS = "mod_predictor"
#: The name of the per-layer work signal (:attr:`TokenCounts.processed` of each routed layer).
WORK_SIGNAL = "processed_tokens"
#: How a routed block picks its tokens.
ROUTINGS = ("topk", "predictor")


@dataclass(frozen=True, kw_only=True)
class MoDOptions:
    """Settings of a ``"mod"`` block (one instance may serve every routed layer).

    Attributes:
        capacity: Share of each sequence's tokens the router sends through the block in ``"topk"``
            routing (``k = max(1, floor(capacity * seq))``), in ``(0, 1]``; the paper's 12.5% by
            default. It is also the predictor's target share.
        routing: ``"topk"``: expert choice over the sequence (fixed count). ``"predictor"``: the causal
            predictor decides per token (variable count).
        predictor_hidden: Hidden width of the predictor MLP; ``None``: ``max(1, d_model // 8)``.
        predictor_loss_weight: Scale of the predictor's binary cross-entropy; it trains only the
            predictor (its input is detached). 0 leaves the predictor untrained.
        token_bucket: Round the number of tokens the block computes on (and its attention's row width)
            up to a multiple of this, capped at the micro-batch: on a GPU each new count is a new kernel
            shape and allocation size, the suspects of the steps that stalled when the count moved
            (``python -m lightning_dynmo.gpu_check.kernels`` measures steps with and without buckets).
            The padding repeats a real token and is dropped (no output, gradient, loss or statistic
            changes); it costs at most ``token_bucket - 1`` extra tokens per call (and as many
            attention slots per sequence). On by default (64, a tensor-core multiple) because GPU
            training is what this block is for; ``None`` computes on the exact count (tiny CPU models,
            where 64 may be the whole micro-batch).
    """

    capacity: float = 0.125
    routing: str = "topk"
    predictor_hidden: int | None = None
    predictor_loss_weight: float = 1.0
    token_bucket: int | None = 64

    def __post_init__(self) -> None:
        if not _is_number(self.capacity) or not 0 < self.capacity <= 1:
            raise ValueError(
                f"MoDOptions.capacity={self.capacity!r} must be in (0, 1]: the share of each sequence's "
                "tokens a routed block processes (the paper: 0.125)."
            )
        if self.routing not in ROUTINGS:
            raise ValueError(
                f"MoDOptions.routing={self.routing!r} is not one of {ROUTINGS}; use 'topk' (expert choice, "
                "fixed count) or 'predictor' (the causal predictor decides, variable count)."
            )
        hidden = self.predictor_hidden
        if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1):
            raise ValueError(
                f"MoDOptions.predictor_hidden={hidden!r} must be None (d_model // 8) or an integer >= 1."
            )
        weight = self.predictor_loss_weight
        if not _is_number(weight) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"MoDOptions.predictor_loss_weight={weight!r} must be a finite number >= 0.")
        check_token_bucket("MoDOptions.token_bucket", self.token_bucket)

    def capacity_tokens(self, seq: int) -> int:
        """Tokens per sequence of length ``seq`` that ``"topk"`` routing sends through the block."""
        return max(1, min(seq, int(self.capacity * seq + 1e-9)))


class MoDBlock(DenseBlock):
    """A GPT-2 block behind a scalar router (see the module docstring).

    Its dense parts have :class:`~lightning_dynmo.models.DenseBlock`'s names and initial weights (router
    and predictor are built without drawing from the layer's generator).

    Attributes:
        layer_index: The block's global layer index.
        options: Its :class:`MoDOptions`.
        token_counts: Tokens given and processed in training forwards (the ``processed_tokens`` signal).
    """

    pipeline_aux_losses = (PREDICTOR_LOSS,)

    def __init__(self, config: GPTConfig, layer_index: int, options: MoDOptions) -> None:
        super().__init__(config)  # the dense parts first: DenseBlock's names and initial weights
        d = config.d_model
        width = options.predictor_hidden or max(1, d // 8)
        with torch.random.fork_rng(devices=[]):  # leave the generator as DenseBlock leaves it
            self.router = nn.Linear(d, 1)
            self.predictor = nn.Sequential(nn.Linear(d, width), nn.GELU(), nn.Linear(width, 1))
        self.layer_index = layer_index
        self.options = options
        self.token_counts = TokenCounts()

    def init_weights(self, config: GPTConfig) -> None:
        """Router bias 1: the block starts as a plain block on its tokens (called by the GPT's init)."""
        with torch.no_grad():
            self.router.bias.fill_(1.0)

    def forward(self, hidden: Tensor) -> Tensor:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; unrouted tokens pass unchanged."""
        weights = self.router(hidden).squeeze(-1)
        chosen = self._top_k(weights.detach())
        logits = self.predictor(hidden.detach()).squeeze(-1)
        routed = chosen if self.options.routing == "topk" else logits.detach() > 0
        selection = select_tokens(routed, self.options.token_bucket)
        if training_forward(self):
            self.token_counts.record(selection.count, routed.numel())
        if selection.count == 0:  # nothing routed: every parameter still gets a (zero) gradient
            out = hidden + touch_parameters(self, hidden)
        else:
            x = selection.gather(hidden)
            f = attend_within_subset(self.attn, self.ln_1(x), selection)
            f = f + self.mlp(self.ln_2(x + f))
            out = selection.scatter(hidden, x + selection.gather(weights).unsqueeze(-1) * f)
        if self.options.predictor_loss_weight > 0:
            bce = F.binary_cross_entropy_with_logits(logits, chosen.to(logits.dtype))
            out = add_aux_loss(PREDICTOR_LOSS, self.options.predictor_loss_weight * bce, out)
        return out

    def _top_k(self, weights: Tensor) -> Tensor:
        k = self.options.capacity_tokens(weights.shape[1])
        top = weights.topk(k, dim=1).indices
        return torch.zeros_like(weights, dtype=torch.bool).scatter(1, top, True)


def mod_config(
    *,
    num_layers: int = 8,
    capacity: float = 0.125,
    routing: str = "predictor",
    predictor_loss_weight: float = 1.0,
    token_bucket: int | None = 64,
    **gpt: Any,
) -> GPTConfig:
    """The ready Mixture-of-Depths GPT: every other block routed (layers 1, 3, 5, ...), as in the paper.

    Routing defaults to ``"predictor"`` here: the per-layer work then changes every step, which is the
    case DynMo is for; ``routing="topk"`` gives the paper's training rule (fixed counts). Train it with
    ``DynMoCallback(every_step=True)``.

    Args:
        num_layers: Blocks in all (even layers dense, odd layers routed).
        capacity: See :class:`MoDOptions`.
        routing: See :class:`MoDOptions`.
        predictor_loss_weight: See :class:`MoDOptions`.
        token_bucket: See :class:`MoDOptions`.
        **gpt: Any other :class:`~lightning_dynmo.models.GPTConfig` field (``d_model``, ``seq_len``, ...).
    """
    options = MoDOptions(
        capacity=capacity,
        routing=routing,
        predictor_loss_weight=predictor_loss_weight,
        token_bucket=token_bucket,
    )
    blocks = ["dense" if i % 2 == 0 else options for i in range(num_layers)]
    return GPTConfig(num_layers=num_layers, blocks=blocks, **gpt)


def build_mod_block(config: GPTConfig, layer_index: int, options: MoDOptions) -> MoDBlock:
    """The ``"mod"`` kind's factory."""
    return MoDBlock(config, layer_index, options)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


register_block("mod", build_mod_block, options_type=MoDOptions, replace=True)
