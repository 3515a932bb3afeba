"""Mixture of Experts: a GPT block (kind ``"moe"``) whose MLP is ``num_experts`` experts chosen per token.

Read in this order: :class:`MoEOptions` (every knob), :func:`route` (which token goes to which expert,
and which assignments a capacity drops), :class:`ExpertMLPs` (the experts' compute, padded to the
busiest expert), :class:`MoEBlock` (the block, its auxiliary losses, loads and the expert-bias update),
then :func:`moe_gpt_config` (the ready configuration).

Routing (token choice, top-k). ``logits = router(x)`` (a ``Linear`` without bias), ``scores =
softmax(logits)`` (Switch, Mixtral) or ``sigmoid(logits)`` (DeepSeek-V3, torchtitan's default). Each token
picks the ``top_k`` experts with the highest ``scores + expert_bias``; ``expert_bias`` (aux-loss-free
balancing, DeepSeek arXiv:2408.15664) only *selects*: the gate weights are the unbiased scores of the
chosen experts (divided by their sum if ``normalize_weights``). The MoE output of a token is
``sum_j gate_j * expert_{e_j}(x)``.

Capacity and drops. With ``capacity_factor = cf`` each expert takes at most ``C = ceil(cf * T * k / E)``
assignments of the ``T`` tokens of a micro-batch; the others are dropped: the slot adds nothing, and a
token all of whose slots are dropped passes through the block's residual unchanged (after attention).
Which assignments an expert keeps is the ``drop_policy``: ``"probs"`` keeps those with the highest
router score (Megatron's ``probs``), ``"position"`` those earliest in the flattened micro-batch (Switch /
GShard). ``capacity_factor=None`` is dropless.

Why the imbalance is real. The experts are stacked parameters computed as one batched matrix product
over ``[num_experts, rows, d_model]`` where ``rows`` is the busiest expert's load (kept assignments): the
layer computes ``num_experts * max_load`` rows whatever the others receive, as an expert-parallel layer
waits for its busiest expert. So the layer's time follows the routing and changes every step (a loop
over experts on exactly their tokens would do ``T * k`` rows every step on one device: constant work).
The stacked parameters also mean that an expert which receives no token still gets a (zero) gradient,
never ``None``: data-parallel gradient averaging sees the same tensors on every replica.
``expert_kernel="grouped"`` computes the same function with one grouped GEMM over the real rows
(``torch._grouped_mm``, what torchtitan's experts run); on one device it does only ``T * k`` rows, so it
is the faster kernel where it runs, but the work signal still models the expert-parallel wait
(``num_experts * max kept load``), which is what a pipeline of expert-parallel stages waits for.

Auxiliary losses (:func:`~lightning_dynmo.pipeline.add_aux_loss`, gradients applied on the stage
where the block runs), per micro-batch of ``T`` tokens:

- ``moe_load_balance`` (Switch / GShard): ``load_balance_coef * E * sum_i f_i * P_i`` with ``f_i`` the
  fraction of the ``T * k`` assignments routed to expert ``i`` (before drops, no gradient) and ``P_i``
  the mean over tokens of expert ``i``'s score (sigmoid scores are first divided by their per-token sum).
  Its value is ``load_balance_coef`` when routing is uniform.
- ``moe_z_loss`` (ST-MoE): ``z_loss_coef * mean_t logsumexp(logits_t)^2``.

A term whose coefficient is 0 is not added (nor declared).

What a block exposes (updated by every forward except torch's shape-inference pass): ``expert_load``
(assignments per expert before drops, last forward), ``kept_load`` (after drops), ``rows_computed``
(``num_experts * max(kept_load)``); over the training forwards of the current optimizer step
``step_load`` and ``step_rows`` / ``step_assignments``. The per-layer **work signal** is
:attr:`MoEBlock.work_ratio`: rows computed / assignments over the last completed step, 1.0 when the
experts are perfectly balanced and up to ``num_experts`` when every token picks one expert.

After each optimizer step the GPT calls :meth:`MoEBlock.after_optimizer_step` on its local blocks
(there are no hooks on the block: hooks do not migrate). It sums the step's expert loads over the
data-parallel group, updates ``expert_bias`` by ``bias_update_rate * sign(mean load - load)`` (centred,
as torchtitan does) so every replica keeps the same bias, and, if ``routing_event_threshold`` is set,
publishes ``notify_dynamism("routing", layers=(i,))`` when the layer's work ratio moved by more than
the threshold since its last event. Leave it ``None`` with ``DynMoCallback(every_step=True)``, the trigger
MoE needs (the routing changes every step; an event would restart the callback's cost smoothing); set
it when the callback rebalances on events only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.events import notify_dynamism
from lightning_dynmo.models.config import GPTConfig, check_positive_int, split_block_options
from lightning_dynmo.models.dense import CausalSelfAttention
from lightning_dynmo.models.registry import register_block
from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss
from lightning_dynmo.pipeline.step.stage import in_shape_inference

__all__ = [
    "LOAD_BALANCE_LOSS",
    "Z_LOSS",
    "ExpertMLPs",
    "MoEBlock",
    "MoEOptions",
    "Routing",
    "build_moe_block",
    "load_balance_loss",
    "moe_gpt_config",
    "route",
    "router_z_loss",
]

#: The auxiliary loss names (logged as ``train_aux/<name>``).
LOAD_BALANCE_LOSS = "moe_load_balance"
Z_LOSS = "moe_z_loss"

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
EXPERT_KERNELS = ("padded", "grouped")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class MoEOptions:
    """Settings of a ``"moe"`` block (see the module docstring for the formulas).

    Attributes:
        num_experts: Experts per layer (``E``).
        top_k: Experts each token is routed to (``k <= E``).
        expert_width: Hidden width of each expert's MLP; ``None`` is ``GPTConfig.mlp_width``.
        score_func: ``"softmax"`` or ``"sigmoid"`` router scores.
        normalize_weights: Divide each token's ``k`` gate weights by their sum.
        capacity_factor: ``cf > 0`` caps each expert at ``ceil(cf * T * k / E)`` assignments per
            micro-batch of ``T`` tokens; ``None`` is dropless.
        drop_policy: Which assignments an over-full expert keeps: ``"probs"`` (highest score) or
            ``"position"`` (earliest tokens).
        load_balance_coef: Weight of the Switch/GShard load-balancing loss (0: off).
        z_loss_coef: Weight of the router z-loss (0: off).
        bias_update_rate: Step of the aux-loss-free expert bias after each optimizer step (0: no bias).
        routing_event_threshold: Publish a ``"routing"`` dynamism event when the layer's work ratio moved
            by more than this since its last event (``None``: never; see the module docstring).
        expert_kernel: How the experts are computed. ``"padded"``: one batched product over
            ``[E, max kept load, d_model]`` (every expert padded to the busiest). ``"grouped"``: one
            grouped GEMM (``torch._grouped_mm``) over the kept assignments sorted by expert, which does
            only the ``T * k`` real rows; float32/bfloat16/float16 only, and ``d_model`` and the expert
            width must make 16-byte rows (torch's constraint). Both compute the same function (tested);
            the work signal stays ``num_experts * max kept load`` either way, because under expert
            parallelism the busiest expert sets the pace whatever kernel each device runs.
    """

    num_experts: int = 8
    top_k: int = 2
    expert_width: int | None = None
    score_func: str = "softmax"
    normalize_weights: bool = False
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    load_balance_coef: float = 0.01
    z_loss_coef: float = 0.001
    bias_update_rate: float = 0.0
    routing_event_threshold: float | None = None
    expert_kernel: str = "padded"

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k"):
            check_positive_int(name, getattr(self, name), owner="MoEOptions")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEOptions.top_k={self.top_k} exceeds num_experts={self.num_experts}; a token picks "
                "distinct experts, so set top_k <= num_experts."
            )
        width = self.expert_width
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
            raise ValueError(f"MoEOptions.expert_width={width!r} must be an integer >= 1 or None.")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEOptions.score_func={self.score_func!r} must be one of {SCORE_FUNCS}.")
        if self.expert_kernel not in EXPERT_KERNELS:
            raise ValueError(
                f"MoEOptions.expert_kernel={self.expert_kernel!r} must be one of {EXPERT_KERNELS}: 'padded' "
                "(batched, padded to the busiest expert) or 'grouped' (torch._grouped_mm on the real rows)."
            )
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"MoEOptions.drop_policy={self.drop_policy!r} must be one of {DROP_POLICIES}.")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and not isinstance(cf, bool) and cf > 0):
            raise ValueError(
                f"MoEOptions.capacity_factor={cf!r} must be a number > 0, or None for dropless routing."
            )
        for name in ("load_balance_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"MoEOptions.{name}={value!r} must be a number >= 0 (0 turns it off).")
        threshold = self.routing_event_threshold
        if threshold is not None and not (isinstance(threshold, (int, float)) and threshold > 0):
            raise ValueError(
                f"MoEOptions.routing_event_threshold={threshold!r} must be a number > 0 (a change of the "
                "work ratio), or None to publish no routing events."
            )

    @property
    def aux_losses(self) -> tuple[str, ...]:
        """The auxiliary losses a block with these options adds (those with a non-zero weight)."""
        return tuple(
            name
            for name, coef in ((LOAD_BALANCE_LOSS, self.load_balance_coef), (Z_LOSS, self.z_loss_coef))
            if coef > 0
        )


class Routing(NamedTuple):
    """Where the ``T * k`` assignments of one micro-batch go (token-major: token ``t``'s slots first).

    Attributes:
        experts: ``[T, k]`` chosen expert of each slot.
        gates: ``[T, k]`` gate weight of each slot (differentiable: the router's gradient path).
        position: ``[T, k]`` rank of the slot among its expert's assignments under the drop policy.
        kept: ``[T, k]`` whether the slot is within its expert's capacity.
        load: ``[E]`` assignments per expert before drops.
        kept_load: ``[E]`` assignments per expert after drops.
    """

    experts: Tensor
    gates: Tensor
    position: Tensor
    kept: Tensor
    load: Tensor
    kept_load: Tensor


def route(scores: Tensor, options: MoEOptions, expert_bias: Tensor | None = None) -> Routing:
    """Top-k routing of ``scores`` (``[T, E]``) under the capacity and drop policy of ``options``.

    ``expert_bias`` (``[E]``) is added for the selection only; the gates are the unbiased scores.
    """
    num_tokens, num_experts = scores.shape
    k = options.top_k
    select = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
    experts = torch.topk(select.detach(), k, dim=-1).indices
    chosen = scores.gather(-1, experts)
    gates = chosen / chosen.sum(-1, keepdim=True) if options.normalize_weights else chosen
    flat = experts.reshape(-1)
    load = torch.bincount(flat, minlength=num_experts)
    # Slots grouped by expert, in priority order inside each group (both sorts are stable).
    if options.drop_policy == "probs":
        priority = torch.argsort(chosen.detach().reshape(-1), descending=True, stable=True)
    else:
        priority = torch.arange(flat.numel(), device=flat.device)
    order = priority[torch.argsort(flat[priority], stable=True)]
    starts = torch.cumsum(load, 0) - load
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    position = position.view(num_tokens, k)
    if options.capacity_factor is None:
        kept = torch.ones_like(experts, dtype=torch.bool)
        kept_load = load
    else:
        capacity = math.ceil(options.capacity_factor * num_tokens * k / num_experts)
        kept = position < capacity
        kept_load = load.clamp(max=capacity)
    return Routing(experts, gates, position, kept, load, kept_load)


def load_balance_loss(scores: Tensor, load: Tensor, top_k: int, score_func: str) -> Tensor:
    """Switch/GShard ``E * sum_i f_i * P_i`` (unweighted; 1 when routing is uniform).

    Args:
        scores: ``[T, E]`` router scores.
        load: ``[E]`` assignments per expert before drops (no gradient flows through it).
        top_k: Slots per token (``f_i = load_i / (T * top_k)``).
        score_func: ``"sigmoid"`` scores are divided by their per-token sum first.
    """
    num_tokens, num_experts = scores.shape
    probs = scores / scores.sum(-1, keepdim=True) if score_func == "sigmoid" else scores
    fraction = load.to(scores.dtype) / (num_tokens * top_k)
    return num_experts * (fraction * probs.mean(0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE's ``mean_t logsumexp(logits_t)^2`` (unweighted)."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


class ExpertMLPs(nn.Module):
    """``num_experts`` GELU MLPs as stacked parameters, computed together on rows padded to the busiest one.

    Parameters: ``w_in [E, d_model, width]``, ``w_out [E, width, d_model]`` and, with ``bias``,
    ``b_in [E, width]``, ``b_out [E, d_model]``. Expert ``e`` computes ``gelu(x @ w_in[e] + b_in[e]) @
    w_out[e] + b_out[e]``, i.e. a dense :class:`~lightning_dynmo.models.MLP` whose ``fc_in.weight`` is
    ``w_in[e].T``.
    """

    def __init__(self, num_experts: int, d_model: int, width: int, bias: bool) -> None:
        super().__init__()
        self.num_experts, self.d_model, self.width = num_experts, d_model, width
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, width))
        self.w_out = nn.Parameter(torch.empty(num_experts, width, d_model))
        self.b_in = nn.Parameter(torch.zeros(num_experts, width)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(num_experts, d_model)) if bias else None

    def reset_parameters(self, std: float, residual_std: float) -> None:
        """GPT-2 style: ``N(0, std)`` in, ``N(0, residual_std)`` out (it writes the residual), biases 0."""
        nn.init.normal_(self.w_in, 0.0, std)
        nn.init.normal_(self.w_out, 0.0, residual_std)
        for bias in (self.b_in, self.b_out):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward_grouped(self, rows: Tensor, expert_of_row: Tensor, group_ends: Tensor) -> Tensor:
        """``[N, d_model] -> [N, d_model]`` with rows sorted by expert: one grouped GEMM per matrix.

        Args:
            rows: The kept assignments' inputs, expert 0's first.
            expert_of_row: ``[N]`` the expert of each row (for the biases).
            group_ends: ``[E]`` int32 cumulative row counts (where each expert's rows end).

        Raises:
            ValueError: a dtype or width ``torch._grouped_mm`` does not take.
        """
        self._check_grouped(rows)
        hidden = torch._grouped_mm(_contiguous_grad(rows), self.w_in, offs=group_ends)
        if self.b_in is not None:
            hidden = hidden + self.b_in[expert_of_row]
        out = torch._grouped_mm(_contiguous_grad(F.gelu(hidden)), self.w_out, offs=group_ends)
        if self.b_out is not None:
            out = out + self.b_out[expert_of_row]
        return _contiguous_grad(out)

    def _check_grouped(self, rows: Tensor) -> None:
        if rows.dtype not in _GROUPED_DTYPES:
            raise ValueError(
                f"MoEOptions.expert_kernel='grouped' runs torch._grouped_mm, which takes {_GROUPED_DTYPES}; "
                f"this block computes in {rows.dtype}. Use expert_kernel='padded' (e.g. for float64 tests)."
            )
        per_row = 16 // rows.element_size()
        if self.d_model % per_row or self.width % per_row:
            raise ValueError(
                f"MoEOptions.expert_kernel='grouped' needs 16-byte rows: d_model={self.d_model} and expert "
                f"width={self.width} must be multiples of {per_row} in {rows.dtype}. Use expert_kernel="
                "'padded', or widths that are multiples of 8."
            )

    def forward(self, rows: Tensor) -> Tensor:
        """``[E, M, d_model] -> [E, M, d_model]``: expert ``e`` on ``rows[e]``."""
        hidden = torch.bmm(rows, self.w_in)
        if self.b_in is not None:
            hidden = hidden + self.b_in.unsqueeze(1)
        out = torch.bmm(F.gelu(hidden), self.w_out)
        if self.b_out is not None:
            out = out + self.b_out.unsqueeze(1)
        return out


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``torch._grouped_mm``'s backward refuses a gradient with zero strides (what ``y.sum().backward()``
    sends), on CPU in torch 2.13.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _contiguous_grad(x: Tensor) -> Tensor:
    result: Tensor = _ContiguousGrad.apply(x)  # type: ignore[no-untyped-call]
    return result


class MoEBlock(nn.Module):
    """Pre-norm GPT-2 block whose MLP is a token-choice Mixture of Experts (see the module docstring).

    Args:
        config: The GPT's shape.
        options: The MoE settings.
        layer_index: The block's global index (named in routing events).
    """

    expert_load: Tensor
    kept_load: Tensor
    step_load: Tensor

    def __init__(self, config: GPTConfig, options: MoEOptions, layer_index: int = 0) -> None:
        super().__init__()
        self.options = options
        self.layer_index = layer_index
        self.pipeline_aux_losses = options.aux_losses
        e = options.num_experts
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.router = nn.Linear(config.d_model, e, bias=False)
        width = options.expert_width or config.mlp_width
        self.experts = ExpertMLPs(e, config.d_model, width, config.bias)
        self.drop = nn.Dropout(config.dropout)
        self.expert_bias: Tensor | None
        self.register_buffer("expert_bias", torch.zeros(e) if options.bias_update_rate > 0 else None)
        # Observations (not in checkpoints; they travel with the block when it migrates).
        for name in ("expert_load", "kept_load", "step_load"):
            self.register_buffer(name, torch.zeros(e, dtype=torch.long), persistent=False)
        self.rows_computed = 0
        self.step_rows = 0
        self.step_assignments = 0
        self.work_ratio = 1.0
        self._event_ratio = 1.0

    def init_weights(self, config: GPTConfig) -> None:
        """Initialise the experts (the GPT's init covers the ``Linear`` and ``LayerNorm`` modules)."""
        self.experts.reset_parameters(config.init_std, config.init_std / math.sqrt(2 * config.num_layers))

    def forward(self, hidden: Tensor) -> Tensor:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; adds the auxiliary losses of the routing."""
        hidden = hidden + self.attn(self.ln_1(hidden))
        moe_out, aux = self._moe(self.ln_2(hidden))
        hidden = hidden + moe_out
        for name, loss in aux.items():
            hidden = add_aux_loss(name, loss, hidden)
        return hidden

    def _moe(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        scores = logits.softmax(-1) if self.options.score_func == "softmax" else torch.sigmoid(logits)
        routing = route(scores, self.options, self.expert_bias)
        out = self._dispatch(tokens, routing)
        self._observe(routing, tokens.shape[0])
        aux: dict[str, Tensor] = {}
        if self.options.load_balance_coef > 0:
            balance = load_balance_loss(scores, routing.load, self.options.top_k, self.options.score_func)
            aux[LOAD_BALANCE_LOSS] = self.options.load_balance_coef * balance
        if self.options.z_loss_coef > 0:
            aux[Z_LOSS] = self.options.z_loss_coef * router_z_loss(logits)
        return self.drop(out).view(shape), aux

    def _dispatch(self, tokens: Tensor, routing: Routing) -> Tensor:
        """Gather each expert's kept tokens into ``[E, max kept load, d]``, run the experts, scatter back."""
        e, d = self.options.num_experts, tokens.shape[-1]
        rows = int(routing.kept_load.max().item())
        kept = routing.kept.reshape(-1)
        token_of_slot = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(
            self.options.top_k
        )[kept]
        self.rows_computed = e * rows  # the signal: the busiest expert sets the pace (module docstring)
        if self.options.expert_kernel == "grouped":
            return self._dispatch_grouped(tokens, routing, kept, token_of_slot)
        slot = (routing.experts.reshape(-1) * rows + routing.position.reshape(-1))[kept]
        grid = tokens.new_zeros(e * rows, d).index_copy(0, slot, tokens[token_of_slot])
        computed = self.experts(grid.view(e, rows, d)).reshape(e * rows, d)
        weighted = computed[slot] * routing.gates.reshape(-1)[kept].unsqueeze(-1)
        return tokens.new_zeros(tokens.shape).index_add(0, token_of_slot, weighted)

    def _dispatch_grouped(
        self, tokens: Tensor, routing: Routing, kept: Tensor, token_of_slot: Tensor
    ) -> Tensor:
        """The kept assignments sorted by expert (then position) through one grouped GEMM, scattered back."""
        expert = routing.experts.reshape(-1)[kept]
        order = torch.argsort(expert * (routing.position.max() + 1) + routing.position.reshape(-1)[kept])
        ends = torch.cumsum(routing.kept_load, 0).to(torch.int32)
        computed = self.experts.forward_grouped(tokens[token_of_slot[order]], expert[order], ends)
        weighted = computed * routing.gates.reshape(-1)[kept][order].unsqueeze(-1)
        return tokens.new_zeros(tokens.shape).index_add(0, token_of_slot[order], weighted)

    def _observe(self, routing: Routing, num_tokens: int) -> None:
        if in_shape_inference():
            return  # torch's metadata pass on zeroed inputs: not a real micro-batch
        self.expert_load.copy_(routing.load)
        self.kept_load.copy_(routing.kept_load)
        if self.training and torch.is_grad_enabled():
            self.step_load += routing.load
            self.step_rows += self.rows_computed
            self.step_assignments += num_tokens * self.options.top_k

    def after_optimizer_step(
        self, *, group: dist.ProcessGroup | None = None, step: int | None = None
    ) -> None:
        """Close the optimizer step: update the expert bias and work ratio, maybe publish a routing event.

        Called by the GPT on every rank holding the block, after each optimizer step. With ``group`` (the
        data-parallel group of the ranks holding this block) the step's loads are summed over it first,
        so every replica applies the same bias update (one small all-reduce per block with a bias).

        Args:
            group: The data-parallel process group, or ``None`` without data parallelism.
            step: The global step, named in the routing event.
        """
        load = self.step_load
        if self.expert_bias is not None:
            load = load.clone()
            if group is not None:
                dist.all_reduce(load, group=group)
            delta = self.options.bias_update_rate * torch.sign(load.double().mean() - load.double())
            self.expert_bias += (delta - delta.mean()).to(self.expert_bias.dtype)
        if self.step_assignments > 0:
            self.work_ratio = self.step_rows / self.step_assignments
        self.step_load.zero_()
        self.step_rows = self.step_assignments = 0
        threshold = self.options.routing_event_threshold
        if threshold is not None and abs(self.work_ratio - self._event_ratio) > threshold:
            detail = f"work ratio {self._event_ratio:.2f} -> {self.work_ratio:.2f}"
            self._event_ratio = self.work_ratio
            notify_dynamism("routing", layers=(self.layer_index,), step=step, detail=detail)


def build_moe_block(config: GPTConfig, layer_index: int, options: MoEOptions) -> MoEBlock:
    """The ``"moe"`` kind's factory."""
    return MoEBlock(config, options, layer_index)


register_block("moe", build_moe_block, options_type=MoEOptions, replace=True)


def moe_gpt_config(*, num_layers: int = 8, moe_every: int = 1, **fields: Any) -> GPTConfig:
    """The ready MoE GPT: byte vocabulary, :class:`MoEOptions` on every ``moe_every``-th block.

    With ``moe_every=2`` blocks 1, 3, 5, ... are MoE and the others dense (GShard / Switch); the default
    makes every block MoE, which gives the pipeline the most routing imbalance to balance. Train it with
    ``DynMoCallback(every_step=True)``.

    Args:
        num_layers: Blocks in all.
        moe_every: Every ``moe_every``-th block is MoE (1: all of them).
        **fields: Any :class:`MoEOptions` field (``num_experts``, ``top_k``, ...) and any other
            :class:`~lightning_dynmo.models.GPTConfig` field (``d_model``, ``seq_len``, ...).

    Raises:
        ValueError: ``moe_every`` is not an integer in ``[1, num_layers]``, or a bad option (from
            :class:`MoEOptions` and :class:`~lightning_dynmo.models.GPTConfig`).
        TypeError: a keyword that is neither.
    """
    if isinstance(moe_every, bool) or not isinstance(moe_every, int) or not 1 <= moe_every <= num_layers:
        raise ValueError(
            f"moe_gpt_config(moe_every={moe_every!r}) must be an integer in [1, num_layers={num_layers}]: "
            "1 makes every block MoE, 2 every other one."
        )
    moe, gpt = split_block_options("moe_gpt_config", MoEOptions, fields)
    blocks = [moe if (i + 1) % moe_every == 0 else "dense" for i in range(num_layers)]
    return GPTConfig(num_layers=num_layers, blocks=blocks, **gpt)
