"""torch's multi-stage schedules with their lowering pass run once per action lists, not once per build.

A multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)
lowers its compute actions to the compute + communication lists its runtime executes
(``_PipelineScheduleRuntime._prepare_schedule_with_comms``) every time it is built, for every rank of the
pipeline: under ZBVZeroBubble with 32 micro-batches, 12.9 ms of CPU at 8 ranks and 25.8 ms at 16 on our
2-core CPU VM (1.1 and 2.2 ms when looked up), about half the CPU a migration's rebuild cost a rank in
the 8-rank replay (the layers' transfer is a few ms). A migration keeps the stage count and the
micro-batches, so the lists to lower are the same (and each rank lowers every rank's lists, so ranks that
share a process, as in the tests, share one lowering).

:func:`with_cached_lowering` gives a subclass of torch's class whose lowering is looked up by everything
that pass reads (the compute lists, the stage and micro-batch counts, ``defer_pp_recv``) and otherwise
runs torch's own and keeps its result. The stage mapping is still validated and set from the lists on
every build, as torch does. ``tests/unit/pipeline/test_lowering.py`` compares the lists with torch's
uncached ones for every multi-stage schedule.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Literal

from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

__all__ = ["LOWERED_MAX", "with_cached_lowering"]

#: Lowered lists kept (least recently used dropped first): one per pipeline shape a run has used.
LOWERED_MAX = 16

_LOWERED: OrderedDict[tuple[Any, ...], dict[int, tuple[_Action, ...]]] = OrderedDict()


@functools.cache
def with_cached_lowering(cls: type[Any]) -> type[Any]:
    """``cls`` (one of torch's multi-stage schedule classes) with its lowering looked up when known."""

    if not issubclass(cls, _PipelineScheduleRuntime):
        raise TypeError(f"{cls.__name__} does not lower its actions (not a _PipelineScheduleRuntime).")

    class CachedLowering(cls):  # type: ignore[misc]  # a class chosen at run time
        def _prepare_schedule_with_comms(
            self,
            actions: dict[int, list[_Action | None]],
            format: Literal["compute_only", "compute_comms"] = "compute_only",
        ) -> None:
            if format != "compute_only":
                super()._prepare_schedule_with_comms(actions, format=format)
                return
            key = (
                cls,
                self._num_stages,
                self._n_microbatches,
                self._defer_pp_recv,
                tuple((rank, tuple(actions[rank])) for rank in sorted(actions)),
            )
            lowered = _LOWERED.get(key)
            if lowered is None:
                super()._prepare_schedule_with_comms(actions, format=format)
                comms: dict[int, list[_Action]] = self.pipeline_order_with_comms  # type: ignore[has-type]
                _LOWERED[key] = {rank: tuple(acts) for rank, acts in comms.items()}
                while len(_LOWERED) > LOWERED_MAX:
                    _LOWERED.popitem(last=False)
                return
            _LOWERED.move_to_end(key)
            self._validate_and_set_stage_mapping(actions)  # what torch's lowering does first
            self.pipeline_order_with_comms = {rank: list(acts) for rank, acts in lowered.items()}

    CachedLowering.__name__ = cls.__name__
    CachedLowering.__qualname__ = cls.__qualname__
    CachedLowering.__doc__ = cls.__doc__
    return CachedLowering
