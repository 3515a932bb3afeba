"""What to rebalance to, and whether a proposed placement is worth applying (pure Python).

Read in this order:

1. :class:`BalanceConfig` and :func:`decide`: ask the configured balancer (``partition``, ``diffusion``
   or ``static``) for a placement of a :class:`~lightning_dynmo.balancing.problem.BalanceProblem` under
   the chosen cost view and memory caps, optionally re-pack onto fewer stages, predict the step time
   before and after with the pipeline simulator (:func:`predict`), and say whether to apply it (only when
   predicted better by ``min_gain``).
2. :func:`validate_policy`: options that contradict each other across this config and the triggers
   (:mod:`lightning_dynmo.balancing.trigger`, *when* to rebalance) fail early.
3. :func:`resume_plan` and :func:`smooth_costs`: what a resumed run does with a saved placement, and
   the moving average of noisy costs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_dynmo.balancing._checks import (
    MemoryCapacity,
    check_int,
    comm_rows,
    memory_caps,
)
from lightning_dynmo.balancing.costs import COST_VIEWS, LayerCost
from lightning_dynmo.balancing.diffusion import diffuse
from lightning_dynmo.balancing.fields import check_fields, int_field, number_field
from lightning_dynmo.balancing.hardware import Hardware, stage_times
from lightning_dynmo.balancing.metrics import imbalance, simulate_pipeline, simulated_schedule
from lightning_dynmo.balancing.microbatches import RetuneOptions, choose_microbatches
from lightning_dynmo.balancing.partition import partition
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem, takes_problem
from lightning_dynmo.balancing.repack import repack
from lightning_dynmo.balancing.step_prediction import ScheduleOrder, StepPredictor, predict_step, refine
from lightning_dynmo.balancing.trigger import TriggerConfig
from lightning_dynmo.balancing.workers import partition_workers, worker_loads

BALANCERS: tuple[str, ...] = ("partition", "diffusion", "static")


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """How to rebalance.

    Attributes:
        balancer: ``"partition"`` (exact min-max contiguous split), ``"diffusion"`` (iterative moves
            between neighbours) or ``"static"`` (never move layers: the baseline).
        cost: ``"time"`` (measured forward + backward seconds) or ``"params"`` (parameter counts).
        memory_capacity_bytes: Per-stage memory cap: ``None`` (unlimited), one number, or one per stage.
        repack: Try to re-pack the layers onto fewer stages and release the rest.
        target_num_stages: With ``repack``, the number of stages to re-pack onto; ``None`` picks the
            fewest stages whose predicted slowdown stays within ``max_slowdown``.
        max_slowdown: With ``repack``, the largest accepted predicted step-time increase (fraction).
        min_gain: A new placement is applied only if it is predicted to cut the step time by at least
            this fraction, in ``[0, 1)``.
        diffusion_max_rounds: Round limit of the diffusion balancer, >= 1 (5, as the reference code).
        diffusion_tolerance: Diffusion stops at this imbalance, >= 0.
        min_saving: A same-size proposal must also save at least this much predicted step time (in the
            cost view's units), >= 0: e.g. the expected migration cost spread over the steps until the
            next decision, so a migration pays for itself and noise does not move layers back and forth
            (the callback sets it per decision).
    """

    balancer: str = "partition"
    cost: str = "time"
    memory_capacity_bytes: MemoryCapacity = None
    repack: bool = False
    target_num_stages: int | None = None
    max_slowdown: float = number_field(0.05)
    min_gain: float = number_field(0.02)
    diffusion_max_rounds: int = int_field(5, minimum=1)
    diffusion_tolerance: float = number_field(0.0)
    min_saving: float = number_field(0.0)

    def __post_init__(self) -> None:
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer={self.balancer!r} is not a balancer; use one of {BALANCERS}.")
        if self.cost not in COST_VIEWS:
            raise ValueError(f"cost={self.cost!r} is not a cost view; use one of {COST_VIEWS}.")
        if self.target_num_stages is not None:
            check_int(self.target_num_stages, "target_num_stages", 1, "use None for an automatic choice")
            if not self.repack:
                raise ValueError(
                    f"target_num_stages={self.target_num_stages} is only used when re-packing; set "
                    "repack=True or drop target_num_stages."
                )
        if self.repack and self.balancer == "static":
            raise ValueError(
                "repack=True with balancer='static' contradict each other: a static run never moves layers. "
                "Use balancer='partition' or 'diffusion', or repack=False."
            )
        check_fields(self)
        if self.min_gain >= 1:
            raise ValueError(f"min_gain={self.min_gain} must be below 1 (it is a fraction of the step time).")

    def problem(self, costs: Sequence[LayerCost], hardware: Hardware | None = None) -> BalanceProblem:
        """The problem :func:`decide` balances under this config: ``costs`` in its view, on ``hardware``."""
        return BalanceProblem(costs, self.cost, hardware or Hardware())

    def check_pipeline(self, num_stages: int, runnable_stage_counts: Sequence[int] | None = None) -> None:
        """Raise if the options do not fit a pipeline of ``num_stages`` stages.

        Args:
            num_stages: Stages of the pipeline now.
            runnable_stage_counts: The stage counts the schedule can run (several stages per worker:
                ``repack_layouts``' keys), or ``None`` for any.
        """
        if self.target_num_stages is not None and self.target_num_stages > num_stages:
            raise ValueError(
                f"target_num_stages={self.target_num_stages} is larger than the current pipeline "
                f"({num_stages} stages); re-packing only shrinks a pipeline, so use 1..{num_stages}."
            )
        runnable = sorted(runnable_stage_counts) if runnable_stage_counts is not None else None
        if (
            self.target_num_stages is not None
            and runnable is not None
            and self.target_num_stages not in runnable
        ):
            raise ValueError(
                f"target_num_stages={self.target_num_stages} is a pipeline the schedule cannot run: with "
                f"its stages per rank and micro-batch count it runs {runnable} stages. Use one of them, or "
                "target_num_stages=None for an automatic choice."
            )
        if self.repack and self.memory_capacity_bytes is None:
            raise ValueError(
                "repack=True needs memory_capacity_bytes (bytes per stage) to know how many layers fit on a "
                "stage; pass it (on GPU the callback uses the device's capacity when it is not given)."
            )


def resume_plan(
    saved_placement: str | None,
    saved_layout: Mapping[str, Any] | None,
    layout: Mapping[str, Any],
    balancer: str,
) -> str:
    """What a resumed run does with the placement its checkpoint saved.

    A placement is a split for one pipeline (schedule, ranks, stages). The resumed run's pipeline is
    set by its own devices and schedule; a placement saved for another pipeline would not fit it (or,
    with fewer stages, would re-pack and release ranks at start-up).

    Args:
        saved_placement: The placement in the checkpoint (``None``: nothing saved).
        saved_layout: The pipeline it was for, as :func:`pipeline_layout` gives it (``None`` in
            checkpoints written before layouts were saved: then the stage count decides).
        layout: The resumed run's pipeline.
        balancer: The resumed run's balancer.

    Returns:
        ``"restore"`` (same pipeline: apply the saved placement), ``"repartition"`` (another pipeline:
        keep the run's initial placement, profile and rebalance it at the first step, without re-packing)
        or ``"keep"`` (nothing saved, or the static balancer, which never moves layers).
    """
    if not saved_placement or balancer == "static":
        return "keep"
    if saved_layout is None:
        same = Placement.from_string(saved_placement).num_stages == layout["num_stages"]
    else:
        same = dict(saved_layout) == dict(layout)
    return "restore" if same else "repartition"


def pipeline_layout(schedule: str, pipeline_size: int, num_stages: int) -> dict[str, Any]:
    """The pipeline a placement is for, as :func:`resume_plan` compares it (and checkpoints keep it)."""
    return {"schedule": schedule, "pipeline_size": pipeline_size, "num_stages": num_stages}


def validate_policy(balance: BalanceConfig, triggers: TriggerConfig) -> None:
    """Raise ``ValueError`` for options that contradict each other across the two configs."""
    if balance.balancer == "static":
        enabled = [
            name
            for name, on in (
                (f"every_n_steps={triggers.every_n_steps}", triggers.every_n_steps is not None),
                ("every_step=True", triggers.every_step),
                ("auto=True", triggers.auto is not None),
                ("on_events=True", triggers.on_events),
            )
            if on
        ]
        if enabled:
            raise ValueError(
                f"balancer='static' never rebalances, but triggers are enabled: {', '.join(enabled)}. "
                "Disable them (on_events=False) or choose balancer='partition' or 'diffusion'."
            )


@dataclass(frozen=True)
class RebalanceDecision:
    """The outcome of :func:`decide`.

    Predicted times are simulated pipeline step times under the configured cost view: seconds with
    ``cost="time"``; with ``cost="params"`` the unit is "parameters", which is what that variant
    assumes time is proportional to. Given a :class:`~lightning_dynmo.balancing.step_prediction.
    ScheduleOrder`, they follow the schedule's own action lists (any number of stages per worker).
    Given only a schedule name and ``stage_workers`` (several stages per worker), a same-size proposal's
    are the heaviest worker's load instead: the name's simulator runs one stage per rank.

    Attributes:
        apply: Whether to apply ``proposed``.
        current: The placement in use.
        proposed: The placement the balancer proposes (``current`` for ``static``).
        predicted_step_before: Simulated step time of ``current``.
        predicted_step_after: Simulated step time of ``proposed``.
        bubble_ratio_before: Simulated bubble ratio of ``current``.
        bubble_ratio_after: Simulated bubble ratio of ``proposed``.
        imbalance_before: Stage-load imbalance of ``current``.
        imbalance_after: Stage-load imbalance of ``proposed``.
        reason: Why (not) applied, for the log line.
        num_microbatches: With a re-tune (:class:`~lightning_dynmo.balancing.microbatches.RetuneOptions`),
            the micro-batch count the re-packed pipeline runs; ``None``: unchanged.
        microbatch_steps: The predicted step seconds of each micro-batch count the re-tune weighed.
        worker_loads_after: ``proposed``'s predicted load of each worker (pipeline rank), its stages'
            forward and backward summed, in the prediction's units (a step's or a micro-batch's): how the
            ranks' measured busy times should share out once it runs; only the shares are read
            (:meth:`~lightning_dynmo.balancing.headroom.StageLoadAverage.restart`'s ``expected``).
    """

    apply: bool
    current: Placement
    proposed: Placement
    predicted_step_before: float
    predicted_step_after: float
    bubble_ratio_before: float
    bubble_ratio_after: float
    imbalance_before: float
    imbalance_after: float
    reason: str
    num_microbatches: int | None = None
    microbatch_steps: Mapping[int, float] | None = None
    worker_loads_after: tuple[float, ...] | None = None

    @property
    def predicted_gain(self) -> float:
        """Predicted fractional step-time saving (negative for a slowdown)."""
        if self.predicted_step_before <= 0:
            return 0.0
        return 1.0 - self.predicted_step_after / self.predicted_step_before

    @property
    def released_stages(self) -> int:
        """Stages the proposal gives up (re-packing)."""
        return self.current.num_stages - self.proposed.num_stages


@dataclass(frozen=True)
class _Prediction:
    step: float
    bubble_ratio: float
    stage_loads: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        return imbalance(self.stage_loads)

    def worker_loads(self, stage_workers: Sequence[int] | None) -> tuple[float, ...]:
        """The stage loads summed per worker (``None``: stage ``s`` on worker ``s``)."""
        if stage_workers is None:
            return self.stage_loads
        loads = [0.0] * (max(stage_workers) + 1)
        for worker, load in zip(stage_workers, self.stage_loads, strict=True):
            loads[worker] += load
        return tuple(loads)


@takes_problem
def predict(
    problem: BalanceProblem, placement: Placement, num_microbatches: int, schedule: str | ScheduleOrder
) -> tuple[float, float, float]:
    """Simulated (step time, bubble ratio, stage-load imbalance) of ``placement``.

    Args:
        problem: One record per layer (times per training step, all micro-batches), the view
            (``"params"``: parameter counts stand in for time, split 1:2 forward:backward) and the
            hardware: pinned parts, worker slowdowns (stage ``s`` on worker ``s``) and links. A send
            keeps its sender busy (it is added to the sender's forward op), as the balancers assume.
        placement: The placement to evaluate.
        num_microbatches: Micro-batches per step.
        schedule: A pipelining schedule name, e.g. ``"1F1B"`` (the event simulator's model of it:
            :func:`~lightning_dynmo.balancing.metrics.simulate_pipeline`), or a
            :class:`~lightning_dynmo.balancing.step_prediction.ScheduleOrder` (the schedule's own action
            lists, :func:`~lightning_dynmo.balancing.step_prediction.predict_step`).
    """
    p = _predict(problem, placement, num_microbatches, schedule, None)
    return p.step, p.bubble_ratio, p.imbalance


def _predict(
    problem: BalanceProblem,
    placement: Placement,
    num_microbatches: int,
    schedule: str | ScheduleOrder,
    stage_workers: Sequence[int] | None,
) -> _Prediction:
    # Both step models add the runtime's cost per action (Hardware.per_op_s) in the time view.
    if isinstance(schedule, ScheduleOrder):
        step = predict_step(problem, placement, schedule, num_microbatches, stage_workers)
        return _Prediction(step.step_s, step.bubble_ratio, tuple(step.stage_loads))
    times = stage_times(problem, placement, stage_workers)
    per_op_s = problem.hardware.per_op_s if problem.by == "time" else 0.0
    fwd, bwd = times.per_microbatch(num_microbatches, per_op_s=per_op_s)
    sim = simulate_pipeline(fwd, bwd, num_microbatches, simulated_schedule(schedule))
    loads = tuple(f + b for f, b in zip(fwd, bwd, strict=True))
    return _Prediction(sim.step_time_s, sim.bubble_ratio, loads)


def decision_shapes(
    num_stages: int,
    num_microbatches: int,
    config: BalanceConfig,
    repack_layouts: Mapping[int, Sequence[int]] | None = None,
    retune: RetuneOptions | None = None,
) -> list[tuple[int, int]]:
    """Every ``(stages, micro-batches)`` shape :func:`decide` may simulate with these arguments: the
    current one, every stage count a re-pack may reach (every smaller count without ``repack_layouts``),
    and the micro-batch counts a re-tune may pick; ``ScheduleOrder.tabled`` computes their action lists
    ahead (:class:`~lightning_dynmo.balancing.step_prediction.ScheduleOrder`)."""
    stages = {num_stages}
    if config.repack:
        stages |= set(repack_layouts) if repack_layouts is not None else set(range(1, num_stages))
    shapes = {(k, num_microbatches) for k in stages}
    if retune is not None:
        shapes |= {(k, c) for k, counts in retune.counts.items() for c in counts}
    return sorted(shapes)


@takes_problem
def decide(
    problem: BalanceProblem,
    current: Placement,
    config: BalanceConfig,
    num_microbatches: int,
    schedule: str | ScheduleOrder,
    stage_workers: Sequence[int] | None = None,
    repack_layouts: Mapping[int, Sequence[int]] | None = None,
    retune: RetuneOptions | None = None,
) -> RebalanceDecision:
    """Propose a placement for the measured costs and say whether it is worth applying.

    Args:
        problem: One record per layer (identical on every rank: gathered by the profiler), expressed on
            the reference worker when the hardware gives worker slowdowns, in the view ``config.cost``
            (:meth:`BalanceConfig.problem` builds it). Its hardware gives the pinned first- and
            last-stage parts (embedding; final norm, head and loss), which every balancer, the predicted
            step and the memory caps count on their stages, the worker slowdowns and the links; its
            memory caps apply when ``config.memory_capacity_bytes`` is ``None``; its ``per_op_s`` (the
            runtime's own cost per action) is added to every action of the predicted steps before and
            after (what the gain is judged by), never to the search that picks the placement.
        current: The placement in use.
        config: Balancer, cost view, memory caps, re-pack options, minimum gain and saving.
        num_microbatches: Micro-batches per step.
        schedule: The pipelining schedule's name (steps predicted by the event simulator's model of it),
            or a :class:`~lightning_dynmo.balancing.step_prediction.ScheduleOrder`: its own action lists
            then predict every step, and ``partition``'s proposal is refined by them
            (:func:`~lightning_dynmo.balancing.step_prediction.refine`: exact over contiguous placements
            of the same stage count when they are few, else a local search never predicted slower).
        stage_workers: For schedules that run several (virtual) stages per worker: the worker of each
            stage. ``partition`` then minimises the heaviest *worker* (:func:`partition_workers`;
            per-stage memory caps become per-worker caps: the smallest of the worker's stages). Given a
            schedule name, a same-size proposal is judged by the heaviest worker's load, which it must
            cut by ``min_gain`` (``diffusion`` still moves layers stage by stage); given a
            ``ScheduleOrder``, by its simulated step.
        repack_layouts: With ``repack`` under a schedule with several stages per worker: every stage count
            it can run -> the worker of each stage (:func:`~lightning_dynmo.balancing.repack`'s
            ``layouts``); re-packs are then proposed only onto those and judged by the heaviest worker.
        retune: With ``cost="time"``, when a re-pack is applied, choose the micro-batch count of the
            smaller pipeline among ``retune.counts[new stage count]`` (:func:`choose_microbatches`;
            ``predicted_step_after`` stays the re-pack's at the current count, each count's prediction is
            in ``microbatch_steps``).

    Returns:
        A :class:`RebalanceDecision`. A re-pack is applied when it releases stages within
        ``max_slowdown``; a same-size placement when it is predicted ``min_gain`` faster.

    Raises:
        ValueError: on bad input, or when no placement fits memory.
        TypeError: when called in the old shape (loose costs, or a keyword that moved into the problem).
    """
    if problem.num_layers != current.num_layers:
        raise ValueError(
            f"costs has {problem.num_layers} records but current={current} covers {current.num_layers} "
            "layers; pass one LayerCost per layer."
        )
    if problem.by != config.cost:
        raise ValueError(
            f"problem.by={problem.by!r} but config.cost={config.cost!r}; the balancers weigh the view the "
            "config names, so build the problem with config.problem(costs, hardware)."
        )
    if stage_workers is not None and len(stage_workers) != current.num_stages:
        raise ValueError(
            f"stage_workers has {len(stage_workers)} entries but current={current} has "
            f"{current.num_stages} stages; give the worker of every stage."
        )
    check_int(num_microbatches, "num_microbatches", 1, "the pipeline's micro-batches per step")
    hw = problem.hardware
    caps = hw.memory_capacity_bytes if config.memory_capacity_bytes is None else config.memory_capacity_bytes
    config = dataclasses.replace(config, memory_capacity_bytes=caps)
    problem = problem.with_hardware(memory_capacity_bytes=caps)
    comm_rows(hw.comm_time_s, problem.num_layers, current.num_stages, "time")  # bad send times fail here
    hw.stage_slowdown(current.num_stages, stage_workers)  # as do missing worker slowdowns
    config.check_pipeline(current.num_stages)

    def evaluate(placement: Placement, workers: Sequence[int] | None, on: BalanceProblem) -> _Prediction:
        return _predict(on, placement, num_microbatches, schedule, workers)

    proposed, reason = _propose(problem, current, config, stage_workers, repack_layouts, num_microbatches)
    same_size = proposed.num_stages == current.num_stages
    if isinstance(schedule, ScheduleOrder) and config.balancer == "partition" and same_size:
        # The search ranks placements by their work alone: the runtime's cost per action is one number
        # fitted to the running placement's step, no measure of where the work should go.
        work = problem.with_hardware(per_op_s=0.0)
        predictor = StepPredictor(work, schedule, num_microbatches, proposed.num_stages, stage_workers)
        refined = refine(
            work,
            proposed,
            lambda p: predictor.predict(p).step_s,
            stage_workers=stage_workers,
            at_least=predictor.at_least,
        )
        proposed, reason = refined.placement, f"{reason}, refined by {refined.describe()}"
    proposed_workers = (
        stage_workers
        if proposed.num_stages == current.num_stages
        else (repack_layouts or {}).get(proposed.num_stages)
    )
    before = evaluate(current, stage_workers, problem)
    after = evaluate(proposed, proposed_workers, problem)
    step_before, step_after = before.step, after.step
    by_workers = not isinstance(schedule, ScheduleOrder)  # a name's simulator runs one stage per rank
    if by_workers and stage_workers is not None and proposed_workers is not None:
        step_before = _heaviest_worker(problem, current, stage_workers)
        step_after = _heaviest_worker(problem, proposed, proposed_workers)
    apply, why = _worth_it(current, proposed, step_before, step_after, config)
    min_saving = config.min_saving
    if apply and proposed.num_stages == current.num_stages and step_before - step_after < min_saving:
        apply, why = (
            False,
            f"predicted saving {step_before - step_after:.4g} below min_saving={min_saving:.4g}",
        )
    decision = RebalanceDecision(
        apply=apply,
        current=current,
        proposed=proposed,
        predicted_step_before=step_before,
        predicted_step_after=step_after,
        bubble_ratio_before=before.bubble_ratio,
        bubble_ratio_after=after.bubble_ratio,
        imbalance_before=before.imbalance,
        imbalance_after=after.imbalance,
        reason=f"{reason}; {why}",
        worker_loads_after=after.worker_loads(proposed_workers),
    )
    if retune is None or not apply or proposed.num_stages == current.num_stages or config.cost != "time":
        return decision
    name = schedule.name if isinstance(schedule, ScheduleOrder) else schedule
    return _retuned(decision, problem, config, num_microbatches, name, proposed_workers, retune)


def _retuned(
    decision: RebalanceDecision,
    problem: BalanceProblem,
    config: BalanceConfig,
    num_microbatches: int,
    schedule: str,
    workers: Sequence[int] | None,
    retune: RetuneOptions,
) -> RebalanceDecision:
    """``decision`` (an applied re-pack) with the micro-batch count chosen for its smaller pipeline."""
    proposed = decision.proposed
    counts = retune.counts.get(proposed.num_stages)
    if not counts:
        return decision
    caps = config.memory_capacity_bytes
    if isinstance(caps, Sequence):
        caps = list(caps)[: proposed.num_stages]  # the kept stages keep their capacities
    choice = choose_microbatches(
        problem.with_hardware(memory_capacity_bytes=caps),
        proposed,
        current=num_microbatches,
        candidates=counts,
        schedule=schedule,
        stage_workers=workers,
        per_op_s=retune.per_op_s,
        min_gain=config.min_gain,
    )
    if choice.num_microbatches == num_microbatches:
        return dataclasses.replace(decision, microbatch_steps=choice.predicted_step_s)
    return dataclasses.replace(
        decision,
        num_microbatches=choice.num_microbatches,
        microbatch_steps=choice.predicted_step_s,
        reason=f"{decision.reason}; {choice.num_microbatches} micro-batches instead of {num_microbatches}",
    )


def _heaviest_worker(problem: BalanceProblem, placement: Placement, workers: Sequence[int]) -> float:
    links = problem.hardware.links(problem.num_layers, placement.num_stages, problem.by)
    return max(worker_loads(problem.with_hardware(comm_time_s=links), placement, workers).values())


def _propose(
    problem: BalanceProblem,
    current: Placement,
    config: BalanceConfig,
    stage_workers: Sequence[int] | None,
    repack_layouts: Mapping[int, Sequence[int]] | None,
    num_microbatches: int,
) -> tuple[Placement, str]:
    if config.balancer == "static":
        return current, "static balancer"
    stages, by, hw = current.num_stages, problem.by, problem.hardware
    # The balancers weigh whole steps: a stage sends its activation once per micro-batch.
    per_send = hw.links(problem.num_layers, stages, by)
    links = None if per_send is None else [[num_microbatches * t for t in row] for row in per_send]
    # The per-stage balancers run stage s on worker s: give them each stage's worker's factor.
    staged = problem.with_hardware(
        comm_time_s=links, worker_slowdown=hw.stage_slowdown(stages, stage_workers)
    )
    if config.repack:
        packed = repack(
            staged if repack_layouts is None else staged.with_hardware(comm_time_s=None),
            current,
            target_num_stages=config.target_num_stages,
            max_slowdown=config.max_slowdown,
            layouts=repack_layouts,
        )
        if packed.placement.num_stages < stages:
            return packed.placement, f"re-pack onto {packed.placement.num_stages} stages"
    if config.balancer == "diffusion":
        result = diffuse(
            staged, current, max_rounds=config.diffusion_max_rounds, tolerance=config.diffusion_tolerance
        )
        return result.placement, f"diffusion by {by}"
    if stage_workers is not None:
        per_worker = problem.with_hardware(
            comm_time_s=links,
            memory_capacity_bytes=_stage_caps_per_worker(config.memory_capacity_bytes, stage_workers),
        )
        balanced = partition_workers(per_worker, stage_workers, current=current)
        return balanced.placement, f"partition of the workers by {by}"
    return partition(staged, stages), f"partition by {by}"


def _worth_it(
    current: Placement, proposed: Placement, before_s: float, after_s: float, config: BalanceConfig
) -> tuple[bool, str]:
    if proposed == current:
        return False, "placement unchanged"
    if proposed.num_stages < current.num_stages:
        if after_s <= before_s * (1 + config.max_slowdown):
            return True, f"releases {current.num_stages - proposed.num_stages} stage(s) within max_slowdown"
        return False, f"re-pack slows the step by more than max_slowdown={config.max_slowdown}"
    if after_s <= before_s * (1 - config.min_gain):
        return True, "predicted faster"
    return False, f"predicted gain below min_gain={config.min_gain}"


def _stage_caps_per_worker(caps: MemoryCapacity, stage_workers: Sequence[int]) -> MemoryCapacity:
    """Per-stage memory caps as per-worker caps: a worker gets the smallest cap among its stages."""
    if caps is None or isinstance(caps, (int, float, Mapping)):
        return caps  # one cap for all, or already one per worker
    per_stage = memory_caps(caps, len(stage_workers))  # checks one entry per stage
    per_worker: dict[int, float] = {}
    for stage, worker in enumerate(stage_workers):
        per_worker[worker] = min(per_worker.get(worker, math.inf), per_stage[stage])
    return per_worker


def smooth_costs(
    previous: Sequence[LayerCost] | None, measured: Sequence[LayerCost], weight: float
) -> list[LayerCost]:
    """Exponential moving average of per-layer times: ``weight * previous + (1 - weight) * measured``.

    Fine-grained dynamism (MoE, MoD) makes one window's measurement a noisy sample of what a layer will
    cost next; a placement fitted to that sample is worse than the current one whenever the noise does not
    persist. Averaging over windows keeps what persists (a drift in routing) and cancels what does not.
    Costs are kept per global layer, so the average stays valid across migrations. Sizes (parameters,
    memory, activations) are not noisy and are taken from ``measured``. The callback passes
    the weight :class:`~lightning_dynmo.balancing.averaging.HistoryWeight` gives its ``cost_smoothing``,
    so the first window does not outweigh the rest and skipped steps age the history.

    Args:
        previous: The smoothed costs of the last window, or ``None`` (then ``measured`` is returned).
        measured: This window's costs, one per layer.
        weight: History weight in ``[0, 1)``; 0 keeps only the new measurement.

    Raises:
        ValueError: if ``weight`` is outside ``[0, 1)`` or the layer counts differ.
    """
    if not (isinstance(weight, (int, float)) and 0.0 <= weight < 1.0):
        raise ValueError(f"cost_smoothing={weight!r} must be in [0, 1): the weight of the history.")
    if previous is None or weight == 0.0:
        return list(measured)
    if len(previous) != len(measured):
        raise ValueError(
            f"previous has {len(previous)} layers but measured has {len(measured)}; smoothing needs the "
            "same model on both sides."
        )
    return [
        LayerCost(
            fwd_time_s=weight * old.fwd_time_s + (1.0 - weight) * new.fwd_time_s,
            bwd_time_s=weight * old.bwd_time_s + (1.0 - weight) * new.bwd_time_s,
            bwd_weight_time_s=weight * old.bwd_weight_time_s + (1.0 - weight) * new.bwd_weight_time_s,
            num_params=new.num_params,
            update_time_s=weight * old.update_time_s + (1.0 - weight) * new.update_time_s,
            memory_bytes=new.memory_bytes,
            activation_bytes=new.activation_bytes,
        )
        for old, new in zip(previous, measured, strict=True)
    ]
