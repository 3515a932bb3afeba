"""The Hugging Face adapter's optimizer: the weight-decay groups of HF's Trainer, and user factories.

Read :func:`trainer_decay_groups` (which parameters decay), then :func:`build_optimization` (what
``HuggingFaceCausalLM.configure_optimizers`` returns from the optimizer and scheduler factories).

The rule is the one ``transformers.Trainer.get_decay_parameter_names`` applies, written here: a
parameter does not decay if it belongs to an ``nn.LayerNorm`` or if its name (the model's own name,
lower-cased) contains ``bias``, ``layernorm``, ``rmsnorm``, a ``norm`` component or a ``_norm`` suffix;
every other parameter decays (embeddings included, as in HF's Trainer). Names are the model's own
(``model.layers.0.input_layernorm.weight``) whichever rank holds the parameter, so a parameter falls in
the same group on every rank, before and after a migration.

Pipelines: every rank calls ``configure_optimizers`` on its own units, so both groups always exist in the
same order, even empty on a rank without a parameter of one (:data:`DECAY`, :data:`NO_DECAY`); a
migrated parameter joins the group with its hyper-parameters on the new rank
(:mod:`lightning_dynmo.pipeline.migration.param_groups`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "DECAY",
    "NO_DECAY",
    "NO_DECAY_PATTERNS",
    "OptimizerFactory",
    "SchedulerFactory",
    "build_optimization",
    "trainer_decay_groups",
]

#: The index of the decaying group, and of the other one.
DECAY, NO_DECAY = 0, 1
#: HF Trainer's name patterns of parameters without weight decay (searched in the lower-cased name).
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")

#: Builds the optimizer from the parameter groups ``[decay group, no-decay group]``.
OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
#: Builds the LR scheduler of the optimizer: a scheduler (stepped every optimizer step) or Lightning's
#: ``lr_scheduler`` dict (``{"scheduler": ..., "interval": ..., ...}``).
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

_PATTERNS = tuple(re.compile(p) for p in NO_DECAY_PATTERNS)


def trainer_decay_groups(
    module: nn.Module, name_of: Callable[[str], str], weight_decay: float
) -> list[dict[str, Any]]:
    """``[decay group, no-decay group]`` of ``module``'s parameters under HF Trainer's rule (both present).

    Args:
        module: The module whose parameters are grouped (each once; frozen ones too, which a freezing
            block may unfreeze, and which AdamW skips while they have no gradient).
        name_of: A parameter's name in ``module`` -> the model's own name the rule reads.
        weight_decay: The decay group's ``weight_decay``; the other group's is 0.
    """
    in_layer_norm = {id(p) for m in module.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    groups: tuple[list[nn.Parameter], list[nn.Parameter]] = ([], [])
    for name, param in module.named_parameters():
        own = name_of(name).lower()
        exempt = id(param) in in_layer_norm or any(p.search(own) for p in _PATTERNS)
        groups[NO_DECAY if exempt else DECAY].append(param)
    return [
        {"params": groups[DECAY], "weight_decay": weight_decay},
        {"params": groups[NO_DECAY], "weight_decay": 0.0},
    ]


def build_optimization(
    groups: list[dict[str, Any]],
    *,
    lr: float,
    optimizer: OptimizerFactory | None,
    lr_scheduler: SchedulerFactory | None,
) -> Any:
    """What ``configure_optimizers`` returns: the optimizer, with its scheduler if a factory is given.

    Args:
        groups: The parameter groups (:func:`trainer_decay_groups`).
        lr: AdamW's learning rate when ``optimizer`` is ``None``.
        optimizer: Builds the optimizer from ``groups``; ``None``: ``torch.optim.AdamW(groups, lr=lr)``.
        lr_scheduler: Builds the scheduler from the optimizer; ``None``: no scheduler.

    Raises:
        TypeError: a factory returned something else than an optimizer holding every parameter of
            ``groups`` in as many groups, or a scheduler dict without ``"scheduler"``.
    """
    built = torch.optim.AdamW(groups, lr=lr) if optimizer is None else optimizer(groups)
    _check_optimizer(built, groups)
    if lr_scheduler is None:
        return built
    scheduler = lr_scheduler(built)
    if isinstance(scheduler, Mapping):
        if "scheduler" not in scheduler:
            raise TypeError(
                f"lr_scheduler returned a dict with keys {sorted(scheduler)} but no 'scheduler'; return "
                "a scheduler, or Lightning's dict {'scheduler': ..., 'interval': 'step', ...}."
            )
        config = dict(scheduler)
    else:
        config = {"scheduler": scheduler, "interval": "step"}  # HF schedules count optimizer steps
    return {"optimizer": built, "lr_scheduler": config}


def _check_optimizer(built: Any, groups: Iterable[dict[str, Any]]) -> None:
    groups = list(groups)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer returned a {type(built).__name__}, not a torch.optim.Optimizer; pass a callable that "
            "builds one from the parameter groups, e.g. functools.partial(torch.optim.AdamW, lr=3e-4)."
        )
    given = [[id(p) for p in g["params"]] for g in groups]
    held = [[id(p) for p in g["params"]] for g in built.param_groups]
    if held != given:
        raise TypeError(
            f"optimizer built {len(held)} parameter groups of sizes {[len(g) for g in held]} from the "
            f"{len(given)} groups of sizes {[len(g) for g in given]} it was given; keep the groups as "
            "they are (every pipeline rank must build the same layout; set per-group options on them), "
            "e.g. functools.partial(torch.optim.AdamW, lr=3e-4)."
        )
