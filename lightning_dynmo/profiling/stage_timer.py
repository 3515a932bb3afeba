"""An always-on, cheap per-rank compute timer: how long this rank's stages worked in a step.

It wraps the chunk methods of this rank's ``PipelineStage`` objects (``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``, and ``perform_reduce_grad``, where a stage sharded
with FSDP2 reduce-scatters its gradients once per step after its last backward) on the instances, so
no module carries a hook (migration refuses modules with hooks) and the cost is two marks per
micro-batch and pass, not per layer. Waiting for peers happens outside these methods, so the sum is the
rank's busy time; the step's wall time minus it is the rank's idle time (its bubble).

The strategy rebuilds its stages after a migration or a batch-shape change; :meth:`StageBusyTimer.watch`
re-wraps whenever the stage objects changed, and a step that ran on unwatched stages reports ``None``.

On a GPU the marks are CUDA events, resolved after the step. ``end_step(wait=False)`` (the callback's
steps outside profiling windows) does not synchronise the device: it reports the *previous* step's busy
time, waiting only until the device has passed that step's last mark (which it has, or nearly, by the end
of the next step), so the host keeps running ahead of the device as it does without DynMo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_dynmo.profiling.clock import Mark, StepClock

CHUNK_METHODS = (
    "forward_one_chunk",
    "backward_one_chunk",
    "backward_weight_one_chunk",
    "perform_reduce_grad",
)
_MISSING = object()


class StageBusyTimer:
    """Sums the time spent in this rank's stage chunk methods per step.

    Args:
        clock: Marks from ``perf_counter`` (CPU) or CUDA events (GPU; resolved with one synchronise
            at the end of the step).
    """

    def __init__(self, clock: StepClock) -> None:
        self._clock = clock
        self._stages: tuple[Any, ...] = ()
        self._saved: list[tuple[Any, str, Any]] = []  # (stage, method name, what the instance held before)
        self._intervals: list[tuple[Mark, Mark]] = []
        self._valid = False
        self._pending: list[tuple[Mark, Mark]] | None = None  # a step left to resolve (end_step(wait=False))

    @property
    def watched(self) -> tuple[Any, ...]:
        """The stage objects currently wrapped."""
        return self._stages

    def watch(self, stages: Sequence[Any]) -> None:
        """Wrap ``stages`` (no-op if they are the ones already wrapped); unwraps the previous ones."""
        if len(stages) == len(self._stages) and all(
            a is b for a, b in zip(stages, self._stages, strict=True)
        ):
            return
        self.unwatch()
        for stage in stages:
            for name in CHUNK_METHODS:
                if hasattr(stage, name):
                    self._saved.append((stage, name, vars(stage).get(name, _MISSING)))
                    setattr(stage, name, self._timed(getattr(stage, name)))
        self._stages = tuple(stages)
        self._valid = False  # the current step (if any) started on other stages
        self._pending = None

    def unwatch(self) -> None:
        """Restore the wrapped stages' own methods."""
        for stage, name, previous in reversed(self._saved):
            if previous is _MISSING:
                vars(stage).pop(name, None)
            else:
                setattr(stage, name, previous)
        self._saved.clear()
        self._stages = ()

    @property
    def ran(self) -> bool:
        """Whether a watched stage has run a chunk method in this step so far (since :meth:`begin_step`;
        ``False`` between :meth:`end_step` and the next :meth:`begin_step`)."""
        return bool(self._intervals)

    def begin_step(self) -> None:
        """Start counting a step."""
        self._intervals.clear()
        self._valid = bool(self._stages)

    def end_step(self, wait: bool = True) -> float | None:
        """Busy seconds of the step, or ``None`` if the step was not (fully) watched.

        Args:
            wait: Resolve this step now (on CUDA: one device synchronise). ``False`` on CUDA: no
                synchronise; returns the previous ``wait=False`` step's busy seconds instead (``None``
                for the first, or after a ``wait=True`` step or new stages). On CPU both are the same.
        """
        if not wait and self._clock.uses_cuda_events:
            previous, self._pending = self._pending, (list(self._intervals) if self._valid else None)
            self._intervals.clear()
            if previous is None:
                return None
            if previous:
                self._clock.wait(previous[-1][1])  # the device's progress up to that step's last mark
            return sum(self._clock.elapsed_s(a, b) for a, b in previous)
        self._pending = None
        if not self._valid:
            self._intervals.clear()
            return None
        self._clock.synchronize()
        busy = sum(self._clock.elapsed_s(a, b) for a, b in self._intervals)
        self._intervals.clear()
        return busy

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._clock.mark()
            try:
                return method(*args, **kwargs)
            finally:
                self._intervals.append((start, self._clock.mark()))

        return timed
