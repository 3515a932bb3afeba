"""The profiling window: when it opens and closes, what it may reuse, and when a step has nothing to gain.

A window wraps this rank's layers in a :class:`~lightning_dynmo.profiling.LayerProfiler` for
``warmup_steps + steps`` steps; its result is what :mod:`.measure` turns into costs. Every-step windows
reuse recent activation sizes (:meth:`ProfilingWindow.known_activations`); every-step windows, and
event windows once a decision has been taken, are skipped while they cannot change the placement
(:meth:`ProfilingWindow.admit`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_dynmo.balancing.gain import StepPhase
from lightning_dynmo.balancing.headroom import StageLoadAverage, headroom, pinned_headroom, pinned_workers
from lightning_dynmo.balancing.trigger import RebalanceTrigger
from lightning_dynmo.pipeline import part_modules
from lightning_dynmo.profiling import LayerProfiler, ProfileResult
from lightning_dynmo.strategy.view import PipelineView

__all__ = ["ACTIVATION_REFRESH_STEPS", "SKIP_DRIFT", "WAIT", "ProfilingWindow", "window_reason"]

#: Every-step windows reuse a layer's activation sizes measured on this rank at most this many steps ago.
ACTIVATION_REFRESH_STEPS = 100
#: skip_balanced by time: after a decision kept the placement, every-step windows are skipped while no
#: stage's share of the averaged busy time moves by more than this fraction of the busiest stage's share;
#: after one that moved layers, while the shares stay that close to the ones it predicted.
SKIP_DRIFT = 0.05
#: :meth:`ProfilingWindow.admit`'s answer for an event it judges on the loads of the step after it.
WAIT = "wait"


class ProfilingWindow:
    """This rank's profiling windows, one at a time, and what the skipping rule remembers between them.

    Args:
        warmup_steps: Steps profiled but not counted at the start of a window.
        steps: Steps measured per window.
        smoothing: The history weight of the averaged stage loads (the costs' smoothing weight).
        skip: Whether every-step windows, and event windows after a first decision, that cannot change
            the placement are skipped (``skip_balanced``, never with a re-pack).
        by_params: Whether the balancer weighs parameter counts (they change only with an event).
        min_gain: The smallest predicted gain a new placement needs.
    """

    def __init__(
        self, *, warmup_steps: int, steps: int, smoothing: float, skip: bool, by_params: bool, min_gain: float
    ) -> None:
        self.warmup_steps = warmup_steps
        self.steps = steps
        self._skip, self._by_params, self._min_gain = skip, by_params, min_gain
        self.stage_loads = StageLoadAverage(smoothing)
        self.skipped = 0  # windows skipped by skip_balanced (this run)
        self._pinned_said: int | None = None  # the pinned rank pinned_news last named
        self.news: str | None = None  # the line to log about what admit skipped at this step
        self._params_settled = False  # by params: the last decision kept the placement, no event since
        self._confirmed = False  # by time: the last move delivered; mark the loads observed next
        self.profiler: LayerProfiler | None = None
        self.reason = ""
        self.busy_s: list[float] = []  # this rank's busy seconds in the window's measured steps
        self._steps_run = 0
        # Per local layer or part: (saved-activation bytes, output bytes, step metered).
        self.activations: dict[int | str, tuple[int, int, int]] = {}

    @property
    def is_open(self) -> bool:
        """Whether a window is profiling."""
        return self.profiler is not None

    def admit(
        self, reason: str | None, sizes: Sequence[int], workers: Sequence[int] | None = None
    ) -> str | None:
        """Why a window opens at this step: the trigger's ``reason``, ``None`` when ``skip_balanced``
        skips it (counted in :attr:`skipped`), or :data:`WAIT` for an event judged one step later.

        An every-step window is skipped by :meth:`nothing_to_gain`. So is an event's by time, once a
        decision has marked the loads, judged on the first step that ran the changed model: the event's
        own when every event came before its rank's stages computed (a batch-start hook), else the next
        (:data:`WAIT`: the caller asks again then). The window opens only if those loads moved away from
        the mark by :data:`SKIP_DRIFT` or more (and leave ``min_gain`` of headroom, a pinned rank's load
        counted as a floor: :func:`~lightning_dynmo.balancing.headroom.pinned_headroom`). An event that
        leaves the stages' shares where the last decision saw them would lead to the same decision, so
        its profiling and search are spared. Before any decision an event's window opens at once.

        Args:
            reason: What the trigger answered for this step.
            sizes: Layers per stage of the running placement.
            workers: The pipeline rank of every stage (``None``: one stage per rank).
        """
        self.news = None
        event = reason == "event" and self._skip and not self._by_params and self.stage_loads.marked
        if event and self.stage_loads.loads is None:
            return WAIT
        if (reason == "every_step" or event) and self.nothing_to_gain(sizes, workers):
            self.skipped += 1
            self.news = self.pinned_news(sizes, workers) or (self._event_news() if event else None)
            return None
        return reason

    def _event_news(self) -> str:
        room, drift = self.stage_loads.headroom, self.stage_loads.drift
        return (
            f"DynMo: the step after the dynamism event leaves {room or 0.0:.1%} headroom (min_gain "
            f"{self._min_gain:.0%}) and moved the stages' shares {drift or 0.0:.1%} from the last decision's "
            f"(SKIP_DRIFT {SKIP_DRIFT:.0%}): the same decision would follow, so its window is skipped "
            "(skip_balanced=False profiles every event)"
        )

    def nothing_to_gain(self, sizes: Sequence[int], workers: Sequence[int] | None = None) -> bool:
        """Whether this step's every-step window cannot change the placement (``skip_balanced``).

        Every rank reads the same all-gathered loads and the same broadcast decisions, so every rank
        skips the same steps. Reads the window's state only.

        Args:
            sizes: Layers per stage of the running placement.
            workers: The pipeline rank of every stage (``None``: one stage per rank).
        """
        if not self._skip:
            return False
        if self._by_params:
            return self._params_settled
        loads = self.stage_loads.loads
        if loads is None:
            return True  # no step measured since the start, a move or an event: judge after one
        # No placement brings the busiest rank below the mean, nor below a rank running only end stages
        # of one layer each: 0 when such a rank is the busiest (nothing to move off it).
        room = pinned_headroom(loads, sizes, workers)
        drift = self.stage_loads.drift  # set while the last decision kept the placement on these loads
        return room < self._min_gain or (drift is not None and drift < SKIP_DRIFT)

    def _pinned(self, sizes: Sequence[int], workers: Sequence[int] | None) -> int | None:
        """The rank running only end stages of one layer each that leaves less than ``min_gain`` to gain
        when the mean alone leaves more, by the averaged loads (by time only); else ``None``."""
        loads = self.stage_loads.loads
        if not self._skip or self._by_params or loads is None or headroom(loads) < self._min_gain:
            return None
        if pinned_headroom(loads, sizes, workers) >= self._min_gain:
            return None
        return max(pinned_workers(sizes, workers), key=lambda w: loads[w])

    def pinned_news(self, sizes: Sequence[int], workers: Sequence[int] | None = None) -> str | None:
        """After a skip: one line naming the pinned rank that caused it the first time, else ``None``.

        Args:
            sizes: Layers per stage of the running placement.
            workers: The pipeline rank of every stage (``None``: one stage per rank).
        """
        rank, said = self._pinned(sizes, workers), self._pinned_said
        self._pinned_said = rank
        loads = self.stage_loads.loads
        if rank is None or rank == said or loads is None:
            return None
        stages = [rank] if workers is None else [s for s, w in enumerate(workers) if w == rank]
        parts = " and the ".join("embedding" if s == 0 else "head and loss" for s in stages)
        busiest = loads[rank] == max(loads)
        if workers is None:
            what = (
                f"stage {rank} {'is the busiest and ' if busiest else ''}holds one layer beside the {parts}"
            )
        else:
            each, runs = (" each", "s") if len(stages) > 1 else ("", "")
            named = " and ".join(str(s) for s in stages)
            what = (
                f"pipeline rank {rank} {'is the busiest and ' if busiest else ''}runs stage{runs} {named} of "
                f"{len(sizes)}, one layer{each} beside the {parts}"
            )
        gap = (
            ""
            if busiest
            else (
                f", and its load is within {1.0 - loads[rank] / max(loads):.1%} of the busiest rank's "
                f"(min_gain {self._min_gain:.0%})"
            )
        )
        return (
            f"DynMo: {what}: no placement of whole layers over {len(sizes)} stages lightens it{gap}, so "
            "windows are skipped while it stays so (a re-pack onto fewer stages could help: repack=True)"
        )

    def open(self, view: PipelineView, optimizer: Any, step: int, reason: str) -> None:
        """Start profiling this rank's layers and parts for a window opened by ``reason``."""
        self.reason = reason
        self.profiler = LayerProfiler(
            view.local_layers,
            warmup_steps=self.warmup_steps,
            profile_steps=self.steps,
            device=view.root_device,
            optimizer=optimizer,
            stages=view.pipeline_stages,
            microbatches_per_step=view.num_microbatches,
            known_activations=self.known_activations(view.local_layers, step, reason),
            parts=part_modules([stage.submod for stage in view.pipeline_stages]),
        )
        self.profiler.start()
        self._steps_run = 0
        self.busy_s = []

    def known_activations(
        self, layers: Mapping[int, Any], step: int, reason: str
    ) -> dict[int | str, tuple[int, int]]:
        """Activation sizes an every-step window can reuse instead of metering them again.

        Saved-activation sizes follow shapes, not routing, so back-to-back every-step windows reuse what
        an earlier window on this rank measured for the same layer, for up to
        ``ACTIVATION_REFRESH_STEPS`` steps: they then run without the meter's per-tensor hook (which
        would also sit inside the timed forward, as those windows have no warm-up step). Windows opened
        for any other reason (an event, a period, ``auto``) meter every layer.
        """
        if reason != "every_step":
            return {}
        return {
            i: (saved, output)
            for i, (saved, output, metered_at) in self.activations.items()
            if (i in layers or isinstance(i, str)) and step - metered_at < ACTIVATION_REFRESH_STEPS
        }

    def begin_step(self) -> StepPhase:
        """Start a step: its phase for the gain meter (``"quiet"`` outside a window)."""
        if self.profiler is None:
            return "quiet"
        self.profiler.begin_step()
        self._steps_run += 1
        return "warmup" if self._steps_run <= self.warmup_steps else "profiled"

    def before_update(self) -> None:
        """The optimizer is about to update: a window times the update (outside one, nothing runs)."""
        if self.profiler is not None:
            self.profiler.before_update()

    def end_step(self, phase: StepPhase, busy_s: float | None) -> bool:
        """End a step; whether the window is complete (then :meth:`close` it)."""
        if phase == "profiled" and busy_s is not None:
            self.busy_s.append(busy_s)
        return self.profiler is not None and self.profiler.end_step()

    def close(self, step: int) -> ProfileResult:
        """The complete window's result; remembers the activation sizes it metered."""
        assert self.profiler is not None
        result = self.profiler.result()
        known = self.profiler.known_activations
        self.profiler = None
        for i, (saved, output) in result.activations().items():
            if i not in known:
                self.activations[i] = (saved, output, step)
        return result

    def stop(self) -> None:
        """Drop an unfinished window (training ended)."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def decided(self, applied: bool, expected: Sequence[float] | None = None) -> None:
        """A decision was taken: a new placement restarts the loads; a kept one settles the skip rule.

        Args:
            applied: Whether it moved layers.
            expected: Its prediction of each pipeline rank's load under the new placement: the skip rule
                then holds while the measured loads stay within :data:`SKIP_DRIFT` of it (by time only).
        """
        self._params_settled = not applied  # read only by params
        self._confirmed = False
        if applied:
            self.stage_loads.restart(None if self._by_params else expected)
        else:
            self.stage_loads.mark()  # by time: skip while the loads stay where this decision saw them

    def move_confirmed(self) -> None:
        """The last move measured at least the gain it was trusted for (by time): the loads observed next
        replace its prediction as the mark the skip rule compares with.

        A move's prediction of how the ranks share the load carries the step model's own error (on a
        deep pipeline a few percent a rank), so the measured shares of a move that did what it promised
        can still leave the predicted ones by :data:`SKIP_DRIFT`, and a window would open to find the
        placement it just chose. Once its gain is measured, the shares it achieved are the reference: a
        window opens when they move. A dynamism event observed with those loads cancels this (the event
        is judged against the mark as it stands).
        """
        self._confirmed = not self._by_params

    def event_seen(self) -> None:
        """Some rank had a dynamism event: it may change what the balancer reads."""
        self._params_settled = False

    def observe_loads(self, stage_busy: list[float], event: bool, shown: bool = False) -> None:
        """Feed a step's agreed per-stage busy times.

        An event restarts the averaged loads, keeping the last decision's mark to compare them with: from
        this step's loads when they show the change (``shown``: every event came before its rank's stages
        computed, :class:`~lightning_dynmo.callback.control_plane.EventInbox`), else from the next step's.
        """
        if event:
            self._confirmed = False  # judge the event against the mark as it stands
            self.stage_loads.stale()
            if not shown:
                return  # the model changed while this step ran: its loads may describe the old one
        self.stage_loads.update(stage_busy)
        if self._confirmed:
            self._confirmed = False
            self.stage_loads.mark()  # the shares the confirmed move achieved


def window_reason(
    window: ProfilingWindow,
    trigger: RebalanceTrigger,
    step: int,
    sizes: Sequence[int],
    resume: bool,
    workers: Sequence[int] | None = None,
) -> str | None:
    """Why a window opens at ``step``, or ``None``: the trigger's reason as :meth:`ProfilingWindow.admit`
    judges it (``resume``: the run resumed on another pipeline, a window at once).

    An event that ``admit`` skips, or defers to the loads of its next step (:data:`WAIT`: the trigger is
    re-armed), leaves a reason of lower priority due at this step its window: a period of
    ``every_n_steps`` opens as it would have without the event. The skip's news is kept.

    Args:
        window: The rank's profiling windows (closed).
        trigger: The rank's trigger, asked once, or twice after such an event.
        step: The global step starting.
        sizes: Layers per stage of the running placement.
        resume: Whether to open a window for a resume.
        workers: The pipeline rank of every stage (``None``: one stage per rank).
    """
    reason = "resume" if resume else trigger.check(step)
    admitted = window.admit(reason, sizes, workers)
    if reason != "event" or admitted not in (None, WAIT):
        return admitted
    news, other = window.news, trigger.check(step)  # the event is taken: what else is due now
    if admitted == WAIT:
        trigger.notify_event()  # judged on the loads of the step after this one
    if other is None:
        return None
    admitted = window.admit(other, sizes, workers)
    window.news = window.news or news
    return admitted
