"""Replay a recorded cost trace in a real pipeline: every step, each block sleeps its recorded cost.

:class:`TraceReplay` reads a :class:`~lightning_dynmo.balancing.trace.CostTrace` (per step, every
layer's and part's cost) and, at the start of every training step, sets the
:class:`~lightning_dynmo.demos.EmulatedCost` of each block this rank holds (by global layer index) and of
the :class:`~lightning_dynmo.demos.DemoGPT`'s first and last parts. The sleep is a plain attribute of the
block, so a block migrated by DynMo keeps being set by whichever rank owns it; DynMo itself stays live
(it profiles the sleeps, decides and migrates for real). Trace seconds are per whole step; a block sleeps
per micro-batch, so each is divided by the micro-batch count.

A call costs more than its sleep: the block's own compute and the sleep's wake-up (about 0.1-0.4 ms a
call on a CPU), which at a millisecond a block would flatten the trace's differences. Given the
:class:`CallOverhead` that :func:`measure_call_overhead` measured on the model, TraceReplay sleeps the
trace's cost less that overhead, so each call costs what the trace says; a cost below the overhead cannot
be reached, and :meth:`CallOverhead.replayed` states the costs the pipeline really runs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.trace import CostTrace, StepCosts
from lightning_dynmo.demos.emulated_block import EmulatedBlock
from lightning_dynmo.demos.gpt import DemoGPT
from lightning_dynmo.events import EVENT_KINDS, notify_dynamism

__all__ = ["CallOverhead", "TraceReplay", "measure_call_overhead"]


@dataclass(frozen=True)
class CallOverhead:
    """What one call costs beyond its sleep, per micro-batch (seconds in ``fwd_time_s`` / ``bwd_time_s``).

    Attributes:
        block: A block's forward and backward call: its compute and the sleep's wake-up.
        part: A part's (the first- or last-stage emulated cost): the sleep's wake-up.
    """

    block: LayerCost
    part: LayerCost

    def replayed(self, trace: CostTrace, num_microbatches: int) -> CostTrace:
        """The costs a pipeline compensated for this overhead really runs: per call, at least the overhead."""

        def floor(cost: LayerCost, least: LayerCost) -> LayerCost:
            return dataclasses.replace(
                cost,
                fwd_time_s=max(cost.fwd_time_s, num_microbatches * least.fwd_time_s),
                bwd_time_s=max(cost.bwd_time_s, num_microbatches * least.bwd_time_s),
            )

        rows = tuple(
            StepCosts(
                tuple(floor(c, self.block) for c in r.layers),
                floor(r.first, self.part),
                floor(r.last, self.part),
            )
            for r in trace.rows
        )
        return dataclasses.replace(trace, rows=rows)

    def describe(self) -> str:
        """One line: the overhead per call, microseconds."""
        return (
            f"a block call costs {1e6 * self.block.fwd_time_s:.0f} us forward / "
            f"{1e6 * self.block.bwd_time_s:.0f} us backward beyond its sleep, a part "
            f"{1e6 * self.part.fwd_time_s:.0f} / {1e6 * self.part.bwd_time_s:.0f} us"
        )


def _timed_calls(module: torch.nn.Module, cost: Any, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of ``module`` on ``x`` beyond what ``cost`` sleeps."""
    fwd, bwd = [], []
    for _ in range(repeats):
        inp = x.detach().requires_grad_()
        start = time.perf_counter()
        out = module(inp)
        mid = time.perf_counter()
        out.sum().backward()
        fwd.append(mid - start - cost.fwd_ms / 1e3)
        bwd.append(time.perf_counter() - mid - cost.bwd_ms / 1e3)
    return max(0.0, statistics.median(fwd)), max(0.0, statistics.median(bwd))


def measure_call_overhead(
    model: DemoGPT, microbatch_size: int, seq_len: int, repeats: int = 50, sleep_ms: float = 1.0
) -> CallOverhead:
    """Time block ``"0"`` of ``model`` and its last part, each sleeping ``sleep_ms`` forward (2x backward).

    Run it in the process that replays (same threads, same machine load) before the ranks start.
    The model's costs are restored afterwards.
    """
    block = cast(EmulatedBlock, model.layers["0"])
    d_model = model.config.d_model
    x = torch.randn(microbatch_size, seq_len, d_model)
    results = []
    for module, cost in ((block, block.cost), (model.last_cost, model.last_cost)):
        saved = (cost.fwd_ms, cost.bwd_ms)
        cost.fwd_ms, cost.bwd_ms = sleep_ms, 2 * sleep_ms
        try:
            _timed_calls(module, cost, x, 3)  # warm up
            f, b = _timed_calls(module, cost, x, repeats)
        finally:
            cost.fwd_ms, cost.bwd_ms = saved
        results.append(LayerCost(fwd_time_s=f, bwd_time_s=b))
    return CallOverhead(*results)


