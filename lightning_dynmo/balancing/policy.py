"""When to rebalance, and whether a proposed placement is worth applying (pure Python).

Read in this order:

1. :class:`TriggerConfig` and :class:`RebalanceTrigger`: *when*. Four triggers, any combination that
   makes sense: every ``n`` steps; on dynamism events (the step after an event is profiled and
   rebalanced, as in the paper's Algorithm 1); every step (fine-grained dynamism: MoE, MoD); and
   ``auto``: fed each step's per-stage busy times (cheap), it fires when the imbalance
   ``(max - min) / mean`` (paper section 2.2) stays above a threshold for ``auto_patience_steps``
   consecutive steps (hysteresis) *and* the predicted saving over the coming ``auto_horizon_steps``
   exceeds the measured cost of a rebalance (profiling overhead + decision + migration, learned from
   the previous rebalances, or a configured prior before the first one); after each rebalance ``auto``
   keeps quiet for ``auto_cooldown_steps`` steps. Time comes from an injected clock.
2. :class:`BalanceConfig` and :func:`decide`: *what*. Ask the configured balancer (``partition``,
   ``diffusion`` or ``static``) for a placement under the chosen cost view and memory caps, optionally
   re-pack onto fewer stages, predict the step time before and after with the pipeline simulator, and
   say whether to apply it (only when predicted better by ``min_gain``).
3. :func:`validate_policy`: options that contradict each other fail early.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from lightning_dynmo.balancing._checks import CommTime, comm_rows, memory_caps
from lightning_dynmo.balancing._checks import stage_slowdown as check_slowdown
from lightning_dynmo.balancing.costs import COST_VIEWS, LayerCost
from lightning_dynmo.balancing.diffusion import diffuse
from lightning_dynmo.balancing.hardware import Hardware, stage_times
from lightning_dynmo.balancing.metrics import imbalance, simulate_pipeline, simulated_schedule
from lightning_dynmo.balancing.microbatches import RetuneOptions, choose_microbatches
from lightning_dynmo.balancing.partition import partition
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.repack import repack
from lightning_dynmo.balancing.workers import partition_workers, worker_loads

BALANCERS: tuple[str, ...] = ("partition", "diffusion", "static")

MemoryCapacity = float | int | Sequence[float | int] | None

# -- 1. when -------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TriggerConfig:
    """When to rebalance.

    Attributes:
        every_n_steps: Rebalance every ``n`` steps (at steps ``n, 2n, ...``); ``None`` disables it.
        on_events: Rebalance at the step after a dynamism event (see ``lightning_dynmo.events``).
        every_step: Rebalance at every step (MoE, MoD: the load changes with each batch's routing).
        auto: Rebalance when measured imbalance persists and the predicted gain pays for the cost.
        auto_threshold: Imbalance ``(max - min) / mean`` of per-stage busy times above which a step
            counts as imbalanced, > 0.
        auto_patience_steps: Consecutive imbalanced steps needed before ``auto`` fires, >= 1.
        auto_horizon_steps: Steps over which a rebalance's per-step saving is counted, >= 1.
        auto_cooldown_steps: Steps after a rebalance during which ``auto`` does not fire, >= 0.
        rebalance_cost_prior_s: Assumed seconds one rebalance costs before one has been measured, >= 0.
    """

    every_n_steps: int | None = None
    on_events: bool = True
    every_step: bool = False
    auto: bool = False
    auto_threshold: float = 0.10
    auto_patience_steps: int = 5
    auto_horizon_steps: int = 500
    auto_cooldown_steps: int = 50
    rebalance_cost_prior_s: float = 1.0

    def __post_init__(self) -> None:
        if self.every_n_steps is not None:
            _check_int(self.every_n_steps, "every_n_steps", 1, "use None to disable the periodic trigger")
        _check_int(self.auto_patience_steps, "auto_patience_steps", 1, "")
        _check_int(self.auto_horizon_steps, "auto_horizon_steps", 1, "")
        _check_int(self.auto_cooldown_steps, "auto_cooldown_steps", 0, "")
        _check_positive(self.auto_threshold, "auto_threshold", allow_zero=False)
        _check_positive(self.rebalance_cost_prior_s, "rebalance_cost_prior_s", allow_zero=True)
        if self.every_step and self.every_n_steps is not None:
            raise ValueError(
                f"every_step=True and every_n_steps={self.every_n_steps} contradict each other: every_step "
                "already rebalances at every step. Set one of them."
            )
        if self.every_step and self.auto:
            raise ValueError(
                "every_step=True and auto=True contradict each other: every_step rebalances at every step "
                "whatever it costs, auto only when it pays. Set one of them."
            )

    @property
    def any_trigger(self) -> bool:
        """Whether any trigger is enabled."""
        return self.on_events or self.every_step or self.auto or self.every_n_steps is not None


@dataclass(frozen=True)
class RebalanceRecord:
    """One rebalance as the trigger remembers it: the step it finished at and what it cost (seconds)."""

    step: int
    cost_s: float


@dataclass
class _AutoWindow:
    imbalances: deque[float]
    savings_s: deque[float]


class RebalanceTrigger:
    """Decides at each step whether to start a rebalance.

    Args:
        config: The triggers.
        clock: Seconds from an arbitrary origin (``time.perf_counter`` by default); tests inject a
            fake one. Used by :meth:`measure_cost` to time the parts of a rebalance.

    Per step, the caller: feeds :meth:`observe` the per-stage busy times (only needed for ``auto``),
    forwards events to :meth:`notify_event`, asks :meth:`check`, and after a rebalance calls
    :meth:`record_rebalance` with its cost (or times its parts with :meth:`measure_cost`).
    """

    def __init__(self, config: TriggerConfig, clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self._clock = clock
        n = config.auto_patience_steps
        self._window = _AutoWindow(deque(maxlen=n), deque(maxlen=n))
        self._pending_event = False
        self._history: list[RebalanceRecord] = []
        self._measured_s = 0.0

    # -- inputs --------------------------------------------------------------------------------

    def notify_event(self) -> None:
        """A dynamism event happened (on any rank: the caller has already agreed across ranks)."""
        if self.config.on_events:
            self._pending_event = True

    def observe(self, stage_busy_s: Sequence[float]) -> None:
        """Feed one step's per-stage busy (compute) seconds, one number per stage, same on every rank."""
        busy = [float(b) for b in stage_busy_s]
        if not busy or any(b < 0 or b != b for b in busy):
            raise ValueError(f"stage_busy_s={list(stage_busy_s)!r} must be one finite number >= 0 per stage.")
        mean = sum(busy) / len(busy)
        self._window.imbalances.append(imbalance(busy))
        # If the heaviest stage came down to the mean, the pipeline would wait that much less per step:
        # an optimistic estimate, used only to gate; decide() then checks the real proposal.
        self._window.savings_s.append(max(busy) - mean)

    @contextmanager
    def measure_cost(self) -> Iterator[None]:
        """Time a part of a rebalance (decision, migration) with the clock; adds to the next record."""
        start = self._clock()
        try:
            yield
        finally:
            self._measured_s += max(0.0, self._clock() - start)

    def record_rebalance(self, step: int, extra_cost_s: float = 0.0) -> RebalanceRecord:
        """A rebalance finished at ``step``; it cost what :meth:`measure_cost` timed plus ``extra_cost_s``.

        ``extra_cost_s`` is for what the clock did not see, e.g. the profiler's overhead in its window.
        """
        _check_int(step, "step", 0, "")
        _check_positive(extra_cost_s, "extra_cost_s", allow_zero=True)
        record = RebalanceRecord(step, self._measured_s + extra_cost_s)
        self._history.append(record)
        self._measured_s = 0.0
        # A pending event stays pending: it came after the profile this rebalance used.
        self._window.imbalances.clear()  # what was measured before the rebalance is stale
        self._window.savings_s.clear()
        return record

    # -- the decision --------------------------------------------------------------------------

    def check(self, step: int) -> str | None:
        """Why to start a rebalance at ``step``, or None.

        Returns:
            ``"event"``, ``"period"``, ``"every_step"`` or ``"auto"`` (in that priority), or ``None``.
        """
        _check_int(step, "step", 0, "")
        c = self.config
        if self._pending_event:
            self._pending_event = False
            return "event"
        if c.every_n_steps is not None and step > 0 and step % c.every_n_steps == 0:
            return "period"
        if c.every_step:
            return "every_step"
        if c.auto and self._auto_fires(step):
            self._window.imbalances.clear()
            self._window.savings_s.clear()
            return "auto"
        return None

    def _auto_fires(self, step: int) -> bool:
        c = self.config
        last = self._history[-1].step if self._history else None
        if last is not None and step - last < c.auto_cooldown_steps:
            return False
        w = self._window
        if len(w.imbalances) < c.auto_patience_steps or min(w.imbalances) <= c.auto_threshold:
            return False
        predicted_gain_s = sum(w.savings_s) / len(w.savings_s) * c.auto_horizon_steps
        return predicted_gain_s > self.rebalance_cost_s

    @property
    def rebalance_cost_s(self) -> float:
        """The expected cost of one rebalance: the mean measured cost, or the prior before any."""
        if not self._history:
            return self.config.rebalance_cost_prior_s
        return sum(r.cost_s for r in self._history) / len(self._history)

    @property
    def history(self) -> tuple[RebalanceRecord, ...]:
        """Every rebalance recorded so far."""
        return tuple(self._history)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the rebalance history and a pending event."""
        return {
            "history": [(r.step, r.cost_s) for r in self._history],
            "pending_event": self._pending_event,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._history = [RebalanceRecord(int(s), float(c)) for s, c in state["history"]]
        self._pending_event = bool(state["pending_event"])


# -- 2. what -------------------------------------------------------------------------------------


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
    """

    balancer: str = "partition"
    cost: str = "time"
    memory_capacity_bytes: MemoryCapacity = None
    repack: bool = False
    target_num_stages: int | None = None
    max_slowdown: float = 0.05
    min_gain: float = 0.02
    diffusion_max_rounds: int = 5
    diffusion_tolerance: float = 0.0

    def __post_init__(self) -> None:
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer={self.balancer!r} is not a balancer; use one of {BALANCERS}.")
        if self.cost not in COST_VIEWS:
            raise ValueError(f"cost={self.cost!r} is not a cost view; use one of {COST_VIEWS}.")
        if self.target_num_stages is not None:
            _check_int(self.target_num_stages, "target_num_stages", 1, "use None for an automatic choice")
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
        _check_positive(self.max_slowdown, "max_slowdown", allow_zero=True)
        _check_positive(self.min_gain, "min_gain", allow_zero=True)
        if self.min_gain >= 1:
            raise ValueError(f"min_gain={self.min_gain} must be below 1 (it is a fraction of the step time).")
        _check_int(self.diffusion_max_rounds, "diffusion_max_rounds", 1, "")
        _check_positive(self.diffusion_tolerance, "diffusion_tolerance", allow_zero=True)

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
                ("auto=True", triggers.auto),
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
    assumes time is proportional to. When :func:`decide` is given ``stage_workers`` (several stages
    per worker) and keeps the stage count, they are the heaviest worker's load instead: the schedules
    with virtual stages are not simulated, and a worker runs all its stages' work in every step.

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
    imbalance: float


def predict(
    costs: Sequence[LayerCost],
    placement: Placement,
    num_microbatches: int,
    schedule: str,
    by: str = "time",
    comm_time_s: CommTime = None,
    hardware: Hardware | None = None,
) -> tuple[float, float, float]:
    """Simulated (step time, bubble ratio, stage-load imbalance) of ``placement``.

    Args:
        costs: One record per layer; times are per training step (all micro-batches).
        placement: The placement to evaluate.
        num_microbatches: Micro-batches per step.
        schedule: A pipelining schedule name, e.g. ``"1F1B"``.
        by: ``"time"``, or ``"params"`` (parameter counts stand in for time, split 1:2 forward:backward).
        comm_time_s: Seconds to send each layer's output across a boundary (used where a stage ends):
            one per layer, or one row per link. Overrides ``hardware.comm_time_s`` when given. A send
            keeps its sender busy (it is added to the sender's forward op), as the balancers assume.
        hardware: Pinned first/last-stage parts, worker slowdowns (one stage per worker) and links.
    """
    hw = hardware or Hardware()
    if comm_time_s is not None:
        hw = dataclasses.replace(hw, comm_time_s=comm_time_s)
    p = _predict(costs, placement, num_microbatches, schedule, by, hw, None)
    return p.step, p.bubble_ratio, p.imbalance


def _predict(
    costs: Sequence[LayerCost],
    placement: Placement,
    num_microbatches: int,
    schedule: str,
    by: str,
    hardware: Hardware,
    stage_workers: Sequence[int] | None,
) -> _Prediction:
    times = stage_times(costs, placement, by, hardware, stage_workers)
    fwd, bwd = times.per_microbatch(num_microbatches)
    sim = simulate_pipeline(fwd, bwd, num_microbatches, simulated_schedule(schedule))
    loads = tuple(f + b for f, b in zip(fwd, bwd, strict=True))
    return _Prediction(sim.step_time_s, sim.bubble_ratio, imbalance(loads))


def decide(
    costs: Sequence[LayerCost],
    current: Placement,
    config: BalanceConfig,
    num_microbatches: int,
    schedule: str,
    comm_time_s: CommTime = None,
    stage_workers: Sequence[int] | None = None,
    min_saving: float = 0.0,
    repack_layouts: Mapping[int, Sequence[int]] | None = None,
    hardware: Hardware | None = None,
    retune: RetuneOptions | None = None,
) -> RebalanceDecision:
    """Propose a placement for the measured costs and say whether it is worth applying.

    Args:
        costs: One record per layer (identical on every rank: gathered by the profiler), expressed on
            the reference worker when ``hardware`` gives worker slowdowns.
        current: The placement in use.
        config: Balancer, cost view, memory caps, re-pack options, minimum gain.
        num_microbatches: Micro-batches per step.
        schedule: The pipelining schedule name.
        comm_time_s: Per layer, seconds to send its output across a stage boundary, or one such row per
            link (optional; overrides ``hardware.comm_time_s``).
        stage_workers: For schedules that run several (virtual) stages per worker: the worker of each
            stage. ``partition`` then minimises the heaviest *worker* (:func:`partition_workers`;
            per-stage memory caps become per-worker caps: the smallest of the worker's stages), and a
            same-size proposal is judged by the heaviest worker's load, which it must cut by
            ``min_gain`` (``diffusion`` still moves layers stage by stage).
        min_saving: A same-size proposal must also save at least this much predicted step time (in
            the cost view's units), e.g. the expected migration cost spread over the steps until the
            next decision, so a migration pays for itself and noise does not move layers back and forth.
        repack_layouts: With ``repack`` under a schedule with several stages per worker: every stage count
            it can run -> the worker of each stage (:func:`~lightning_dynmo.balancing.repack`'s
            ``layouts``); re-packs are then proposed only onto those and judged by the heaviest worker.
        hardware: The pinned first- and last-stage parts (embedding; final norm, head and loss), which
            every balancer, the predicted step and the memory caps count on their stages; worker
            slowdowns; links. ``None``: blocks only, equal workers, free links.
        retune: With ``cost="time"``, when a re-pack is applied, choose the micro-batch count of the
            smaller pipeline among ``retune.counts[new stage count]`` (:func:`choose_microbatches`;
            ``predicted_step_after`` stays the re-pack's at the current count, each count's prediction is
            in ``microbatch_steps``).

    Returns:
        A :class:`RebalanceDecision`. A re-pack is applied when it releases stages within
        ``max_slowdown``; a same-size placement when it is predicted ``min_gain`` faster.
    """
    if len(costs) != current.num_layers:
        raise ValueError(
            f"costs has {len(costs)} records but current={current} covers {current.num_layers} layers; "
            "pass one LayerCost per layer."
        )
    if stage_workers is not None and len(stage_workers) != current.num_stages:
        raise ValueError(
            f"stage_workers has {len(stage_workers)} entries but current={current} has "
            f"{current.num_stages} stages; give the worker of every stage."
        )
    hw = hardware or Hardware()
    if comm_time_s is not None:
        hw = dataclasses.replace(hw, comm_time_s=comm_time_s)
    comm_rows(hw.comm_time_s, len(costs), current.num_stages, "time")  # bad send times fail here
    slowdown = hw.stage_slowdown(current.num_stages, stage_workers)
    check_slowdown(slowdown, current.num_stages, "worker_slowdown")
    config.check_pipeline(current.num_stages)

    def evaluate(placement: Placement, workers: Sequence[int] | None) -> _Prediction:
        return _predict(costs, placement, num_microbatches, schedule, config.cost, hw, workers)

    _check_positive(min_saving, "min_saving", allow_zero=True)
    proposed, reason = _propose(costs, current, config, hw, stage_workers, repack_layouts, num_microbatches)
    proposed_workers = (
        stage_workers
        if proposed.num_stages == current.num_stages
        else (repack_layouts or {}).get(proposed.num_stages)
    )
    before = evaluate(current, stage_workers)
    after = evaluate(proposed, proposed_workers)
    step_before, step_after = before.step, after.step
    if stage_workers is not None and proposed_workers is not None:
        step_before = _heaviest_worker(costs, current, stage_workers, config.cost, hw)
        step_after = _heaviest_worker(costs, proposed, proposed_workers, config.cost, hw)
    apply, why = _worth_it(current, proposed, step_before, step_after, config)
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
    )
    if retune is None or not apply or proposed.num_stages == current.num_stages or config.cost != "time":
        return decision
    return _retuned(decision, costs, config, num_microbatches, schedule, hw, proposed_workers, retune)


