"""Early exit (CALM-style): tokens that are confident enough leave the model, and later blocks get cheaper.

Read in this order: :class:`EarlyExitOptions` (every knob), :class:`EarlyExitBlock` (what one layer does),
:func:`early_exit_config` (the ready configuration), then :func:`build_early_exit_block` (the registry
factory and its checks).

What one early-exit layer does, per micro-batch (Schuster et al. 2022, "Confident Adaptive Language
Modeling"; the anchors are in ``shared/notes/dynamism_anchors.md``, A5):

1. **State propagation.** The side state ``exited`` (``[batch, seq]`` bool, created all ``False`` by the
   first stage and carried across stage boundaries with a fixed shape) marks the tokens that left at
   an earlier layer. Their hidden state is carried unchanged, bit for bit. Only the still-active tokens
   get attention queries, the output projection and the MLP, computed on the gathered tokens
   (:mod:`lightning_dynmo.dynamism.tokens`), so a layer with a fraction ``a`` of active tokens costs
   about ``(2 + 10 a) / 12`` of a dense block's matrix work (the count padded to a multiple of
   ``token_bucket``, so a GPU sees few shapes; the padding is dropped). Exited tokens still provide
   keys and values (from their carried state), as CALM's state propagation does, so the tokens after
   them see the same context.
2. **Confidence.** A per-layer exit head (``exit_norm``, a LayerNorm, then ``exit_head``, a linear map to
   the vocabulary) predicts each active token's next token; the confidence is CALM's ``softmax_diff``,
   the top-1 minus the top-2 softmax probability. A token leaves when its confidence reaches the
   threshold, which may decay with the token's position (CALM's ``λ (0.9 + 0.1 exp(-τ i / N))``).
   Why not the shared LM head: it lives on the last pipeline stage only, so a middle stage cannot use it
   without shipping every layer's hidden state there; a per-layer head is what EE-LLM does for the same
   reason. Its price: ``d_model * vocab_size`` parameters per exit, and an exited token's final logits
   come from the shared head on its carried state, not from the exit head that judged it confident
   (the anytime loss below trains both to agree with the targets). The last layer has no exit head:
   every token reaches the shared head after it anyway.
3. **Anytime-prediction loss.** Each exit head's cross-entropy on the labels (the side input
   ``"labels"``, the next-token targets) over the tokens the layer processed, summed and divided by all
   tokens of the micro-batch, weighted by ``loss_weight * (layer + 1) / num_layers``: CALM's weights
   proportional to depth, with the final head's loss (the main loss) at weight 1. It is an auxiliary
   loss (``train_aux/exit_ce``) whose gradient is applied on the stage where the exit is.

The blocks read the labels in every mode (the GPT passes them in training, validation and pipelined
prediction). Outside those, e.g. generating with ``GPT.forward``, pass labels of ``-100``: they are
ignored by the loss, and exits still follow the confidence.

Work signal: ``active_tokens``, the tokens a layer runs queries and MLP for (:class:`TokenCounts` in
``block.token_counts``, per micro-batch and summed; :func:`~lightning_dynmo.dynamism.tokens.token_counts`
collects them per layer). Deeper layers get fewer, so a uniform split leaves the last stages idle.

Events: after each optimizer step (the GPT calls :meth:`EarlyExitBlock.after_optimizer_step`) a layer
tells the balancer (``notify_dynamism("routing", layers=(i,), step=...)``) when the smoothed share of its
active tokens has moved by ``event_shift`` since it last did (or since the start, from 1.0). Exits grow
slowly as the model learns, so the right trigger is the events (or a period), not every step.
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
    attend_from_subset,
    check_token_bucket,
    select_tokens,
    touch_parameters,
    training_forward,
)
from lightning_dynmo.events import notify_dynamism
from lightning_dynmo.models.config import GPTConfig
from lightning_dynmo.models.dense import DenseBlock
from lightning_dynmo.models.registry import register_block
from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss

__all__ = [
    "EXITED",
    "EXIT_LOSS",
    "WORK_SIGNAL",
    "EarlyExitBlock",
    "EarlyExitOptions",
    "build_early_exit_block",
    "early_exit_config",
    "no_token_exited",
]

#: The side state that marks exited tokens (``[batch, seq]`` bool).
EXITED = "exited"
#: The auxiliary loss of the exit heads (logged as ``train_aux/exit_ce``).
EXIT_LOSS = "exit_ce"
#: The name of the per-layer work signal (:attr:`TokenCounts.processed` of each layer).
WORK_SIGNAL = "active_tokens"
#: The label the exit loss ignores (cross-entropy's default): unlabelled tokens and shape padding.
IGNORED_LABEL = -100


@dataclass(frozen=True, kw_only=True)
class EarlyExitOptions:
    """Settings of an ``"early_exit"`` block (one instance may serve every early-exit layer).

    Attributes:
        threshold: A token leaves when its confidence (top-1 minus top-2 softmax probability of the exit
            head, in ``[0, 1]``) reaches this; above 1 (above 1 / 0.9 with a ``position_temperature``) no
            token ever leaves.
        position_temperature: CALM's ``τ``: the threshold at position ``i`` of a ``seq_len``-long
            sequence is ``threshold * (0.9 + 0.1 * exp(-τ i / seq_len))``, so late tokens leave more
            easily (CALM uses 4). ``None``: the same threshold everywhere.
        loss_weight: Scale of the anytime-prediction loss; layer ``i``'s exit loss is weighted by
            ``loss_weight * (i + 1) / num_layers``. 0 trains no exit head.
        event_shift: Announce a dynamism event when the layer's smoothed share of active tokens has moved
            by at least this since its last event; ``None``: never.
        event_smoothing: Weight of the history in the exponential moving average of that share, updated
            once per optimizer step, in ``[0, 1)``.
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

    threshold: float = 0.9
    position_temperature: float | None = None
    loss_weight: float = 1.0
    event_shift: float | None = 0.1
    event_smoothing: float = 0.5
    token_bucket: int | None = 64

    def __post_init__(self) -> None:
        _require(
            _is_number(self.threshold) and self.threshold > 0,
            f"EarlyExitOptions.threshold={self.threshold!r} must be a number > 0 (a confidence in (0, 1]; "
            "above 1 no token exits)",
        )
        _require(
            self.position_temperature is None
            or (_is_number(self.position_temperature) and self.position_temperature >= 0),
            f"EarlyExitOptions.position_temperature={self.position_temperature!r} must be None or a number "
            ">= 0 (CALM uses 4)",
        )
        _require(
            _is_number(self.loss_weight) and math.isfinite(self.loss_weight) and self.loss_weight >= 0,
            f"EarlyExitOptions.loss_weight={self.loss_weight!r} must be a finite number >= 0",
        )
        _require(
            self.event_shift is None or (_is_number(self.event_shift) and 0 < self.event_shift <= 1),
            f"EarlyExitOptions.event_shift={self.event_shift!r} must be None or in (0, 1] (a change of the "
            "share of active tokens)",
        )
        _require(
            _is_number(self.event_smoothing) and 0 <= self.event_smoothing < 1,
            f"EarlyExitOptions.event_smoothing={self.event_smoothing!r} must be in [0, 1)",
        )
        check_token_bucket("EarlyExitOptions.token_bucket", self.token_bucket)


