"""A scripted dynamic model for demos and benchmarks: emulated layer costs that change at a known step.

:class:`ScheduledCostChange` rescales the :class:`~lightning_dynmo.demos.EmulatedCost` of chosen blocks
of a :class:`~lightning_dynmo.demos.DemoGPT` at a given optimizer step and announces it with
:func:`~lightning_dynmo.events.notify_dynamism`, as a real dynamic model (pruning, freezing, early exit)
would. Each rank changes the blocks it owns; the new cost is a plain attribute of the block, so it
travels with the block when DynMo migrates it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dynmo.events import EVENT_KINDS, notify_dynamism


class ScheduledCostChange(Callback):
    """Multiply the emulated forward and backward cost of some blocks by a factor at step ``at_step``.

    Args:
        at_step: The global step (optimizer steps done) at whose start the change happens; >= 0.
        scale: Global block index -> cost factor (>= 0), e.g. ``{4: 0.1, 5: 0.1}`` for an early exit
            that leaves the last blocks with a tenth of the tokens.
        bwd_scale: Optional separate factors for the backward cost (e.g. ``0.0`` for a frozen
            prefix, which needs no backward at all); blocks not listed use ``scale``.
        kind: The dynamism event kind announced (``"custom"``, ``"frozen"``, ``"pruned"``, ...).
    """

    def __init__(
        self,
        at_step: int,
        scale: Mapping[int, float],
        bwd_scale: Mapping[int, float] | None = None,
        kind: str = "custom",
    ) -> None:
        if not isinstance(at_step, int) or at_step < 0:
            raise ValueError(f"at_step={at_step!r} must be an integer step >= 0.")
        factors = {**scale, **(bwd_scale or {})}
        bad = {k: v for k, v in factors.items() if not isinstance(k, int) or k < 0 or v < 0}
        if bad:
            raise ValueError(f"scale/bwd_scale entries {bad!r} must map block indices >= 0 to factors >= 0.")
        if kind not in EVENT_KINDS:
            raise ValueError(f"kind={kind!r} is not a dynamism event kind; use one of {EVENT_KINDS}.")
        self.at_step = at_step
        self.scale = dict(scale)
        self.bwd_scale = dict(bwd_scale or {})
        self.kind = kind
        self.done = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.done or trainer.global_step != self.at_step:
            return
        self.done = True
        blocks = sorted(set(self.scale) | set(self.bwd_scale))
        layers = getattr(pl_module, "layers", {})
        for index in blocks:
            if str(index) not in layers:
                continue  # another rank owns it and changes it there
            cost = layers[str(index)].cost
            cost.fwd_ms *= self.scale.get(index, 1.0)
            cost.bwd_ms *= self.bwd_scale.get(index, self.scale.get(index, 1.0))
        notify_dynamism(self.kind, layers=blocks, step=trainer.global_step, detail="scheduled cost change")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict["done"])


class RoutingNoise(Callback):
    """Fine-grained dynamism like MoE/MoD routing: every step each block's emulated cost is redrawn.

    At the start of every step, block ``i``'s cost becomes its original cost times a factor drawn
    uniformly from ``[1 - amplitude, 1 + amplitude]``. The factor depends only on ``(seed, step, i)``, so
    the draw is the same whichever rank owns the block and however often it migrated.

    Args:
        amplitude: Relative spread of the per-step cost, in ``[0, 1]``.
        seed: Seed of the draws.
        announce: Also publish a ``"routing"`` dynamism event each step (for callbacks that rebalance on
            events rather than every step).
    """

    def __init__(self, amplitude: float = 0.5, seed: int = 0, announce: bool = False) -> None:
        if not 0.0 <= amplitude <= 1.0:
            raise ValueError(f"amplitude={amplitude!r} must be within [0, 1] (a relative cost spread).")
        self.amplitude = float(amplitude)
        self.seed = int(seed)
        self.announce = announce

    def factor(self, step: int, layer: int) -> float:
        """The cost factor of ``layer`` at ``step``."""
        draw = random.Random(f"{self.seed}:{step}:{layer}").random()
        return 1.0 + self.amplitude * (2.0 * draw - 1.0)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        for name, block in getattr(pl_module, "layers", {}).items():
            cost = block.cost
            if not hasattr(cost, "base_ms"):
                cost.base_ms = (cost.fwd_ms, cost.bwd_ms)  # travels with the block when it migrates
            f = self.factor(step, int(name))
            cost.fwd_ms, cost.bwd_ms = cost.base_ms[0] * f, cost.base_ms[1] * f
        if self.announce:
            notify_dynamism("routing", step=step, detail=f"routing noise +-{self.amplitude:.0%}")
