"""Static baselines the paper compares against: Megatron-LM's uniform split and DeepSpeed's "parameters".

Read :func:`uniform` then :func:`by_parameters`. Both are static (decided once, before training), which is
exactly what leaves workers idle once the model becomes dynamic.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_dynmo.balancing._checks import check_num_stages, check_positive_int
from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.partition import partition
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem


def uniform(num_layers: int, num_stages: int) -> Placement:
    """Megatron-LM's split: equal layer counts, the remainder spread one each over the first stages.

    Args:
        num_layers: Number of layers, >= 1.
        num_stages: Number of stages, ``1 <= num_stages <= num_layers``.

    Returns:
        E.g. ``uniform(10, 3)`` is ``"0-3|4-6|7-9"``.
    """
    check_positive_int(num_layers, "num_layers")
    check_num_stages(num_stages, num_layers)
    base, extra = divmod(num_layers, num_stages)
    return Placement.from_sizes([base + (1 if s < extra else 0) for s in range(num_stages)])


def by_parameters(costs: Sequence[LayerCost], num_stages: int) -> Placement:
    """DeepSpeed's ``partition_method="parameters"``, done exactly: min-max over parameter counts.

    DeepSpeed's own ``partition_balanced`` is not optimal (see the benchmark); this is the exact
    optimum of the same objective. As in DeepSpeed, only what ``num_params`` counts is weighed, so a
    caller that wants frozen layers to weigh 0 passes their trainable count.
    """
    return partition(BalanceProblem(costs, by="params"), num_stages)