def _retuned(
    decision: RebalanceDecision,
    costs: Sequence[LayerCost],
    config: BalanceConfig,
    num_microbatches: int,
    schedule: str,
    hw: Hardware,
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
        costs,
        proposed,
        current=num_microbatches,
        candidates=counts,
        schedule=schedule,
        hardware=hw,
        stage_workers=workers,
        per_op_s=retune.per_op_s,
        memory_capacity_bytes=caps,
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


def _heaviest_worker(
    costs: Sequence[LayerCost], placement: Placement, workers: Sequence[int], by: str, hw: Hardware
) -> float:
    slowdown = None if hw.worker_slowdown is None else list(hw.worker_slowdown)
    loads = worker_loads(
        costs,
        placement,
        workers,
        by,
        hw.first_stage_extra,
        hw.last_stage_extra,
        hw.links(len(costs), placement.num_stages, by),
        slowdown,
    )
    return max(loads.values())


def _propose(
    costs: Sequence[LayerCost],
    current: Placement,
    config: BalanceConfig,
    hw: Hardware,
    stage_workers: Sequence[int] | None,
    repack_layouts: Mapping[int, Sequence[int]] | None,
    num_microbatches: int,
) -> tuple[Placement, str]:
    if config.balancer == "static":
        return current, "static balancer"
    stages, by = current.num_stages, config.cost
    extras = {"first_stage_extra": hw.first_stage_extra, "last_stage_extra": hw.last_stage_extra}
    # The balancers weigh whole steps: a stage sends its activation once per micro-batch.
    per_send = hw.links(len(costs), stages, by)
    links = None if per_send is None else [[num_microbatches * t for t in row] for row in per_send]
    slowdown = hw.stage_slowdown(stages, stage_workers)
    if config.repack:
        packed = repack(
            costs,
            current,
            config.memory_capacity_bytes,
            target_num_stages=config.target_num_stages,
            max_slowdown=config.max_slowdown,
            by=by,
            layouts=repack_layouts,
            comm_time_s=links if repack_layouts is None else None,
            stage_slowdown=slowdown,
            **extras,
        )
        if packed.placement.num_stages < stages:
            return packed.placement, f"re-pack onto {packed.placement.num_stages} stages"
    caps = config.memory_capacity_bytes
    if config.balancer == "diffusion":
        result = diffuse(
            costs,
            current,
            by=by,
            memory_capacity_bytes=caps,
            max_rounds=config.diffusion_max_rounds,
            tolerance=config.diffusion_tolerance,
            first_stage_extra=hw.first_stage_extra,
            last_stage_extra=hw.last_stage_extra,
            comm_time_s=links,
            stage_slowdown=slowdown,
        )
        return result.placement, f"diffusion by {by}"
    if stage_workers is not None:
        balanced = partition_workers(
            costs,
            stage_workers,
            by,
            _stage_caps_per_worker(caps, stage_workers),
            current=current,
            comm_time_s=links,
            worker_slowdown=None if hw.worker_slowdown is None else list(hw.worker_slowdown),
            **extras,
        )
        return balanced.placement, f"partition of the workers by {by}"
    placement = partition(
        costs,
        stages,
        by=by,
        memory_capacity_bytes=caps,
        comm_time_s=links,
        stage_slowdown=slowdown,
        **extras,
    )
    return placement, f"partition by {by}"


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


def _stage_caps_per_worker(
    caps: float | Sequence[float] | None, stage_workers: Sequence[int]
) -> float | dict[int, float] | None:
    """Per-stage memory caps as per-worker caps: a worker gets the smallest cap among its stages."""
    if caps is None or isinstance(caps, (int, float)):
        return caps
    per_stage = memory_caps(caps, len(stage_workers))  # checks one entry per stage
    per_worker: dict[int, float] = {}
    for stage, worker in enumerate(stage_workers):
        per_worker[worker] = min(per_worker.get(worker, math.inf), per_stage[stage])
    return per_worker


# -- checks ----------------------------------------------------------------------------------------


def _check_int(value: object, name: str, minimum: int, hint: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        fix = f"; {hint}" if hint else ""
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}{fix}.")


def _check_positive(value: object, name: str, allow_zero: bool) -> None:
    rule = ">= 0" if allow_zero else "> 0"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        raise ValueError(f"{name}={value!r} must be a finite number {rule}.")


def smooth_costs(
    previous: Sequence[LayerCost] | None, measured: Sequence[LayerCost], weight: float
) -> list[LayerCost]:
    """Exponential moving average of per-layer times: ``weight * previous + (1 - weight) * measured``.

    Fine-grained dynamism (MoE, MoD) makes one window's measurement a noisy sample of what a layer will
    cost next; a placement fitted to that sample is worse than the current one whenever the noise does not
    persist. Averaging over windows keeps what persists (a drift in routing) and cancels what does not.
    Costs are kept per global layer, so the average stays valid across migrations. Sizes (parameters,
    memory, activations) are not noisy and are taken from ``measured``.

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
            num_params=new.num_params,
            memory_bytes=new.memory_bytes,
            activation_bytes=new.activation_bytes,
        )
        for old, new in zip(previous, measured, strict=True)
    ]
