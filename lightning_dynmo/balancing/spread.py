"""How much each layer's averaged cost moves between windows, and the margin a decision plans with.

A decision searches hundreds of placements on each layer's moving average of its measured times
(:func:`~lightning_dynmo.balancing.policy.smooth_costs`). Where a layer's cost swings from step to step (an
MoE layer whose router sends a step's tokens to two experts, then spreads the next step's), the average
says where its cost sits, not how far it strays, and the search then picks the placement that fits the
average best: the one that packs the layers that happened to be light beside each other. When they swing
back, that stage is the step's slowest. This is the winner's curse of a search over noisy costs: at 48 MoE
layers on 16 ZBV ranks (1-2 layers a stage) the every-step policy on the average alone moved 4-8 times in
a replay of the MoE trace, each move predicted 2% or more faster, and trailed the uniform split
(``python -m benchmarks.cost_smoothing``).

A decision therefore plans each layer at its average plus ``margin`` standard deviations of the
averaged windows (:func:`with_margin`): a layer that keeps still costs what it measures, a layer that
swings costs what it reaches in a bad step, and a stage of swinging layers is planned as the bottleneck it
becomes in one. The standard deviation comes from the same bias-corrected weights as the average: the
moving average of the squared times (:func:`squared_times`, averaged by
:func:`~lightning_dynmo.balancing.policy.smooth_costs` with the same history weight) less the average
squared. A single window (the first, or the first after a dynamism event restarts the average) has no
spread: the plan is the measurement. Sizes (parameters, memory, activations) carry no margin.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from lightning_dynmo.balancing.costs import LayerCost

__all__ = ["TIME_FIELDS", "squared_times", "with_margin"]

#: The fields of a :class:`~lightning_dynmo.balancing.costs.LayerCost` that are measured times.
TIME_FIELDS = ("fwd_time_s", "bwd_time_s", "bwd_weight_time_s", "update_time_s")


def squared_times(costs: Sequence[LayerCost]) -> list[LayerCost]:
    """``costs`` with every time squared (sizes kept): what a moving average of squares averages."""
    return [dataclasses.replace(c, **{f: getattr(c, f) ** 2 for f in TIME_FIELDS}) for c in costs]


def with_margin(mean: Sequence[LayerCost], squares: Sequence[LayerCost], margin: float) -> list[LayerCost]:
    """Each layer's averaged times plus ``margin`` standard deviations (sizes as in ``mean``).

    Args:
        mean: The moving average of the measured costs.
        squares: The moving average of :func:`squared_times` of the same measurements, same weights.
        margin: Standard deviations added, >= 0; 0 returns ``mean``.

    Raises:
        ValueError: ``margin`` negative or not a number, or the layer counts differ.
    """
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise ValueError(f"margin={margin!r} must be a number >= 0 (standard deviations).")
    if len(mean) != len(squares):
        raise ValueError(f"mean has {len(mean)} layers but squares has {len(squares)}.")
    if margin == 0:
        return list(mean)
    out = []
    for m, s in zip(mean, squares, strict=True):
        # Rounding can leave the mean of squares a hair below the squared mean: no spread then.
        spread = {f: math.sqrt(max(0.0, getattr(s, f) - getattr(m, f) ** 2)) for f in TIME_FIELDS}
        out.append(dataclasses.replace(m, **{f: getattr(m, f) + margin * spread[f] for f in TIME_FIELDS}))
    return out
