"""A Hugging Face decoder layer as a pipeline block: its causal mask, rotary cos/sin and MoE router loss.

Read in this order: :class:`HuggingFaceBlock` (what a pipeline stage calls), :func:`attention_kind` (which
mask a layer gets), then :func:`switch_load_balancing_loss` (the router's auxiliary loss, per layer).

A block reads the side inputs ``attention_mask`` (2-D, 1 = real token) and ``position_ids``, and, for
rotary models, ``rotary_cos`` / ``rotary_sin`` (computed once per step on every rank by the model's own
rotary module, see :meth:`~lightning_dynmo.models.huggingface.HuggingFaceCausalLM.pipeline_batch`). It
builds the layer's attention mask with the library's own ``create_causal_mask`` (or the sliding-window
variant), for the configured attention implementation, exactly as the model's ``forward`` does for the
whole stack, and calls the layer as the model does.

The MoE router loss. Mixtral's own ``load_balancing_loss_func`` concatenates every layer's router logits
before it averages: ``E * sum_e mean_l(f_le) * mean_l(P_le)``, with ``f_le`` the share of (real)
tokens layer ``l`` sends to expert ``e`` (top-k picks) and ``P_le`` the mean router probability of
``e``. That couples layers that run on different pipeline stages. Each block here instead adds its own
layer's Switch-Transformer loss ``E * sum_e f_le * P_le`` weighted by ``router_aux_loss_coef / L``
(Megatron-LM's per-layer form), through :func:`~lightning_dynmo.pipeline.add_aux_loss`, so its
gradient arises on the block's stage. The two agree exactly for one layer, and whenever every layer
routes alike; otherwise the per-layer mean of products differs from the product of means. Under
micro-batching the statistics are those of each micro-batch (the strategy averages the micro-batches'
losses), not of the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss

__all__ = [
    "BLOCK_CHILD",
    "ROTARY_INPUTS",
    "ROUTER_LOSS",
    "SIDE_INPUTS",
    "HuggingFaceBlock",
    "attention_kind",
    "switch_load_balancing_loss",
]

#: The side inputs every block reads.
SIDE_INPUTS = ("attention_mask", "position_ids")
#: The side inputs blocks of rotary models read as well.
ROTARY_INPUTS = ("rotary_cos", "rotary_sin")
#: The name of the MoE router's auxiliary loss (logged as ``train_aux/router_load_balance``).
ROUTER_LOSS = "router_load_balance"
#: The attribute under which a block holds the Hugging Face decoder layer.
BLOCK_CHILD = "layer"

_KINDS = ("full_attention", "sliding_attention")


class HuggingFaceBlock(nn.Module):
    """One Hugging Face decoder layer, called as the model's ``forward`` calls it.

    Args:
        layer: The model's own decoder layer (held as ``self.layer``, trained in place).
        config: The model's config (attention implementation, sliding window).
        kind: ``"full_attention"`` or ``"sliding_attention"`` (see :func:`attention_kind`).
        rotary: Whether the layer takes rotary ``position_embeddings`` (then it reads ``rotary_cos`` and
            ``rotary_sin``).
        router: Path of the MoE router inside ``layer`` whose logits feed the auxiliary loss, or ``None``.
        router_loss_weight: The weight of this layer's router loss (``coef / num_layers``).
        top_k: Experts per token (the router's top-k).
    """

    def __init__(
        self,
        layer: nn.Module,
        *,
        config: Any,
        kind: str = "full_attention",
        rotary: bool = False,
        router: str | None = None,
        router_loss_weight: float = 0.0,
        top_k: int = 1,
    ) -> None:
        super().__init__()
        if kind not in _KINDS:
            raise ValueError(f"HuggingFaceBlock(kind={kind!r}) must be one of {_KINDS}.")
        self.layer = layer
        self.config = config
        self.kind = kind
        self.router = router
        self.router_loss_weight = router_loss_weight
        self.top_k = top_k
        self.pipeline_inputs = SIDE_INPUTS + (ROTARY_INPUTS if rotary else ())

    def forward(
        self,
        hidden: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        rotary_cos: Tensor | None = None,
        rotary_sin: Tensor | None = None,
    ) -> Tensor:
        make_mask = (
            create_sliding_window_causal_mask if self.kind == "sliding_attention" else create_causal_mask
        )
        mask = make_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids}
        if rotary_cos is not None and rotary_sin is not None:
            # The model's rotary module returns cos/sin in its input's dtype: the embedded hidden state's.
            kwargs["position_embeddings"] = (rotary_cos.to(hidden.dtype), rotary_sin.to(hidden.dtype))
        if self.router is None:
            return _hidden_of(self.layer(hidden, **kwargs))
        logits: list[Tensor] = []
        router = self.layer.get_submodule(self.router)
        # Registered and removed within this call: no hook outlives the forward (or travels with the block).
        handle = router.register_forward_hook(lambda _m, _args, out: logits.append(_hidden_of(out)))
        try:
            out = _hidden_of(self.layer(hidden, **kwargs))
        finally:
            handle.remove()
        if len(logits) != 1:
            raise RuntimeError(
                f"the router `{self.router}` of {type(self.layer).__name__} ran {len(logits)} times in one "
                "forward; HuggingFaceBlock expects one call giving the router logits [tokens, experts]."
            )
        loss = switch_load_balancing_loss(logits[0], top_k=self.top_k, attention_mask=attention_mask)
        return add_aux_loss(ROUTER_LOSS, self.router_loss_weight * loss, out)


def attention_kind(config: Any, index: int) -> str:
    """The mask layer ``index`` gets, as the model's ``forward`` decides it.

    ``config.layer_types[index]`` when the config lists layer types (Qwen2); otherwise a sliding window for
    every layer when ``config.sliding_window`` is set (Mistral, Mixtral), else full causal attention.

    Raises:
        ValueError: the layer type is neither full nor sliding-window attention.
    """
    types = getattr(config, "layer_types", None)
    if types is not None:
        kind = str(types[index])
        if kind not in _KINDS:
            raise ValueError(
                f"layer {index} of this {getattr(config, 'model_type', '?')!r} model has layer type "
                f"{kind!r}; "
                f"HuggingFaceCausalLM builds masks for {_KINDS} only."
            )
        return kind
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def switch_load_balancing_loss(logits: Tensor, *, top_k: int, attention_mask: Tensor | None = None) -> Tensor:
    """One layer's Switch-Transformer load-balancing loss ``E * sum_e f_e * P_e`` over real tokens.

    ``f_e`` is the share of real tokens whose top-``k`` experts include ``e`` (so ``sum_e f_e = k``) and
    ``P_e`` their mean router probability of ``e`` (softmax of the logits); padding tokens
    (``attention_mask == 0``) count in neither. Equal to Hugging Face's ``load_balancing_loss_func`` given
    this one layer (which computes in float32; this computes in the logits' dtype). ``f`` carries no
    gradient (top-k picks), ``P`` does.

    Args:
        logits: Router logits ``[tokens, experts]`` (tokens in row-major ``[batch, seq]`` order).
        top_k: Experts per token.
        attention_mask: ``[batch, seq]``, 1 for real tokens; ``None`` counts every token.
    """
    probs = F.softmax(logits, dim=-1)
    experts = probs.shape[-1]
    picks = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, experts).sum(dim=-2).to(probs.dtype)
    if attention_mask is None:
        weight = torch.ones(probs.shape[0], dtype=probs.dtype, device=probs.device)
    else:
        weight = attention_mask.reshape(-1).to(probs.dtype)
    tokens = weight.sum().clamp(min=1.0)
    share = (picks * weight[:, None]).sum(dim=0) / tokens
    mean_prob = (probs * weight[:, None]).sum(dim=0) / tokens
    return experts * (share * mean_prob).sum()


def _hidden_of(out: Any) -> Tensor:
    # Decoder layers return the hidden state, or (in older releases) a tuple that starts with it.
    result = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(result, Tensor):
        raise TypeError(f"expected a tensor (or a tuple starting with one) from a decoder layer, got {out!r}")
    return result
