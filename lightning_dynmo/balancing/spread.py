"""How much each layer's averaged cost moves between windows, and the margin a decision plans with.

A decision searches hundreds of placements on each layer's moving average of its measured times
(:func:`~lightning_dynmo.balancing.policy.smooth_costs`). Where a layer's cost swings from step to step (an
MoE layer whose router sends a step's tokens to two experts, then spreads the next step's), the average
says where its cost sits, not how far it strays, and the search then picks the placement that fits the
average best: the one that packs the layers that happened to be light beside each other. When they swing
back, that stage is the step's slowest. This is the winner's curse of a search over noisy costs: at 48 MoE
layers on 16 ZBV ranks (1-2 layers a stage) the every-step policy on the average alone moved several
times in each replay of the MoE trace, each move predicted 2% or more faster, and ran 1.048x the uniform
split's steps; planning one standard deviation above the average, 0.995x (``python -m
benchmarks.cost_smoothing``, ``benchmarks/results/cost_smoothing-2026-12-01-margin.md``, projected).

A decision therefore plans each layer at its average plus ``margin`` standard deviations of the
averaged windows (:func:`with_margin`; the weight-gradient part of a split backward keeps its share of
the backward, which it is part of): a layer that keeps still costs what it measures, a layer that
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
#: The times that take their own margin; ``bwd_weight_time_s``, a part of ``bwd_time_s``, keeps its share.
_OWN_MARGIN = ("fwd_time_s", "bwd_time_s", "update_time_s")


def squared_times(costs: Sequence[LayerCost]) -> list[LayerCost]:
    """``costs`` with every time squared (sizes kept): what a moving average of squares averages."""
    return [dataclasses.replace(c, **{f: getattr(c, f) ** 2 for f in TIME_FIELDS}) for c in costs]


def with_margin(mean: Sequence[LayerCost], squares: Sequence[LayerCost], margin: float) -> list[LayerCost]:
    """Each layer's averaged times plus ``margin`` standard deviations (sizes as in ``mean``).

    The forward, the backward and the update each take their own standard deviation; the backward's
    weight-gradient part (``bwd_weight_time_s``, which a split-backward schedule runs apart) keeps the
    share of the backward it has on average, so it never exceeds the backward it belongs to.

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
        planned = {
            f: getattr(m, f) + margin * math.sqrt(max(0.0, getattr(s, f) - getattr(m, f) ** 2))
            for f in _OWN_MARGIN
        }
        share = m.bwd_weight_time_s / m.bwd_time_s if m.bwd_time_s > 0 else 0.0
        planned["bwd_weight_time_s"] = min(planned["bwd_time_s"], share * planned["bwd_time_s"])
        out.append(dataclasses.replace(m, **planned))
    return out
