"""Every cost the balancer reads, assembled in one place: blocks, first/last parts, links, worker speeds.

Read :meth:`CostMeter.measure` first: the window's per-layer and per-part costs gathered over the pipeline,
scaled to the reference (fastest) worker when worker speeds are measured, smoothed against the previous
window, and the links' seconds per layer output; then :meth:`CostMeter.per_action_s` (the runtime's own
cost of an action, which the decision's predictions add) and :meth:`CostMeter.retune_options` (what a
re-pack with a micro-batch re-tune may pick). Every method that says "a collective" runs on every active rank.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from lightning_dynmo.balancing.averaging import HistoryWeight
from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.hardware import Hardware, scaled, to_reference, worker_slowdown
from lightning_dynmo.balancing.microbatches import RetuneOptions
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.policy import smooth_costs
from lightning_dynmo.balancing.problem import BalanceProblem
from lightning_dynmo.balancing.spread import squared_times, with_margin
from lightning_dynmo.balancing.step_prediction import fit_per_op
from lightning_dynmo.callback.config import ProfilingConfig
from lightning_dynmo.callback.control_plane import exchange_rows
from lightning_dynmo.pipeline import retune_candidates, schedule_order
from lightning_dynmo.profiling import ProfileResult, inflight_microbatches, measure_boundary_comm_s
from lightning_dynmo.profiling.gather import gather_costs
from lightning_dynmo.profiling.speed import time_reference_workload
from lightning_dynmo.strategy.view import PipelineView

__all__ = ["PER_ACTION_TOLERANCE", "SPEED_TOLERANCE", "CostMeter"]

#: Workers whose reference workload runs within this fraction of the fastest count as equally fast.
SPEED_TOLERANCE = 0.05
#: The runtime's cost per action is fitted to this fraction of the measured step.
PER_ACTION_TOLERANCE = 1e-5


class CostMeter:
    """Turns a profiling window's result into the balancer's costs and hardware, window after window.

    Args:
        profiling: The resolved profiling knobs (smoothing weight, link and speed measurement).
        metrics: Where measured values to log are queued (``dynmo/rank{r}/slowdown``,
            ``dynmo/link{l}/send_s``, ``dynmo/per_op_s``).
    """

    def __init__(self, profiling: ProfilingConfig, metrics: dict[str, float]) -> None:
        assert profiling.cost_smoothing is not None, "pass ProfilingConfig.resolved()"
        self.smoothing: float = profiling.cost_smoothing
        self.margin: float = profiling.cost_margin
        self.measure_comm = profiling.measure_comm
        self.measure_speed = profiling.measure_speed
        self._speed_probe: Callable[[torch.device, torch.dtype], float] = (
            profiling.speed_probe or time_reference_workload
        )
        self._metrics = metrics
        self.last_costs: list[LayerCost] | None = None  # on the reference worker (see measure_speed)
        self._squares: list[LayerCost] | None = None  # the same average of the squared times
        self._history = HistoryWeight(self.smoothing)  # bias-corrected, aged by the steps between windows
        self.last_hardware: Hardware | None = None  # the parts, speeds and links of the last decision
        self._link_s_per_byte: list[float] | None = None

    def measure(
        self, view: PipelineView, result: ProfileResult, reason: str, dtype: torch.dtype, step: int
    ) -> tuple[list[LayerCost], Hardware]:
        """Every layer's and part's cost on the reference worker, the worker speeds and the links.

        A collective over the pipeline group (costs, links) and the active ranks (speeds).

        Args:
            view: The pipeline the window ran on.
            result: This rank's window.
            reason: What opened the window: an ``"event"`` window starts fresh (no smoothing), an
                ``"every_step"`` one reuses the last link measurement.
            dtype: The model's parameter dtype, for the speed probe.
            step: The global step the window closed at: the averaged costs age by the steps since the
                last window (:class:`~lightning_dynmo.balancing.averaging.HistoryWeight`).

        Returns:
            The costs the decision plans with: each layer's averaged times plus ``cost_margin`` standard
            deviations of the averaged windows (:func:`~lightning_dynmo.balancing.spread.with_margin`;
            :attr:`last_costs` keeps the average itself), and the hardware.
        """
        placement, schedule = view.placement, view.schedule_name
        stages, microbatches = view.num_stages, view.num_microbatches
        inflight = inflight_microbatches(schedule, 0, stages, microbatches)
        parts = result.part_costs(
            {"first": inflight, "last": inflight_microbatches(schedule, stages - 1, stages, microbatches)}
        )
        gathered = gather_costs(
            result.layer_costs(inflight),
            placement.num_layers,
            view.pipeline_group,
            view.root_device,
            local_parts=parts,
        )
        costs, first, last = gathered.layers, gathered.first, gathered.last
        slowdown = self._worker_slowdown(view, dtype) if self.measure_speed else None
        if slowdown is not None:
            workers = view.stage_workers(placement) or list(range(stages))
            costs = to_reference(costs, placement, workers, slowdown)
            first = None if first is None else scaled(first, 1.0 / slowdown[workers[0]])
            last = None if last is None else scaled(last, 1.0 / slowdown[workers[-1]])
        fresh = reason == "event" or self.last_costs is None
        if fresh:
            self._history.restart()
        weight = self._history.next(step)
        self._squares = smooth_costs(None if fresh else self._squares, squared_times(costs), weight)
        costs = smooth_costs(None if fresh else self.last_costs, costs, weight)
        before = None if fresh else self.last_hardware
        first = _smooth_part(None if before is None else before.first_stage_extra, first, weight)
        last = _smooth_part(None if before is None else before.last_stage_extra, last, weight)
        comm = self._link_times(view, costs, reason) if self.measure_comm else None
        self._queue_hardware_metrics(slowdown, comm, placement, view.pipeline_size)
        self.last_costs, self.last_hardware = costs, Hardware(first, last, slowdown, comm)
        return with_margin(costs, self._squares, self.margin), self.last_hardware

    def per_action_s(self, view: PipelineView, problem: BalanceProblem, measured_s: float | None) -> float:
        """The runtime's own seconds per action, which every prediction of the decision adds.

        What the running placement's hook-free steps (``measured_s``:
        :meth:`~lightning_dynmo.balancing.gain.GainMeter.quiet_step_s`, agreed by every rank) took beyond
        ``problem``'s predicted work, spread over the schedule's actions
        (:func:`~lightning_dynmo.balancing.step_prediction.fit_per_op`): launching each op, the
        schedule's bookkeeping, the machine's load as it is (the optimizer update is measured: the costs'
        ``update_time_s``, which the prediction adds once per step). Local (no collective).

        ``measured_s=None`` gives 0 (bare work): the ``"params"`` view, or no hook-free step of the model
        as it is on this placement (a window right after a dynamism event). A window's steps carry the
        profiler and a model that just changed, whose excess is no fixed cost of an action: fitted on
        them, the quick start's freezing move was predicted +13.8% and measured +23%.
        """
        if measured_s is None:
            return 0.0
        return fit_per_op(
            problem,
            view.placement,
            schedule_order(view.schedule_name),
            view.num_microbatches,
            measured_s,
            view.stage_workers(view.placement),
            tolerance_s=PER_ACTION_TOLERANCE * measured_s,
        )

    def retune_options(
        self, view: PipelineView, result: ProfileResult, batch_size: int, busy_s: list[float]
    ) -> RetuneOptions:
        """The micro-batch counts each re-pack may run, and the measured fixed cost of an op; a collective.

        An op's fixed cost is a rank's busy time in the window's measured steps beyond its own units'
        work and the profiler's hooks, per forward or backward op; the slowest rank's (clamped at 0).

        Args:
            view: The pipeline the window ran on.
            result: This rank's window.
            batch_size: The size of the batch that closed the window (it bounds the counts).
            busy_s: This rank's busy seconds in the window's measured steps.
        """
        units = [*result.layers.values(), *result.parts.values()]
        work_s = sum(p.fwd_time_s + p.bwd_time_s for p in units) + result.hook_time_s
        median_busy_s = statistics.median(busy_s) if busy_s else work_s
        ops = 2 * view.num_microbatches * len(view.stage_indices)
        mine = torch.tensor(
            [max(0.0, median_busy_s - work_s) / ops], dtype=torch.float64, device=view.root_device
        )
        per_op_s = float(exchange_rows(mine, view.active_ranks, view.control_group)[:, 0].max())
        stages_per_rank = len(view.stage_indices)
        layouts = view.repack_layouts()
        stage_counts = list(layouts) if layouts is not None else list(range(1, view.num_stages + 1))
        counts = {k: retune_candidates(view.schedule, k // stages_per_rank, batch_size) for k in stage_counts}
        self._metrics["dynmo/per_op_s"] = per_op_s
        return RetuneOptions(counts=counts, per_op_s=per_op_s)

    def _worker_slowdown(self, view: PipelineView, dtype: torch.dtype) -> list[float] | None:
        """Per pipeline rank, its slowdown against the fastest (``None``: all alike); a collective."""
        seconds = float(self._speed_probe(view.root_device, dtype))
        mine = torch.tensor([seconds], dtype=torch.float64, device=view.root_device)
        times = exchange_rows(mine, view.active_ranks, view.control_group)[:, 0].tolist()
        positions = [view.pipeline_rank_of(r) for r in view.active_ranks]
        return worker_slowdown(times, positions, SPEED_TOLERANCE)

    def _link_times(
        self, view: PipelineView, costs: list[LayerCost], reason: str
    ) -> list[list[float]] | None:
        """Per link, per layer: seconds to send that layer's output over the link (one row per link).

        Each link's seconds per byte are measured with the boundary's activation in every window but
        the every-step ones (they reuse the last measurement, as long as the pipeline has not changed).
        """
        if len(view.stage_indices) != 1 or view.pipeline_size < 2:
            return None  # virtual stages share ranks: a rank-pair stream does not measure them
        placement = view.placement
        links = placement.num_stages - 1
        stale = self._link_s_per_byte is None or len(self._link_s_per_byte) != links
        if stale or reason != "every_step":
            last_layers = [placement.layers_of(s)[-1] for s in range(links)]
            sizes = [costs[i].activation_bytes for i in last_layers]
            seconds = measure_boundary_comm_s(sizes, view.pipeline_group, view.root_device)
            self._link_s_per_byte = [t / max(b, 1) for t, b in zip(seconds, sizes, strict=True)]
        assert self._link_s_per_byte is not None
        return [[c.activation_bytes * per_byte for c in costs] for per_byte in self._link_s_per_byte]

    def _queue_hardware_metrics(
        self, slowdown: list[float] | None, comm: list[list[float]] | None, placement: Placement, ranks: int
    ) -> None:
        if self.measure_speed:
            for rank, factor in enumerate(slowdown or [1.0] * ranks):
                self._metrics[f"dynmo/rank{rank}/slowdown"] = factor
        for link, row in enumerate(comm or []):
            self._metrics[f"dynmo/link{link}/send_s"] = row[placement.layers_of(link)[-1]]


def _smooth_part(previous: LayerCost | None, measured: LayerCost | None, weight: float) -> LayerCost | None:
    """:func:`smooth_costs` for one pinned part (absent on either side: the measurement)."""
    if previous is None or measured is None:
        return measured
    return smooth_costs([previous], [measured], weight)[0]
