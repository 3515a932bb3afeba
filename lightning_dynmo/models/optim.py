"""AdamW with two weight-decay groups, built the same way on every pipeline rank, and its LR schedule.

Pipelines: every rank calls ``configure_optimizers`` on its local units only, and a migrated parameter
joins the param_group *index* it had on its old rank (:mod:`lightning_dynmo.pipeline.migration`). So the
groups always exist in the same order, even empty on a rank that holds no parameter of one group:
index 0 decays, index 1 does not (:data:`DECAY_GROUP`, :data:`NO_DECAY_GROUP`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_dynmo.models.config import OptimizerConfig

__all__ = ["DECAY_GROUP", "NO_DECAY_GROUP", "WarmupCosine", "build_adamw", "weight_decay_groups"]

DECAY_GROUP = 0
NO_DECAY_GROUP = 1


def weight_decay_groups(
    module: nn.Module, weight_decay: float, no_decay: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """``[decay group, no-decay group]`` of ``module``'s trainable parameters (both always present).

    A parameter decays when it has two or more dimensions and does not belong to an ``nn.Embedding``
    (the matrices of Linear layers and of block variants' experts); biases, norm weights and embeddings
    do not. ``no_decay`` adds names (as ``module.named_parameters()`` gives them) to the second group,
    e.g. an output head tied to the embedding, which lives as a Linear weight on the last stage.
    """
    extra = set(no_decay)
    embedding_params = {
        id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    decay: list[nn.Parameter] = []
    keep: list[nn.Parameter] = []
    for name, param in module.named_parameters():
        # Frozen parameters join too: a freezing block may unfreeze them, and AdamW skips params without grad.
        exempt = param.ndim < 2 or id(param) in embedding_params or name in extra
        (keep if exempt else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def build_adamw(
    module: nn.Module, config: OptimizerConfig, no_decay: Iterable[str] = ()
) -> torch.optim.AdamW:
    """AdamW over :func:`weight_decay_groups` with the settings of ``config``."""
    groups = weight_decay_groups(module, config.weight_decay, no_decay)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


class WarmupCosine:
    """LR multiplier of step ``s``: linear warm-up, then a cosine to ``min_lr_ratio`` (for ``LambdaLR``).

    A class rather than a closure so ``LambdaLR.state_dict`` can save it (checkpoints).
    """

    def __init__(self, config: OptimizerConfig):
        self.warmup_steps = config.warmup_steps
        self.decay_steps = config.decay_steps
        self.min_lr_ratio = config.min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