class TraceReplay(Callback):
    """Set every local block's and part's emulated cost from ``trace`` at each step.

    A block built with ``split_backward`` (:class:`~lightning_dynmo.demos.DemoConfig`) sleeps each
    record's ``bwd_weight_time_s`` in its weight-gradient pass and the rest of ``bwd_time_s`` in its
    input-gradient pass; other costs sleep the whole backward at once.

    Step ``s`` replays row ``min(max(0, s - lead_steps) // steps_per_row, last row)``: a trace shorter
    than the run holds its last row. With ``spread_over=n`` the trace is spread evenly over ``n`` steps
    instead (row ``s * rows // n``): a run shorter than the trace skips rows evenly rather than stopping
    early.

    With ``announce``, the replay tells DynMo when the model changes, as the dynamism callbacks do (a
    pruning stage, a freezing decision): at the start of every step that replays another row than the
    step before with other costs (the first step included), each rank publishes a
    :class:`~lightning_dynmo.events.DynamismEvent` of that kind on the default bus.

    Args:
        trace: The costs to replay, in the emulated pipeline's seconds (scale them first with
            :meth:`~lightning_dynmo.balancing.trace.CostTrace.scaled`).
        num_microbatches: The pipeline's micro-batches per step (a block sleeps once per micro-batch).
        steps_per_row: Training steps each trace row lasts (>= 1).
        overhead: What a call costs beyond its sleep (:func:`measure_call_overhead`): subtracted from
            every sleep. ``None``: sleep the trace's costs as they are.
        spread_over: Spread the trace's rows evenly over this many steps (>= 1); ``None``: use
            ``steps_per_row``.
        lead_steps: Steps the first row lasts beyond ``steps_per_row`` (>= 0; a run's untimed start).
        announce: The event kind to publish at each new row (see :data:`~lightning_dynmo.events.EVENT_KINDS`);
            ``None``: publish nothing.
    """

    def __init__(
        self,
        trace: CostTrace,
        num_microbatches: int,
        steps_per_row: int = 1,
        overhead: CallOverhead | None = None,
        spread_over: int | None = None,
        lead_steps: int = 0,
        announce: str | None = None,
    ) -> None:
        checked = {"num_microbatches": num_microbatches, "steps_per_row": steps_per_row}
        if spread_over is not None:
            checked["spread_over"] = spread_over
        for name, value in checked.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TraceReplay({name}={value!r}) must be an integer >= 1.")
        if isinstance(lead_steps, bool) or not isinstance(lead_steps, int) or lead_steps < 0:
            raise ValueError(f"TraceReplay(lead_steps={lead_steps!r}) must be an integer >= 0.")
        if spread_over is not None and lead_steps:
            raise ValueError(
                f"TraceReplay(spread_over={spread_over}, lead_steps={lead_steps}): a lead goes with "
                "steps_per_row (spread_over places the rows itself); pass one of them."
            )
        if announce is not None and announce not in EVENT_KINDS:
            raise ValueError(f"TraceReplay(announce={announce!r}) must be None or one of {EVENT_KINDS}.")
        self.trace = trace
        self.num_microbatches = num_microbatches
        self.steps_per_row = steps_per_row
        self.overhead = overhead
        self.spread_over = spread_over
        self.lead_steps = lead_steps
        self.announce = announce
        self._last_row: int | None = None

    def row(self, step: int) -> int:
        """The trace row replayed at global step ``step``."""
        if self.spread_over is not None:
            return min(step * self.trace.num_rows // self.spread_over, self.trace.num_rows - 1)
        return min(max(0, step - self.lead_steps) // self.steps_per_row, self.trace.num_rows - 1)

    def _set(self, cost: Any, record: LayerCost, overhead: LayerCost | None) -> None:
        m = self.num_microbatches
        fwd_s, bwd_s = record.fwd_time_s / m, record.bwd_time_s / m
        split = getattr(cost, "anchor", None) is not None  # a split backward: its weight part sleeps apart
        wgrad_s = record.bwd_weight_time_s / m if split else 0.0
        bwd_s -= wgrad_s
        if overhead is not None:
            fwd_s, bwd_s = max(0.0, fwd_s - overhead.fwd_time_s), max(0.0, bwd_s - overhead.bwd_time_s)
        cost.fwd_ms, cost.bwd_ms = 1e3 * fwd_s, 1e3 * bwd_s
        if split:  # every row sets it: a row whose layer has no weight pass (a frozen one) sleeps none
            cost.wgrad_ms = 1e3 * wgrad_s

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        row = self.row(step)
        last = self._last_row
        if self.announce is not None and (last is None or self.trace.rows[row] != self.trace.rows[last]):
            notify_dynamism(self.announce, step=step, detail=f"the replayed trace's row {row}")
        self._last_row = row
        costs = self.trace.rows[row]
        layers = getattr(pl_module, "layers", {})
        beyond = sorted(int(name) for name in layers if int(name) >= len(costs.layers))
        if beyond:
            raise ValueError(
                f"the trace has {len(costs.layers)} layers but this rank holds layers {beyond}; replay a "
                "trace of the model's own layer count."
            )
        o = self.overhead
        for name, block in layers.items():  # the blocks this rank owns, by global index
            self._set(block.cost, costs.layers[int(name)], o.block if o else None)
        for attr, record in (("first_cost", costs.first), ("last_cost", costs.last)):
            part = getattr(pl_module, attr, None)
            if part is not None:
                self._set(part, record, o.part if o else None)
