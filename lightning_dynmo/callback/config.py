"""DynMoCallback's grouped knobs: profiling, the ``auto`` trigger and the re-pack, each a frozen config.

:class:`AutoConfig` is the trigger's own (:mod:`lightning_dynmo.balancing.trigger`), re-exported here.

Each group is a kw-only frozen dataclass whose fields keep the defaults and the checks the flat keywords
had; :func:`refuse_moved_keywords` turns a keyword of the old flat constructor into a ``TypeError`` that
names its new place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch

from lightning_dynmo.balancing.trigger import AutoConfig  # the auto trigger's settings, defined with it

__all__ = [
    "COST_MARGIN",
    "EVERY_STEP_COST_SMOOTHING",
    "MOVED_KEYWORDS",
    "AutoConfig",
    "ProfilingConfig",
    "RepackConfig",
    "refuse_moved_keywords",
    "switched",
]

#: ``ProfilingConfig.cost_smoothing`` with ``every_step``: the history's weight per step.
EVERY_STEP_COST_SMOOTHING = 0.5
#: ``ProfilingConfig.cost_margin``: standard deviations of a layer's averaged windows a decision adds.
COST_MARGIN = 1.0


@dataclass(frozen=True, kw_only=True)
class ProfilingConfig:
    """How a profiling window measures, and where its decision is searched.

    Attributes:
        warmup_steps: Steps profiled but not counted at the start of a window; ``None``: 1, or 0 with
            ``every_step`` (the extra shape-inference pass of a rebuilt pipeline is scaled away).
        steps: Steps measured per window, layer costs being their per-layer medians; ``None``: 3, or 1
            with ``every_step`` (a window per step: profile, decide, migrate, repeat). Every-step windows
            re-meter saved activations only every ``ACTIVATION_REFRESH_STEPS`` steps (and for a layer new
            on the rank); their sizes follow shapes, and the meter costs a hook per tensor.
        cost_smoothing: Weight ``w`` of the history in a moving average of each layer's measured times
            over windows, in ``[0, 1)``: a window's costs weigh ``(1 - w) w ** age``, ``age`` in steps,
            over the weights' sum (bias-corrected: the first window weighs no more than the ones after
            it, and the steps of skipped windows age the history; see
            :class:`~lightning_dynmo.balancing.averaging.HistoryWeight`). ``None``:
            ``EVERY_STEP_COST_SMOOTHING`` with ``every_step`` (one step's routing is a noisy sample: act
            on what persists), 0 otherwise (after an event or a period the fresh measurement is the
            truth). Windows opened by a dynamism event always start fresh.
        cost_margin: A decision plans each layer at its averaged times plus this many standard deviations
            of the averaged windows (same weights), >= 0: a layer whose cost swings between steps is
            planned at what it reaches in a bad one, so the search does not pack layers that merely
            happened to be light together (:mod:`lightning_dynmo.balancing.spread`). With one window
            in the average (``cost_smoothing`` 0, the first window, a window after an event) there is
            no spread and the plan is the measurement. ``COST_MARGIN`` (1) by default; 0 plans on the
            average alone.
        measure_comm: Time each stage boundary's activation transfer, link by link, in every window
            (every-step windows reuse the last measurement) and feed it to the balancer: the sending stage
            pays it (single-stage schedules only).
        measure_speed: Time one fixed reference workload on every rank in each window and balance for the
            measured worker speeds: a layer moved to a slower worker costs more there (see
            :mod:`lightning_dynmo.profiling.speed`). Workers within ``SPEED_TOLERANCE`` of the fastest
            count as equal.
        speed_probe: The reference workload ``(device, dtype) -> seconds`` for ``measure_speed``; ``None``:
            :func:`~lightning_dynmo.profiling.speed.time_reference_workload` (an MLP forward and backward).
            Every rank must run the same work.
        background_decisions: Search for the placement in a helper process on the deciding rank while
            every rank trains on (:mod:`~lightning_dynmo.callback.decision`); the decision is then applied
            at the first step boundary after it is ready, one or more steps after its window, instead of
            every rank waiting for the search when the window closes.

    Raises:
        ValueError: ``warmup_steps`` is not an integer >= 0, ``steps`` not an integer >= 1, or
            ``cost_smoothing`` outside ``[0, 1)``, ``cost_margin`` negative, or ``background_decisions``
            not a bool.
    """

    warmup_steps: int | None = None
    steps: int | None = None
    cost_smoothing: float | None = None
    cost_margin: float = COST_MARGIN
    measure_comm: bool = True
    measure_speed: bool = False
    speed_probe: Callable[[torch.device, torch.dtype], float] | None = None
    background_decisions: bool = False

    def __post_init__(self) -> None:
        warmup, steps, weight = self.warmup_steps, self.steps, self.cost_smoothing
        if warmup is not None and (not isinstance(warmup, int) or warmup < 0):
            raise ValueError(f"ProfilingConfig(warmup_steps={warmup!r}) must be an integer >= 0.")
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"ProfilingConfig(steps={steps!r}) must be an integer >= 1.")
        if not isinstance(self.background_decisions, bool):
            raise ValueError(
                f"ProfilingConfig(background_decisions={self.background_decisions!r}) must be True or False."
            )
        margin = self.cost_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
            raise ValueError(
                f"ProfilingConfig(cost_margin={margin!r}) must be a number >= 0: the standard deviations "
                "of a layer's averaged windows a decision adds to its cost; 0 plans on the average alone."
            )
        if weight is not None and not (isinstance(weight, (int, float)) and 0.0 <= weight < 1.0):
            raise ValueError(
                f"ProfilingConfig(cost_smoothing={weight!r}): cost_smoothing={weight!r} must be in [0, 1), "
                "the weight of the history; pass e.g. 0.8, or 0 to act on each window's measurement alone."
            )

    def resolved(self, every_step: bool) -> ProfilingConfig:
        """The same knobs with every ``None`` replaced by its default for ``every_step``."""
        return ProfilingConfig(
            warmup_steps=(0 if every_step else 1) if self.warmup_steps is None else self.warmup_steps,
            steps=(1 if every_step else 3) if self.steps is None else self.steps,
            cost_smoothing=(EVERY_STEP_COST_SMOOTHING if every_step else 0.0)
            if self.cost_smoothing is None
            else self.cost_smoothing,
            cost_margin=self.cost_margin,
            measure_comm=self.measure_comm,
            measure_speed=self.measure_speed,
            speed_probe=self.speed_probe,
            background_decisions=self.background_decisions,
        )


@dataclass(frozen=True, kw_only=True)
class RepackConfig:
    """The re-pack: move the layers onto fewer stages when the work shrinks and release the other ranks.

    Attributes:
        target_num_stages: The stage count to re-pack onto (``None``: automatic).
        max_slowdown: The largest accepted predicted step-time increase (fraction).
        retune_microbatches: With ``cost="time"``: when a re-pack is applied, re-tune the micro-batch
            count for the smaller pipeline (a divisor of the batch the schedule accepts, chosen by the
            simulator with the measured fixed cost per op and the memory caps; see
            :mod:`lightning_dynmo.balancing.microbatches`). Training stays exactly the same.
    """

    target_num_stages: int | None = None
    max_slowdown: float = 0.05
    retune_microbatches: bool = False


#: A keyword of the flat constructor -> where it lives now.
MOVED_KEYWORDS: dict[str, str] = {
    "profile_warmup_steps": "profiling=ProfilingConfig(warmup_steps=...)",
    "profile_steps": "profiling=ProfilingConfig(steps=...)",
    "cost_smoothing": "profiling=ProfilingConfig(cost_smoothing=...)",
    "measure_comm": "profiling=ProfilingConfig(measure_comm=...)",
    "measure_speed": "profiling=ProfilingConfig(measure_speed=...)",
    "speed_probe": "profiling=ProfilingConfig(speed_probe=...)",
    "auto_threshold": "auto=AutoConfig(threshold=...)",
    "auto_patience_steps": "auto=AutoConfig(patience_steps=...)",
    "auto_horizon_steps": "auto=AutoConfig(horizon_steps=...)",
    "auto_cooldown_steps": "auto=AutoConfig(cooldown_steps=...)",
    "rebalance_cost_prior_s": "auto=AutoConfig(rebalance_cost_prior_s=...)",
    "target_num_stages": "repack=RepackConfig(target_num_stages=...)",
    "max_slowdown": "repack=RepackConfig(max_slowdown=...)",
    "retune_microbatches": "repack=RepackConfig(retune_microbatches=...)",
}

P = ParamSpec("P")
R = TypeVar("R")


def refuse_moved_keywords(init: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``DynMoCallback.__init__`` so an old flat keyword fails naming its new place.

    The wrapper keeps the wrapped signature (``inspect.signature`` follows ``__wrapped__``), so the
    Hydra schema and the generated API reference read the real arguments.
    """

    @functools.wraps(init)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        moved = [name for name in kwargs if name in MOVED_KEYWORDS]
        if moved:
            where = "; ".join(f"{name} moved to DynMoCallback({MOVED_KEYWORDS[name]})" for name in moved)
            raise TypeError(f"DynMoCallback got old keyword(s) {moved}: {where}.")
        return init(*args, **kwargs)

    return checked


C = TypeVar("C", AutoConfig, RepackConfig)


def switched(name: str, value: bool | C, default: C) -> C | None:
    """A switch-or-config knob: the config given, ``default`` for ``True``, ``None`` (off) for ``False``.

    Raises:
        ValueError: ``value`` is neither a bool nor a config of ``default``'s type.
    """
    if isinstance(value, type(default)):
        return value
    if isinstance(value, bool):
        return default if value else None
    kind = type(default).__name__
    raise ValueError(f"{name}={value!r} must be True, False or {kind}(...); pass e.g. {name}={kind}().")
