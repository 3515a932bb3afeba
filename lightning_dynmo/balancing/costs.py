"""Per-layer cost records, the only input the balancers read.

A :class:`LayerCost` describes one pipeline layer (one transformer block). It can come from the
profiler, from an emulated cost model, or from a file: the balancers do not care. Balancers look at
a *view* of these records, ``by="time"`` (forward + backward seconds) or ``by="params"``
(parameter count), as in the paper's four balancer variants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

CostView = Literal["time", "params"]
COST_VIEWS: tuple[str, ...] = ("time", "params")


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, measured or modelled.

    Attributes:
        fwd_time_s: Forward time of the layer for one whole training step (all micro-batches), seconds.
        bwd_time_s: Backward time of the layer for one whole training step, seconds.
        bwd_weight_time_s: The part of ``bwd_time_s`` spent in weight-gradient passes, measured under
            the schedules that split backward into input and weight gradients (zero-bubble, DualPipeV);
            0 where they were not split (the step model then assumes a share). Equal to ``bwd_time_s``
            where the whole backward ran in a weight pass: torch's split schedules run the first
            stage's backward unsplit there, so on another stage the step model splits it by the share
            (at the cost :func:`~lightning_dynmo.balancing.hardware.whole_backward_ratio` gives).
        num_params: Number of trainable-or-not parameters the layer holds (after pruning: the
            non-zero ones, if the layer is sparse).
        memory_bytes: Device memory the layer needs on the stage that owns it: parameters, gradients,
            optimizer state and activations held for the schedule's in-flight micro-batches.
        activation_bytes: Bytes the layer sends downstream per micro-batch (its output activation),
            which is what crosses a stage boundary if the next layer lives on another stage.
        update_time_s: The layer's share of one optimizer update (once per step, after the pipeline's
            flush; every stage updates its own layers in parallel), seconds. The profiler times the
            update and shares it among a rank's layers and parts by the parameter entries that got a
            gradient (a frozen layer's share is 0). The step model adds the largest stage's sum once
            per step (:func:`~lightning_dynmo.balancing.step_prediction.predict_step`); 0 where it was
            not measured (traces, emulated costs), which leaves the step as before.
    """

    fwd_time_s: float = 0.0
    bwd_time_s: float = 0.0
    num_params: int = 0
    bwd_weight_time_s: float = 0.0
    memory_bytes: int = 0
    activation_bytes: int = 0
    update_time_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"LayerCost.{f.name} must be a number, got {value!r}.")
            if math.isnan(value) or math.isinf(value) or value < 0:
                raise ValueError(
                    f"LayerCost.{f.name} must be a finite number >= 0, got {value!r}. "
                    "Costs are durations and sizes; clamp or drop the bad measurement before balancing."
                )
        if self.bwd_weight_time_s > self.bwd_time_s * (1 + 1e-9):
            raise ValueError(
                f"LayerCost.bwd_weight_time_s={self.bwd_weight_time_s!r} exceeds "
                f"bwd_time_s={self.bwd_time_s!r}; it is the weight-gradient part of the backward time."
            )

    @property
    def time_s(self) -> float:
        """Forward plus backward time for one training step, seconds."""
        return self.fwd_time_s + self.bwd_time_s


def check_view(by: str) -> None:
    """Raise a ``ValueError`` unless ``by`` names a cost view."""
    if by not in COST_VIEWS:
        raise ValueError(f"by={by!r} is not a cost view; use one of {COST_VIEWS}.")


def layer_weights(costs: Sequence[LayerCost], by: str = "time") -> list[float]:
    """The scalar weight of each layer under one cost view.

    Args:
        costs: One record per layer, in layer order.
        by: ``"time"`` (forward + backward seconds) or ``"params"`` (parameter count).

    Returns:
        One float per layer.
    """
    check_view(by)
    if by == "time":
        return [c.time_s for c in costs]
    return [float(c.num_params) for c in costs]


def check_costs(costs: Sequence[LayerCost], name: str = "costs") -> None:
    """Raise a ``ValueError`` unless ``costs`` is a non-empty sequence of :class:`LayerCost`."""
    if len(costs) == 0:
        raise ValueError(f"{name} is empty; pass one LayerCost per layer (at least one layer).")
    for i, c in enumerate(costs):
        if not isinstance(c, LayerCost):
            raise ValueError(
                f"{name}[{i}] is a {type(c).__name__}, not a LayerCost; build records with "
                "LayerCost(fwd_time_s=..., bwd_time_s=..., num_params=..., ...)."
            )
