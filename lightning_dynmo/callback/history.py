"""The callback's history: typed decision records, events, overhead, checkpoint state and the measured gain.

A :class:`DecisionRecord` is one decision the callback took (applied or kept), what it predicted and what
it cost; :class:`RebalanceHistory` keeps the most recent ones and the dynamism events (capped, see
:data:`~lightning_dynmo.callback.control_plane.MAX_HISTORY`), saves them in the checkpoint format of the
flat dicts they replace (old checkpoints load), and follows the measured gain of the last applied
rebalance (:class:`~lightning_dynmo.balancing.gain.GainMeter`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_dynmo.balancing.gain import GainMeter, MeasuredGain, StepPhase
from lightning_dynmo.callback.control_plane import keep_recent
from lightning_dynmo.events import DynamismEvent

__all__ = ["DecisionRecord", "RebalanceHistory", "WindowOverhead"]


@dataclass(frozen=True)
class WindowOverhead:
    """What a profiling window and its decision cost, in seconds, before the migration.

    Attributes:
        profiling_s: The profiler's hook time over the window's steps (warm-up included).
        decision_s: Gathering the costs, deciding and broadcasting the decision.
    """

    profiling_s: float = 0.0
    decision_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class DecisionRecord:
    """One decision of the callback (not :class:`~lightning_dynmo.balancing.policy.RebalanceRecord`, the
    trigger's record of a rebalance's cost).

    Attributes:
        step: The global step it was applied at.
        reason: What opened the window (``"event"``, ``"every_n_steps"``, ``"every_step"``, ``"auto"``,
            ``"resume"``).
        old: The placement before, as text.
        new: The proposed placement, as text.
        applied: Whether ``new`` replaced ``old``.
        why: The balancer's reason.
        predicted_gain: The predicted step-time saving (fraction).
        measured_gain: The measured saving once the new placement has run (``None`` until then).
        num_microbatches: The micro-batch count after the decision (``None`` in checkpoints from before
            it was recorded).
        per_op_s: The runtime's measured fixed seconds per forward or backward action that every
            predicted step included (``0``: bare work, the ``"params"`` view, or checkpoints from before
            it was measured).
        profiling_s: See :class:`WindowOverhead`.
        decision_s: See :class:`WindowOverhead`.
        migration_s: Moving the layers (0 when kept).
    """

    step: int
    reason: str
    old: str
    new: str
    applied: bool
    why: str
    predicted_gain: float
    measured_gain: float | None = None
    num_microbatches: int | None = None
    per_op_s: float = 0.0
    profiling_s: float
    decision_s: float
    migration_s: float

    @property
    def overhead_s(self) -> float:
        """Profiling, decision and migration together."""
        return self.profiling_s + self.decision_s + self.migration_s

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint form (the flat dict of earlier versions)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> DecisionRecord:
        """Read :meth:`to_dict`'s form (keys it does not know are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


class RebalanceHistory:
    """Decisions and events (the most recent of each), the total overhead, and the gain being followed."""

    def __init__(self, gain: GainMeter) -> None:
        self.events: list[DynamismEvent] = []
        self.rebalances: list[DecisionRecord] = []
        self.dropped = {"events": 0, "rebalances": 0}  # records dropped by the cap
        self.overhead_s = 0.0
        self._gain = gain
        self._followed: DecisionRecord | None = None  # the record the meter follows

    def add_events(self, events: list[DynamismEvent]) -> None:
        """Keep ``events`` (the agreed ones of a step)."""
        self.events.extend(events)
        self.dropped["events"] += keep_recent(self.events)

    def quiet_step_s(self) -> float | None:
        """The hook-free step of the placement now running (:meth:`GainMeter.quiet_step_s`)."""
        return self._gain.quiet_step_s()

    def add(self, record: DecisionRecord) -> None:
        """Keep ``record``, count its overhead, and follow its measured gain if it moved layers."""
        self.overhead_s += record.overhead_s
        self.rebalances.append(record)
        self.dropped["rebalances"] += keep_recent(self.rebalances)
        if record.applied and self._gain.rebalanced():
            self._followed = record

    # -- measured gain --------------------------------------------------------------------------------

    def window_opened(self) -> None:
        """A profiling window opened: the meter leaves its steps out."""
        self._gain.window_opened()

    def observe_step(
        self, step_s: float, phase: StepPhase, cost_changed: bool
    ) -> tuple[DecisionRecord, MeasuredGain] | None:
        """Feed one agreed step time; the followed record, updated, once its gain is measured."""
        measured = self._gain.observe(step_s, phase)
        if cost_changed:
            self._gain.cost_changed()  # after observing: this step ran (mostly) before the change
        if measured is None or self._followed is None:
            return None
        followed, self._followed = self._followed, None
        record = dataclasses.replace(followed, measured_gain=measured.gain)
        # Still in the history unless the cap dropped it meanwhile (then only the log line reports it).
        for i, kept in enumerate(self.rebalances):
            if kept is followed:
                self.rebalances[i] = record
        return record, measured

    def min_saving(self, step: int, lasts_steps: int | None) -> float:
        """Predicted per-step saving a migration must bring: its mean measured cost over its life.

        Args:
            step: The current step.
            lasts_steps: How long a placement is expected to last; ``None``: as long as the current one
                has lasted so far (``every_step``: right after a migration the bar is high, so noise does
                not move layers back and forth, and it falls while a placement stays).
        """
        migrations = [r for r in self.rebalances if r.applied]
        if not migrations:
            return 0.0
        lasts = step - migrations[-1].step if lasts_steps is None else lasts_steps
        return statistics.mean(r.migration_s for r in migrations) / max(lasts, 1)

    # -- checkpoint -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The history's part of the callback's checkpoint state (the keys of earlier versions)."""
        return {
            "events": [e.to_dict() for e in self.events],
            "rebalances": [r.to_dict() for r in self.rebalances],
            "overhead_s": self.overhead_s,
            "dropped_history": dict(self.dropped),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s form (checkpoints without ``dropped_history`` too)."""
        self.events = [DynamismEvent.from_dict(e) for e in state["events"]]
        self.rebalances = [DecisionRecord.from_dict(r) for r in state["rebalances"]]
        self.overhead_s = float(state["overhead_s"])
        self.dropped = dict(state.get("dropped_history", {"events": 0, "rebalances": 0}))
        self.dropped["events"] += keep_recent(self.events)
        self.dropped["rebalances"] += keep_recent(self.rebalances)
        self._followed = None
