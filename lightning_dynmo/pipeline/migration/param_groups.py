"""Which optimizer parameter group a migrated parameter joins on its new rank, and LR schedulers kept in step.

Read :func:`group_for` first, then :func:`extend_schedulers`.

Each rank builds its optimizer over its own stage, so ranks may hold different parameter groups:
layer-wise LR decay gives one group per block, and a rank builds only its blocks' groups. A parameter
that migrates joins, on the receiving rank, the group with the same hyper-parameters as its group on
the sending rank (``lr``, ``initial_lr``, ``weight_decay``, betas, ... every key but ``params``): the
same index if that group matches, else the first matching group, else a new group with those
hyper-parameters. Standard LR schedulers compute a group's next rate from its own hyper-parameters
(and ``initial_lr``), so groups equal in all of them stay equal and the parameter keeps the schedule it
had. A new group is appended to every scheduler of the optimizer (``base_lrs``, the last rates and the
per-group lists of LambdaLR, MultiplicativeLR, ReduceLROnPlateau and CyclicLR). A scheduler with one
function per group (LambdaLR / MultiplicativeLR given a list) cannot tell which function a foreign group
follows: migrating into another group is then refused with the fix.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["extend_schedulers", "group_for", "same_hyper"]

_NOT_HYPER = ("params", "param_names")
# Per-group lists of torch's schedulers that hold the same value for every group built from one argument
# (a single lambda, min_lr, max_lr or momentum), so a new group takes that value too.
_UNIFORM_LISTS = ("lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums")


def same_hyper(group: dict[str, Any], hyper: dict[str, Any]) -> bool:
    """Whether ``group`` has exactly the hyper-parameters ``hyper`` (every key but ``params``)."""
    keys = {k for k in group if k not in _NOT_HYPER}
    if keys != {k for k in hyper if k not in _NOT_HYPER}:
        return False
    return all(_same_value(group[k], hyper[k]) for k in keys)


def group_for(
    optimizer: torch.optim.Optimizer,
    index: int,
    hyper: dict[str, Any],
    schedulers: Sequence[Any],
    what: str,
) -> dict[str, Any]:
    """The parameter group of ``optimizer`` a parameter from group ``index`` (``hyper``) of a peer joins.

    Args:
        optimizer: This rank's optimizer.
        index: The group's index on the sending rank.
        hyper: The group's hyper-parameters on the sending rank.
        schedulers: LR schedulers; those attached to ``optimizer`` get any new group.
        what: What is migrating (for messages), e.g. ``"unit 'layers.3' parameter 'fc1.weight'"``.

    Raises:
        ValueError: if a new group would break a scheduler (see the module docstring).
    """
    groups = optimizer.param_groups
    if index < len(groups) and same_hyper(groups[index], hyper):
        return groups[index]
    attached = [s for s in _flatten(schedulers) if getattr(s, "optimizer", None) is optimizer]
    _check_schedulers_follow(attached, what, hyper)
    for group in groups:
        if same_hyper(group, hyper):
            return group
    optimizer.add_param_group({**{k: v for k, v in hyper.items() if k not in _NOT_HYPER}, "params": []})
    extend_schedulers(attached, optimizer.param_groups[-1])
    return optimizer.param_groups[-1]


def extend_schedulers(schedulers: Sequence[Any], group: dict[str, Any]) -> None:
    """Append ``group`` (just added to their optimizer) to every per-group list of ``schedulers``."""
    for scheduler in schedulers:
        count = len(scheduler.optimizer.param_groups) - 1  # groups before this one
        if hasattr(scheduler, "base_lrs") and len(scheduler.base_lrs) == count:
            scheduler.base_lrs.append(group.get("initial_lr", group["lr"]))
        if hasattr(scheduler, "_last_lr") and len(scheduler._last_lr) == count:
            scheduler._last_lr.append(group["lr"])
        for name in _UNIFORM_LISTS:
            values = getattr(scheduler, name, None)
            if isinstance(values, list) and len(values) == count and values:
                values.append(values[0])


def _check_schedulers_follow(schedulers: Sequence[Any], what: str, hyper: dict[str, Any]) -> None:
    for scheduler in schedulers:
        for name in _UNIFORM_LISTS:
            values = getattr(scheduler, name, None)
            if isinstance(values, list) and len({id(v) if callable(v) else v for v in values}) > 1:
                raise ValueError(
                    f"{what} migrates into a parameter group (lr={hyper.get('lr')!r}) this rank builds "
                    f"differently, but its {type(scheduler).__name__} holds one {name[:-1]} per group, so it "
                    "cannot tell which one that group follows. Give every rank the same parameter groups "
                    f"(empty ones are fine), or use one {name[:-1]} for all groups (a function of the group "
                    "can read the group's own 'initial_lr')."
                )


def _flatten(schedulers: Sequence[Any]) -> Iterator[Any]:
    for scheduler in schedulers:
        yield scheduler
        yield from _flatten(getattr(scheduler, "_schedulers", ()))  # SequentialLR, ChainedScheduler


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    try:
        return bool(a == b)
    except Exception:  # values that cannot be compared: not the same group
        return False
