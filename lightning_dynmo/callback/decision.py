"""Take the rebalance decision on the deciding rank and hand the same outcome to every active rank.

In the foreground (the default) the deciding rank runs the decision when the profiling window closes and
every rank receives the outcome in one broadcast right away: every rank waits for the search. In the
background (``ProfilingConfig(background_decisions=True)``) the deciding rank hands the search to a helper
process (:class:`~lightning_dynmo.balancing.background.BackgroundCall`) and every rank trains on; the
callback's per-step exchange carries the deciding rank's "ready" flag, and the broadcast happens at the
first step end where it is set, so every rank takes the outcome at the same step.

Either way every rank gets the same outcome: the value, or the same error. A ``ValueError`` raised while
preparing or taking the decision means it could not decide (every rank raises a ``ValueError`` saying
so); anything else is a bug or a dead helper, raised on the deciding rank and as a
:class:`~lightning_dynmo.pipeline.RemoteFailure` naming that rank on the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist

from lightning_dynmo.balancing.background import BackgroundCall
from lightning_dynmo.callback.control_plane import broadcast_object
from lightning_dynmo.pipeline import RemoteFailure

__all__ = ["DecisionRunner", "Prepare"]

#: Run on the deciding rank only: the decision's call (run in the foreground or the helper) and a
#: context value handed to every rank beside its result.
Prepare = Callable[[], tuple[Callable[[], Any], Any]]


class DecisionRunner:
    """One decision at a time, from the deciding rank to every active rank (see the module docstring).

    Args:
        background: Run the decision's call in a helper process while training goes on.
    """

    def __init__(self, background: bool) -> None:
        self.background = background
        self._helper = BackgroundCall() if background else None
        self._source = -1
        self._what = ""
        self._context: Any = None
        self._outcome: Any = None  # the deciding rank's: (value, context), an error text or a RemoteFailure
        self._failure: Exception | None = None
        self.in_flight = False  # on every active rank: started and not yet finished

    def warm(self) -> None:
        """On the deciding rank, before training: start the helper process (a no-op in the foreground)."""
        if self._helper is not None:
            self._helper.start()

    def start(self, prepare: Prepare | None, source: int, what: str) -> None:
        """Begin a decision (every active rank, at the same step; the deciding rank passes ``prepare``).

        Args:
            prepare: On the deciding rank, what to run; ``None`` on the others.
            source: The deciding rank (global).
            what: The decision, for errors ("the rebalance decision at step 12").
        """
        self.in_flight, self._source, self._what = True, source, what
        self._outcome, self._failure = None, None
        if prepare is None:
            return
        try:
            call, self._context = prepare()
            if self._helper is not None:
                self._helper.submit(call)
            else:
                self._outcome = (call(), self._context)
        except Exception as err:
            self._settle(err)

    def ready(self) -> bool:
        """Whether this rank holds the outcome to broadcast (only ever true on the deciding rank)."""
        if not self.in_flight:
            return False
        return self._outcome is not None or (self._helper is not None and self._helper.ready())

    def finish(
        self,
        ranks: Sequence[int],
        group: dist.ProcessGroup | None,
        guard: AbstractContextManager[Any],
    ) -> tuple[Any, Any]:
        """Every active rank: the deciding rank's ``(value, context)``; its error is raised on every rank.

        A collective: call it on every active rank at the same step (in the background, at the step end
        whose exchange says the deciding rank is :meth:`ready`).
        """
        if self._outcome is None and self._helper is not None and self._helper.in_flight:
            try:
                self._outcome = (self._helper.result(), self._context)
            except Exception as err:
                self._settle(err)
        with guard:
            outcome = broadcast_object(self._outcome, self._source, ranks, group)
        failure, self._failure, self._outcome, self.in_flight = self._failure, None, None, False
        if failure is not None:
            raise failure
        if isinstance(outcome, RemoteFailure):
            outcome.raise_here()
        if isinstance(outcome, str):
            raise ValueError(f"DynMo could not decide a placement: {outcome}")
        value, context = outcome
        return value, context

    def close(self) -> None:
        """End the helper process, dropping a decision in flight (safe to call twice)."""
        if self._helper is not None:
            self._helper.close()
        self.in_flight, self._outcome, self._failure = False, None, None

    def _settle(self, err: Exception) -> None:
        """The deciding rank's outcome is an error: the others get its text or a RemoteFailure."""
        if isinstance(err, ValueError):
            self._outcome = f"{err}"
            return
        self._failure, self._outcome = err, RemoteFailure.of(err, self._source, self._what)
        err.add_note(f"DynMo: raised on rank {self._source} during {self._what}; every rank stops with it.")
