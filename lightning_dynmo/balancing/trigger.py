"""When to rebalance: the triggers and the rebalance history they learn from (pure Python).

Read :class:`TriggerConfig` and :class:`AutoConfig` first, then :class:`RebalanceTrigger`. Four triggers,
any combination that makes sense: every ``n`` steps; on dynamism events (the step after an event is
profiled and rebalanced, as in the paper's Algorithm 1); every step (fine-grained dynamism: MoE, MoD); and
``auto``: fed each step's per-stage busy times (cheap), it fires when the imbalance ``(max - min) / mean``
(paper section 2.2) stays above a threshold for ``patience_steps`` consecutive steps (hysteresis) *and*
the predicted saving over the coming ``horizon_steps`` exceeds the measured cost of a rebalance
(profiling overhead + decision + migration, learned from the previous rebalances, or a configured prior
before the first one); after each rebalance ``auto`` keeps quiet for ``cooldown_steps`` steps.
Time comes from an injected clock. *What* to do once a trigger fires is
:mod:`lightning_dynmo.balancing.policy`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from lightning_dynmo.balancing._checks import check_int, check_positive
from lightning_dynmo.balancing.fields import check_fields, int_field, number_field
from lightning_dynmo.balancing.metrics import imbalance


@dataclass(frozen=True, kw_only=True)
class AutoConfig:
    """The ``auto`` trigger: rebalance when the measured imbalance persists and a rebalance pays back.

    Attributes:
        threshold: Rebalance when the imbalance ``(max - min) / mean`` of per-stage busy times stays
            above this (> 0) ...
        patience_steps: ... for this many consecutive steps (>= 1), and the predicted saving over ...
        horizon_steps: ... this many steps (>= 1) exceeds the measured cost of a rebalance (also how long a
            placement is expected to last for events).
        cooldown_steps: Then wait this many steps (>= 0).
        rebalance_cost_prior_s: The cost assumed for a rebalance before one has been measured (>= 0).
    """

    threshold: float = number_field(0.10, allow_zero=False)
    patience_steps: int = int_field(5, minimum=1)
    horizon_steps: int = int_field(500, minimum=1)
    cooldown_steps: int = int_field(50, minimum=0)
    rebalance_cost_prior_s: float = number_field(1.0)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class TriggerConfig:
    """When to rebalance.

    Attributes:
        every_n_steps: Rebalance every ``n`` steps (at steps ``n, 2n, ...``); ``None`` disables it.
        on_events: Rebalance at the step after a dynamism event (see ``lightning_dynmo.events``).
        every_step: Rebalance at every step (MoE, MoD: the load changes with each batch's routing).
        auto: Rebalance when measured imbalance persists and the predicted gain pays for the cost, with
            these settings; ``None`` disables it.
    """

    every_n_steps: int | None = None
    on_events: bool = True
    every_step: bool = False
    auto: AutoConfig | None = None

    def __post_init__(self) -> None:
        if self.every_n_steps is not None:
            check_int(self.every_n_steps, "every_n_steps", 1, "use None to disable the periodic trigger")
        if self.auto is not None and not isinstance(self.auto, AutoConfig):
            raise ValueError(
                f"auto={self.auto!r} must be an AutoConfig (its settings) or None (no auto trigger)."
            )
        if self.every_step and self.every_n_steps is not None:
            raise ValueError(
                f"every_step=True and every_n_steps={self.every_n_steps} contradict each other: every_step "
                "already rebalances at every step. Set one of them."
            )
        if self.every_step and self.auto is not None:
            raise ValueError(
                "every_step=True and auto=True contradict each other: every_step rebalances at every step "
                "whatever it costs, auto only when it pays. Set one of them."
            )

    @property
    def auto_settings(self) -> AutoConfig:
        """The ``auto`` settings (the defaults when ``auto`` is off: they still size the history)."""
        return self.auto or AutoConfig()

    @property
    def placement_lifetime(self) -> int | None:
        """How many steps a new placement is expected to last: ``every_n_steps``, or ``horizon_steps``
        (:class:`AutoConfig`) for events and ``auto``; ``None`` with ``every_step`` (as long as the current
        one has lasted so far)."""
        if self.every_step:
            return None
        return self.every_n_steps if self.every_n_steps is not None else self.auto_settings.horizon_steps

    @property
    def any_trigger(self) -> bool:
        """Whether any trigger is enabled."""
        return self.on_events or self.every_step or self.auto is not None or self.every_n_steps is not None


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
        n = config.auto_settings.patience_steps
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
        check_int(step, "step", 0, "")
        check_positive(extra_cost_s, "extra_cost_s", allow_zero=True)
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
        check_int(step, "step", 0, "")
        c = self.config
        if self._pending_event:
            self._pending_event = False
            return "event"
        if c.every_n_steps is not None and step > 0 and step % c.every_n_steps == 0:
            return "period"
        if c.every_step:
            return "every_step"
        if c.auto is not None and self._auto_fires(step, c.auto):
            self._window.imbalances.clear()
            self._window.savings_s.clear()
            return "auto"
        return None

    def _auto_fires(self, step: int, c: AutoConfig) -> bool:
        last = self._history[-1].step if self._history else None
        if last is not None and step - last < c.cooldown_steps:
            return False
        w = self._window
        if len(w.imbalances) < c.patience_steps or min(w.imbalances) <= c.threshold:
            return False
        predicted_gain_s = sum(w.savings_s) / len(w.savings_s) * c.horizon_steps
        return predicted_gain_s > self.rebalance_cost_s

    @property
    def rebalance_cost_s(self) -> float:
        """The expected cost of one rebalance: the mean measured cost, or the prior before any."""
        if not self._history:
            return self.config.auto_settings.rebalance_cost_prior_s
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
