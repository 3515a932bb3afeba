"""Continued training of a causal LM on corpus blocks: one optimizer step, the helper every case shares."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["FRESH_LR", "PRETRAINED_LR", "adamw", "decoder_layers", "lm_step"]

#: The step of the pretrained weights in continued training (learns: the loss falls within tens of steps).
PRETRAINED_LR = 1e-4
#: The step of freshly initialised parts (routers, predictors, heads), which have only tens of steps to learn.
FRESH_LR = 1e-3


def decoder_layers(model: Any) -> list[Any]:
    """The transformer blocks of a ``transformers`` Llama (``model.model.layers``), in order."""
    return list(model.model.layers)


def adamw(model: nn.Module, fresh: Iterable[Tensor] = ()) -> torch.optim.AdamW:
    """AdamW without weight decay: :data:`PRETRAINED_LR` for the model, :data:`FRESH_LR` for ``fresh``."""
    new = {id(p) for p in fresh}
    groups = [
        {"params": [p for p in model.parameters() if id(p) not in new], "lr": PRETRAINED_LR},
        {"params": [p for p in model.parameters() if id(p) in new], "lr": FRESH_LR},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=0.0)


def lm_step(
    model: nn.Module,
    batch: Tensor,
    optimizer: torch.optim.Optimizer,
    *,
    extra_loss: Callable[[], Tensor] | None = None,
    before_step: Callable[[], None] | None = None,
) -> float:
    """One step of next-token training on ``batch`` (``[B, T]``); returns the language-model loss.

    Args:
        extra_loss: Called after the forward; its value is added to the loss (e.g. a load-balancing loss).
        before_step: Called after backward, before the optimizer step (e.g. to read gradients).
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss: Tensor = model(input_ids=batch, labels=batch).loss
    total = loss + extra_loss() if extra_loss is not None else loss
    total.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    if before_step is not None:
        before_step()
    optimizer.step()
    return float(loss.detach())