def no_token_exited(hidden: Tensor) -> Tensor:
    """The initial ``exited`` side state: ``False`` for every token of ``hidden`` (``[batch, seq, d]``)."""
    return torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)


class EarlyExitBlock(DenseBlock):
    """A GPT-2 block that skips exited tokens, then lets confident tokens exit (see the module docstring).

    Its dense parts have :class:`~lightning_dynmo.models.DenseBlock`'s names and initial weights (the exit
    head is built without drawing from the layer's generator), so with an unreachable threshold a GPT of
    early-exit blocks computes what the dense GPT computes.

    Attributes:
        layer_index: The block's global layer index (named in its events).
        token_counts: Tokens given and processed in training forwards (the ``active_tokens`` signal).
        active_fraction: Smoothed share of active tokens over optimizer steps (``None`` before the
            first).
    """

    pipeline_inputs = ("labels", EXITED)
    side_state_init = {EXITED: no_token_exited}
    pipeline_aux_losses = (EXIT_LOSS,)

    def __init__(self, config: GPTConfig, layer_index: int, options: EarlyExitOptions) -> None:
        super().__init__(config)  # the dense parts first: DenseBlock's names and initial weights
        d = config.d_model
        self.exit_norm: nn.LayerNorm | None = None
        self.exit_head: nn.Linear | None = None
        if layer_index < config.num_layers - 1:
            with torch.random.fork_rng(devices=[]):  # leave the generator as DenseBlock leaves it
                self.exit_norm = nn.LayerNorm(d, eps=config.layer_norm_eps, bias=config.bias)
                self.exit_head = nn.Linear(d, config.vocab_size, bias=False)
        self.layer_index = layer_index
        self.options = options
        self.seq_len = config.seq_len
        self.loss_weight = options.loss_weight * (layer_index + 1) / config.num_layers
        self.token_counts = TokenCounts()
        self.active_fraction: float | None = None
        self._announced_fraction = 1.0
        self._step_tokens = (0, 0)  # (processed, seen) in the current optimizer step

    def forward(  # type: ignore[override]  # a stage-interface block: reads side inputs, updates side state
        self, hidden: Tensor, labels: Tensor, exited: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``hidden`` ``[batch, seq, d_model]``, ``labels`` and ``exited`` ``[batch, seq]`` -> new both."""
        active = select_tokens(~exited, self.options.token_bucket)
        self._observe(active.count, exited.numel())
        if active.count == 0:  # every token left: nothing to compute, but every parameter gets a gradient
            return hidden + touch_parameters(self, hidden), {EXITED: exited}
        x = active.gather(hidden)
        x = x + attend_from_subset(self.attn, self.ln_1(hidden), active)
        x = x + self.mlp(self.ln_2(x))
        out = active.scatter(hidden, x)
        if self.exit_head is None or self.exit_norm is None:
            return out, {EXITED: exited}
        logits = self.exit_head(self.exit_norm(x))
        if self.loss_weight > 0:
            targets = active.fill_padding(active.gather(labels), IGNORED_LABEL)
            loss = F.cross_entropy(logits, targets, ignore_index=IGNORED_LABEL, reduction="sum")
            loss = loss / exited.numel()
            out = add_aux_loss(EXIT_LOSS, self.loss_weight * loss, out)
        return out, {EXITED: self._exits(logits[: active.count].detach(), active.flat, exited)}

    def exit_thresholds(self, positions: Tensor) -> Tensor:
        """The threshold at each sequence position in ``positions`` (a float64 tensor of their shape)."""
        threshold = torch.full(positions.shape, float(self.options.threshold), dtype=torch.float64)
        tau = self.options.position_temperature
        if tau is None:
            return threshold.to(positions.device)
        decay = torch.exp(-tau * positions.to(torch.float64) / self.seq_len)
        return threshold.to(positions.device) * (0.9 + 0.1 * decay)

    def _exits(self, logits: Tensor, flat: Tensor, exited: Tensor) -> Tensor:
        top2 = logits.softmax(dim=-1).topk(2, dim=-1).values
        confidence = (top2[:, 0] - top2[:, 1]).to(torch.float64)
        leaving = flat[confidence >= self.exit_thresholds(flat % exited.shape[1])]
        return exited.reshape(-1).index_fill(0, leaving, True).view_as(exited)

    def after_optimizer_step(self, *, group: Any = None, step: int | None = None) -> None:
        """Close the optimizer step: smooth the step's share of active tokens, maybe publish an event.

        Called by the GPT on the rank holding the block after each optimizer step (a method, not a hook:
        hooks do not migrate). Data-parallel replicas decide on their own tokens; the callback acts on any
        rank's event.

        Args:
            group: The data-parallel process group (unused: the decision needs no agreement).
            step: The global step, named in the event.
        """
        processed, seen = self._step_tokens
        self._step_tokens = (0, 0)
        if seen == 0:
            return
        share, smoothing = processed / seen, self.options.event_smoothing
        previous = self.active_fraction
        self.active_fraction = share if previous is None else smoothing * previous + (1 - smoothing) * share
        shift = self.options.event_shift
        if shift is not None and abs(self.active_fraction - self._announced_fraction) >= shift:
            detail = f"early exit: active tokens {self._announced_fraction:.0%} -> {self.active_fraction:.0%}"
            notify_dynamism("routing", layers=(self.layer_index,), step=step, detail=detail)
            self._announced_fraction = self.active_fraction

    def _observe(self, processed: int, seen: int) -> None:
        if training_forward(self):
            self.token_counts.record(processed, seen)
            step_processed, step_seen = self._step_tokens
            self._step_tokens = (step_processed + processed, step_seen + seen)


def early_exit_config(
    *,
    num_layers: int = 8,
    first_exit_layer: int = 2,
    threshold: float = 0.9,
    position_temperature: float | None = 4.0,
    loss_weight: float = 1.0,
    event_shift: float | None = 0.1,
    token_bucket: int | None = 64,
    **gpt: Any,
) -> GPTConfig:
    """The ready early-exit GPT: dense blocks up to ``first_exit_layer``, early-exit blocks after.

    Tokens can leave after every block from ``first_exit_layer`` on (CALM's ``min_exit``: the first
    blocks learn too little to judge). Train it with ``DynMoCallback(on_events=True)`` (the blocks'
    events) or ``every_n_steps`` (a period); exits change slowly, every-step rebalancing would only add
    profiling.

    Args:
        num_layers: Blocks in all.
        first_exit_layer: Index of the first early-exit block (``0 <= first_exit_layer < num_layers``).
        threshold: See :class:`EarlyExitOptions`.
        position_temperature: See :class:`EarlyExitOptions` (CALM's 4 by default here).
        loss_weight: See :class:`EarlyExitOptions`.
        event_shift: See :class:`EarlyExitOptions`.
        token_bucket: See :class:`EarlyExitOptions`.
        **gpt: Any other :class:`~lightning_dynmo.models.GPTConfig` field (``d_model``, ``seq_len``, ...).
    """
    if not isinstance(first_exit_layer, int) or not 0 <= first_exit_layer < num_layers:
        raise ValueError(
            f"early_exit_config(first_exit_layer={first_exit_layer!r}) must be an integer in [0, "
            f"num_layers={num_layers}); it is the index of the first block tokens can leave after."
        )
    options = EarlyExitOptions(
        threshold=threshold,
        position_temperature=position_temperature,
        loss_weight=loss_weight,
        event_shift=event_shift,
        token_bucket=token_bucket,
    )
    blocks = ["dense"] * first_exit_layer + [options] * (num_layers - first_exit_layer)
    return GPTConfig(num_layers=num_layers, blocks=blocks, **gpt)


def build_early_exit_block(config: GPTConfig, layer_index: int, options: EarlyExitOptions) -> EarlyExitBlock:
    """The ``"early_exit"`` kind's factory.

    Raises:
        ValueError: a block after this one is not an early-exit block (it would recompute exited tokens).
    """
    for later, (kind, _) in enumerate(config.resolved_blocks()[layer_index + 1 :], start=layer_index + 1):
        if kind.name != "early_exit":
            raise ValueError(
                f"GPTConfig.blocks[{later}] is a {kind.name!r} block after the early-exit block at layer "
                f"{layer_index}; every block after the first early-exit block must be 'early_exit' (another "
                "kind would recompute the tokens that left). Make layers "
                f"{layer_index}..{config.num_layers - 1} early-exit blocks, e.g. with early_exit_config()."
            )
    return EarlyExitBlock(config, layer_index, options)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message + ".")


register_block("early_exit", build_early_exit_block, options_type=EarlyExitOptions, replace=True)
