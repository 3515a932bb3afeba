"""What a model runs on besides its blocks: pinned parts, workers (speed, memory) and links (pure Python).

Read in this order: :class:`Hardware` (what every balancer takes, inside a
:class:`~lightning_dynmo.balancing.problem.BalanceProblem`), :func:`stage_times` (what each stage of a
placement then costs, the input of the pipeline simulator) and :func:`whole_backward_ratio` (what a
backward costs run whole against split, from the profile), then the two helpers that turn measurements
into a :class:`Hardware`: :func:`worker_slowdown` (per-rank times of one reference workload -> slowdown
factors) and :func:`to_reference` (costs measured on their owners' workers -> costs on the reference
worker, which is what the balancers weigh).

A layer moved to a slower worker costs more there: the balancers take costs on a *reference* worker and
each worker's slowdown factor (see :mod:`lightning_dynmo.balancing.stage_model`). The profiler measures a
layer on the worker that owns it, so its time is divided by that worker's factor first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import TYPE_CHECKING

from lightning_dynmo.balancing._checks import CommTime, MemoryCapacity, PerWorker, check_extras, comm_rows
from lightning_dynmo.balancing.costs import LayerCost, layer_weights
from lightning_dynmo.balancing.placement import Placement

if TYPE_CHECKING:
    from lightning_dynmo.balancing.problem import BalanceProblem


@dataclass(frozen=True)
class Hardware:
    """What the model runs on, beyond the layer costs: pinned parts, workers and links.

    Attributes:
        first_stage_extra: The first-stage parts (embedding), always on stage 0.
        last_stage_extra: The last-stage parts (final norm, head, loss), always on the last stage.
        worker_slowdown: Per worker (pipeline rank), how many times longer it takes than the reference
            worker the costs are expressed in (1.0 = the reference, 2.0 = half as fast): a sequence
            indexed by worker id, or a mapping keyed by it; ``None``: every worker is the reference.
            The per-stage balancers run stage ``s`` on worker ``s`` (:meth:`per_stage` derives that
            view for workers that run several stages).
        comm_time_s: Activation send times: one number, one per layer (every link alike), or one row
            per link (row ``r``: pipeline rank ``r`` -> ``r + 1``) of one per layer; ``None``: free
            links. A send is paid by the sending stage, only with ``by="time"``.
        memory_capacity_bytes: Memory caps in bytes: ``None`` (unlimited), one number for every stage,
            one per stage, or (for :func:`~lightning_dynmo.balancing.workers.partition_workers`) one
            per worker, indexed or keyed by worker id.
        per_op_s: The runtime's own fixed seconds per forward or backward action (launching it, its
            hooks, the schedule's bookkeeping), which every predicted step adds to every action
            (:func:`~lightning_dynmo.balancing.step_prediction.predict_step`; only with ``by="time"``).
            ``0``: bare work, which on a real runtime overstates what a move gains. The balancers'
            stage loads leave it out: every placement runs the same actions.
    """

    first_stage_extra: LayerCost | None = None
    last_stage_extra: LayerCost | None = None
    worker_slowdown: PerWorker = None
    comm_time_s: CommTime = None
    memory_capacity_bytes: MemoryCapacity = None
    per_op_s: float = 0.0

    def __post_init__(self) -> None:
        check_extras(self.first_stage_extra, self.last_stage_extra)
        _check_factors(self.worker_slowdown)
        check_per_op(self.per_op_s)

    def stage_slowdown(self, num_stages: int, stage_workers: Sequence[int] | None) -> list[float] | None:
        """Per stage, the slowdown of its worker (stage ``s`` on worker ``s`` unless ``stage_workers``)."""
        if self.worker_slowdown is None:
            return None
        workers = list(stage_workers) if stage_workers is not None else list(range(num_stages))
        factors = self.worker_slowdown
        if isinstance(factors, Mapping):
            missing = sorted({w for w in workers if w not in factors})
            if missing:
                raise ValueError(f"worker_slowdown has no entry for workers {missing}; give one per worker.")
        elif max(workers) >= len(factors):
            raise ValueError(
                f"worker_slowdown has {len(factors)} entries but the pipeline has workers up "
                f"to {max(workers)}; give one factor per pipeline rank."
            )
        return [float(factors[w]) for w in workers]

    def per_stage(self, num_stages: int, stage_workers: Sequence[int] | None) -> Hardware:
        """This hardware as the per-stage balancers see it: ``worker_slowdown`` one factor per stage."""
        return dataclasses.replace(self, worker_slowdown=self.stage_slowdown(num_stages, stage_workers))

    def links(self, num_layers: int, num_stages: int, by: str) -> list[list[float]] | None:
        """Send times as one row per link of a pipeline of ``num_stages`` (``None`` outside ``time``).

        Per-link rows describe the current links: a smaller pipeline keeps the first ones.
        """
        if self.comm_time_s is None or by != "time" or num_stages < 2:
            return None
        comm = self.comm_time_s
        if isinstance(comm, Sequence) and comm and isinstance(comm[0], Sequence):
            return comm_rows(comm[: num_stages - 1], num_layers, num_stages, by)
        return comm_rows(comm, num_layers, num_stages, by)


def check_per_op(per_op_s: object) -> None:
    """Raise unless ``per_op_s`` is a finite number of seconds >= 0."""
    if isinstance(per_op_s, bool) or not isinstance(per_op_s, (int, float)) or not 0 <= per_op_s < math.inf:
        raise ValueError(f"per_op_s={per_op_s!r} must be a finite number of seconds >= 0.")


def _check_factors(factors: object) -> None:
    """Raise unless ``factors`` is ``None`` or finite factors > 0 per worker (indexed or keyed)."""
    if factors is None:
        return
    if isinstance(factors, Mapping):
        items = list(factors.items())
    elif isinstance(factors, Sequence) and not isinstance(factors, (str, bytes)):
        items = list(enumerate(factors))
    else:
        raise ValueError(f"worker_slowdown={factors!r} must be None, or one factor per worker.")
    for worker, v in items:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(
                f"worker_slowdown[{worker}]={v!r} must be a finite number > 0 (how many times longer the "
                "worker takes than the reference: 1.0 for the reference, 2.0 for half as fast)."
            )


@dataclass(frozen=True)
class StageCosts:
    """What each stage of a placement costs on its worker.

    Attributes:
        fwd_s: Per stage, forward seconds of a whole step (all micro-batches): layers and pinned parts,
            times the worker's slowdown.
        bwd_s: The same for backward.
        send_s: Per stage, seconds to send one micro-batch's boundary activation over its link (0 for
            the last stage), at the micro-batch size the costs were measured with.
        wgrad_s: Per stage, the weight-gradient part of ``bwd_s`` where it was measured apart
            (:attr:`~lightning_dynmo.balancing.costs.LayerCost.bwd_weight_time_s`; 0 otherwise), over
            the records measured split (not those in ``whole_bwd_s``).
        whole_bwd_s: Per stage, the part of ``bwd_s`` from records whose whole backward ran in a
            weight-gradient pass (``bwd_weight_time_s == bwd_time_s``): under a split-backward schedule
            torch runs the first stage's backward unsplit, in its ``W`` action, so what was measured on
            the first stage carries no input/weight split (its share is the schedule's on another stage).
        update_s: Per stage, its optimizer update (the records'
            :attr:`~lightning_dynmo.balancing.costs.LayerCost.update_time_s`, times the worker's
            slowdown; by time only, else 0): once per step, after the flush, every stage at once.
    """

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    send_s: tuple[float, ...]
    wgrad_s: tuple[float, ...]
    whole_bwd_s: tuple[float, ...]
    update_s: tuple[float, ...] = ()

    def per_microbatch(
        self, num_microbatches: int, measured_with: int | None = None, per_op_s: float = 0.0
    ) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of one micro-batch on each stage, for the simulator.

        Work splits evenly over the micro-batches (equal sizes). A send keeps its sender busy (a
        synchronous transfer, as the balancers assume), so it lengthens the stage's forward op.

        Args:
            num_microbatches: Micro-batches per step.
            measured_with: The count the costs were measured with (``None``: ``num_microbatches``); a
                micro-batch that is ``k`` times larger sends ``k`` times the bytes.
            per_op_s: Fixed seconds every forward and backward op costs on top of its work (launch,
                schedule bookkeeping): what makes many small micro-batches slower than a few large ones.
        """
        scale = (measured_with or num_microbatches) / num_microbatches
        fwd = [
            f / num_microbatches + c * scale + per_op_s for f, c in zip(self.fwd_s, self.send_s, strict=True)
        ]
        bwd = [b / num_microbatches + per_op_s for b in self.bwd_s]
        return fwd, bwd


def stage_times(
    problem: BalanceProblem, placement: Placement, stage_workers: Sequence[int] | None = None
) -> StageCosts:
    """Per stage of ``placement``: step forward and backward seconds, and the send of its activation.

    With ``by="params"`` parameter counts stand in for seconds, split 1:2 between forward and backward.
    Per-link send times describe the current links (a smaller pipeline keeps the first ones).

    Args:
        problem: The costs, the view and the hardware.
        placement: The placement to cost.
        stage_workers: The worker of each stage when workers run several stages (``None``: stage ``s``
            on worker ``s``).
    """
    coster = StageCoster.build(problem, placement.num_stages, stage_workers)
    b = placement.boundaries
    rows = [coster.stage(s, b[s], b[s + 1]) for s in range(placement.num_stages)]
    fwd, bwd, send, wgrad, whole, update = (tuple(column) for column in zip(*rows, strict=True))
    return StageCosts(fwd, bwd, send, wgrad, whole, update)


#: One stage's costs, as :meth:`StageCoster.stage` returns them: forward, backward, send, weight-gradient
#: part, whole-backward part and update (the fields of :class:`StageCosts`, for one stage).
StageRow = tuple[float, float, float, float, float, float]


@dataclass(frozen=True)
class StageCoster:
    """What a stage of a given pipeline costs, for any run of layers: :func:`stage_times` one stage at a time.

    Built once per problem and pipeline (stage count and workers), so that a search pricing many
    placements of them reads the records' split, the slowdowns and the links once; a stage's numbers
    are summed in the same order as :func:`stage_times` does, so they are the same floats.

    Attributes:
        costs: The problem's records, one per layer.
        fwd: Per layer, its forward weight in the problem's view (seconds, or a third of its parameters).
        bwd: Per layer, its backward weight likewise.
        first: The first stage's pinned parts, if any.
        last: The last stage's pinned parts, if any.
        extra_fwd: The pinned parts' forward weights (first, then last, those given).
        extra_bwd: Their backward weights likewise.
        slowdown: Per stage, its worker's slowdown.
        links: Per stage boundary, per layer, the send time (``None``: free links, or not the time view).
        timed: Whether the view is ``"time"`` (weight passes and updates count only then).
    """

    costs: Sequence[LayerCost]
    fwd: list[float]
    bwd: list[float]
    first: LayerCost | None
    last: LayerCost | None
    extra_fwd: list[float]
    extra_bwd: list[float]
    slowdown: list[float]
    links: list[list[float]] | None
    timed: bool

    @classmethod
    def build(
        cls, problem: BalanceProblem, num_stages: int, stage_workers: Sequence[int] | None = None
    ) -> StageCoster:
        """The coster of ``problem`` over ``num_stages`` stages (workers as :func:`stage_times`'s)."""
        costs, by, hardware = problem.costs, problem.by, problem.hardware
        fwd, bwd = _split(costs, by)
        first, last = hardware.first_stage_extra, hardware.last_stage_extra
        extra_fwd, extra_bwd = _split([e for e in (first, last) if e is not None], by)
        slowdown = hardware.stage_slowdown(num_stages, stage_workers) or [1.0] * num_stages
        links = hardware.links(problem.num_layers, num_stages, by)
        return cls(costs, fwd, bwd, first, last, extra_fwd, extra_bwd, slowdown, links, by == "time")

    @property
    def num_stages(self) -> int:
        """The stages of the pipeline it was built for."""
        return len(self.slowdown)

    def stage(self, stage: int, start: int, end: int) -> StageRow:
        """Stage ``stage`` holding layers ``start .. end - 1``: the :class:`StageCosts` fields of it."""
        layers = range(start, end)
        records = [self.costs[i] for i in layers]
        f, b = sum(self.fwd[i] for i in layers), sum(self.bwd[i] for i in layers)
        if stage == 0 and self.first is not None:
            f, b = f + self.extra_fwd[0], b + self.extra_bwd[0]
            records.append(self.first)
        if stage == self.num_stages - 1 and self.last is not None:
            f, b = f + self.extra_fwd[-1], b + self.extra_bwd[-1]
            records.append(self.last)
        timed, factor = self.timed, self.slowdown[stage]
        w = sum(c.bwd_weight_time_s for c in records if timed and not _ran_whole(c))
        whole = sum(c.bwd_time_s for c in records if timed and _ran_whole(c))
        update = factor * sum(c.update_time_s for c in records) if timed else 0.0
        links = self.links
        send = links[stage][end - 1] if links is not None and stage < self.num_stages - 1 else 0.0
        return factor * f, factor * b, send, factor * w, factor * whole, update


def _ran_whole(cost: LayerCost) -> bool:
    """Whether the record's whole backward ran in a weight-gradient pass (the first stage's, under torch)."""
    return cost.bwd_time_s > 0 and cost.bwd_weight_time_s >= cost.bwd_time_s


def whole_backward_ratio(costs: Sequence[LayerCost]) -> float:
    """How long a layer's backward runs whole, against split into input and weight gradients, as measured.

    Under torch's split-backward schedules a stage's input gradient and its weight gradient are two
    autograd passes; the first stage runs one whole pass instead (:func:`_ran_whole`). On the machine
    they can cost differently (on 2 CPU cores a transformer block's whole backward took 0.76-0.89x its
    split one). The profile times both kinds at once: alike layers (equal, non-zero parameter counts)
    measured on the first stage and elsewhere. A split record counts only with its weight-gradient part
    timed: a frozen layer of the same size has none (its backward is the input gradient alone), and
    beside trainable ones it would read as a cheaper backward. A whole record counts only if its backward
    is at least the input-gradient pass alone of the group's split records (the median of theirs): a
    whole pass that does less cannot have done a weight gradient, so its layer is frozen (or skips its
    work) and is not alike either; counted, a frozen layer at the front of the first stage beside one
    trainable layer made a trainable layer's whole backward read 0.05x its split one, and the step model
    then put trainable layers on the first stage as if nearly free. Per group of alike layers holding both
    kinds, the median backward / forward of the whole ones over that of the split ones; the median over
    such groups.

    Returns:
        The ratio, in (0, 1]: a whole pass does no more work than the two it replaces, so a measured
        ratio above 1 (noise) counts as 1. 1.0 where no alike layers were measured both ways (nothing to
        compare: a schedule that does not split backward, a first stage without such a layer,
        parameter-free layers).
    """
    groups: dict[int, tuple[list[float], list[float], list[float]]] = {}
    for c in costs:
        if c.num_params > 0 and c.fwd_time_s > 0 and c.bwd_time_s > 0:
            whole, split, input_part = groups.setdefault(c.num_params, ([], [], []))
            if _ran_whole(c):
                whole.append(c.bwd_time_s / c.fwd_time_s)
            elif c.bwd_weight_time_s > 0:  # no weight pass timed: a frozen layer, not alike
                split.append(c.bwd_time_s / c.fwd_time_s)
                input_part.append((c.bwd_time_s - c.bwd_weight_time_s) / c.fwd_time_s)
    ratios = []
    for whole, split, input_part in groups.values():
        did_weights = [w for w in whole if split and w >= median(input_part)]
        if did_weights:
            ratios.append(median(did_weights) / median(split))
    return min(1.0, median(ratios)) if ratios else 1.0


def _split(costs: Sequence[LayerCost], by: str) -> tuple[list[float], list[float]]:
    """Forward and backward weights of each record (``params``: 1:2 of the parameter count)."""
    if by == "time":
        return [c.fwd_time_s for c in costs], [c.bwd_time_s for c in costs]
    weights = layer_weights(costs, by)
    return [w / 3 for w in weights], [2 * w / 3 for w in weights]


def worker_slowdown(
    probe_s: Sequence[float], pipeline_ranks: Sequence[int], tolerance: float = 0.05
) -> list[float] | None:
    """Per pipeline rank, how many times longer it took than the fastest for the same work.

    Args:
        probe_s: A fixed reference workload's seconds on each active rank
            (:func:`lightning_dynmo.profiling.speed.time_reference_workload`).
        pipeline_ranks: The pipeline position of each of those ranks. Data-parallel replicas at one
            position count as their slowest: they share the placement, and the slowest sets the pace.
        tolerance: Workers within this fraction of the fastest are taken as equal to it, so timing
            noise does not move layers; ``None`` is returned when every worker is within it.

    Returns:
        One factor per pipeline rank (the fastest 1.0), or ``None`` when the workers are alike.
    """
    if len(probe_s) != len(pipeline_ranks) or not probe_s:
        raise ValueError(
            f"probe_s has {len(probe_s)} entries and pipeline_ranks {len(pipeline_ranks)}; give one "
            "probe time and one pipeline position per active rank."
        )
    if any(not t > 0 for t in probe_s):
        raise ValueError(f"probe_s={list(probe_s)} must all be > 0 seconds.")
    slowest: dict[int, float] = {}
    for seconds, position in zip(probe_s, pipeline_ranks, strict=True):
        slowest[position] = max(slowest.get(position, 0.0), float(seconds))
    missing = [p for p in range(max(slowest) + 1) if p not in slowest]
    if missing:
        raise ValueError(f"no probe time for pipeline ranks {missing}; every position needs one.")
    fastest = min(slowest.values())
    factors = [slowest[p] / fastest for p in range(len(slowest))]
    factors = [1.0 if f <= 1.0 + tolerance else f for f in factors]
    return None if all(f == 1.0 for f in factors) else factors


def to_reference(
    costs: Sequence[LayerCost], placement: Placement, stage_workers: Sequence[int], slowdown: Sequence[float]
) -> list[LayerCost]:
    """Costs measured on the workers that own the layers, expressed on the reference worker.

    Args:
        costs: One record per layer, each timed on its owner.
        placement: The placement the costs were measured under.
        stage_workers: The worker of each stage of ``placement``.
        slowdown: Per worker, its slowdown factor.

    Returns:
        The records with their times divided by their owner's factor (sizes unchanged).
    """
    return [
        scaled(cost, 1.0 / slowdown[stage_workers[placement.stage_of(i)]]) for i, cost in enumerate(costs)
    ]


def scaled(cost: LayerCost, factor: float) -> LayerCost:
    """``cost`` with its forward, backward and update times multiplied by ``factor``."""
    return dataclasses.replace(
        cost,
        fwd_time_s=cost.fwd_time_s * factor,
        bwd_time_s=cost.bwd_time_s * factor,
        bwd_weight_time_s=cost.bwd_weight_time_s * factor,
        update_time_s=cost.update_time_s * factor,
    )
