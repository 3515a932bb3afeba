"""Replay a recorded cost trace in a real pipeline: every step, each block sleeps its recorded cost.

:class:`TraceReplay` reads a :class:`~lightning_dynmo.balancing.trace.CostTrace` (per step, every
layer's and part's cost) and, at the start of every training step, sets the
:class:`~lightning_dynmo.demos.EmulatedCost` of each block this rank holds (by global layer index) and of
the :class:`~lightning_dynmo.demos.DemoGPT`'s first and last parts. The sleep is a plain attribute of the
block, so a block migrated by DynMo keeps being set by whichever rank owns it; DynMo itself stays live
(it profiles the sleeps, decides and migrates for real). Trace seconds are per whole step; a block sleeps
per micro-batch, so each is divided by the micro-batch count.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.trace import CostTrace

__all__ = ["TraceReplay"]


class TraceReplay(Callback):
    """Set every local block's and part's emulated cost from ``trace`` at each step.

    Step ``s`` replays row ``min(s // steps_per_row, last row)``: a trace shorter than the run holds
    its last row.

    Args:
        trace: The costs to replay, in the emulated pipeline's seconds (scale them first with
            :meth:`~lightning_dynmo.balancing.trace.CostTrace.scaled`).
        num_microbatches: The pipeline's micro-batches per step (a block sleeps once per micro-batch).
        steps_per_row: Training steps each trace row lasts (>= 1).
    """

    def __init__(self, trace: CostTrace, num_microbatches: int, steps_per_row: int = 1) -> None:
        for name, value in (("num_microbatches", num_microbatches), ("steps_per_row", steps_per_row)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TraceReplay({name}={value!r}) must be an integer >= 1.")
        self.trace = trace
        self.num_microbatches = num_microbatches
        self.steps_per_row = steps_per_row

    def row(self, step: int) -> int:
        """The trace row replayed at global step ``step``."""
        return min(step // self.steps_per_row, self.trace.num_rows - 1)

    def _set(self, cost: Any, record: LayerCost) -> None:
        cost.fwd_ms = 1e3 * record.fwd_time_s / self.num_microbatches
        cost.bwd_ms = 1e3 * record.bwd_time_s / self.num_microbatches

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        costs = self.trace.rows[self.row(trainer.global_step)]
        layers = getattr(pl_module, "layers", {})
        beyond = sorted(int(name) for name in layers if int(name) >= len(costs.layers))
        if beyond:
            raise ValueError(
                f"the trace has {len(costs.layers)} layers but this rank holds layers {beyond}; replay a "
                "trace of the model's own layer count."
            )
        for name, block in layers.items():  # the blocks this rank owns, by global index
            self._set(block.cost, costs.layers[int(name)])
        for attr, record in (("first_cost", costs.first), ("last_cost", costs.last)):
            part = getattr(pl_module, attr, None)
            if part is not None:
                self._set(part, record)
