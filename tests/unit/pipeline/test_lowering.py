"""torch's multi-stage schedules with their lowering looked up (``pipeline.step.lowering``).

- For every multi-stage schedule and several shapes, a schedule built with a lowering already known holds
  the same compute + comms lists and stage mapping as torch's own class, built uncached, on every rank;
  torch's pass ran once per shape (each rank lowers every rank's lists, so ranks share it).
- The lists differ between shapes the cache tells apart (micro-batches, stages): a lookup that ignored
  them would fail the comparison above (its negative control).
- A class that does not lower its actions is refused.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.pipelining.schedules import Schedule1F1B, _PipelineScheduleRuntime

from lightning_dynmo.pipeline.step import lowering
from lightning_dynmo.pipeline.step.lowering import with_cached_lowering
from lightning_dynmo.pipeline.step.schedule import SCHEDULE_NAMES, resolve_schedule

MULTI = [n for n in SCHEDULE_NAMES if resolve_schedule(n).stages_per_rank == 2]


def stubs(num_stages: int, rank: int, style: str) -> list[SimpleNamespace]:
    """What the schedules' constructors read of a rank's two PipelineStages."""
    ranks = num_stages // 2
    local = (rank, num_stages - 1 - rank) if style == "v" else (rank, rank + ranks)
    return [
        SimpleNamespace(
            num_stages=num_stages,
            group_size=ranks,
            group_rank=rank,
            stage_index=s,
            submod=None,
            is_first=s == 0,
            is_last=s == num_stages - 1,
        )
        for s in local
    ]


def build(cls: Any, num_stages: int, m: int, rank: int, style: str) -> Any:
    return cls(stubs(num_stages, rank, style), m, loss_fn=lambda out, target: out)


@pytest.mark.parametrize("name", MULTI)
def test_a_looked_up_lowering_equals_torchs_own(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lowering, "_LOWERED", type(lowering._LOWERED)())
    spec = resolve_schedule(name)
    cached = with_cached_lowering(spec.cls)
    runs = []
    original = _PipelineScheduleRuntime._prepare_schedule_with_comms

    def counted(self: Any, actions: Any, format: Any = "compute_only") -> None:
        if isinstance(self, cached):
            runs.append(format)
        original(self, actions, format)

    monkeypatch.setattr(_PipelineScheduleRuntime, "_prepare_schedule_with_comms", counted)
    for shape, (num_stages, m) in enumerate(((4, 4), (8, 8), (8, 16))):
        for rank in range(num_stages // 2):
            torchs = build(spec.cls, num_stages, m, rank, spec.style)
            first, second = (build(cached, num_stages, m, rank, spec.style) for _ in range(2))
            # One lowering per shape: every rank lowers every rank's lists, so the first build of the
            # first rank ran torch's pass and every other build looked it up.
            assert len(runs) == shape + 1
            assert isinstance(second, spec.cls) and type(second).__name__ == spec.cls.__name__
            for built in (first, second):
                assert built.pipeline_order_with_comms == torchs.pipeline_order_with_comms
                assert built.stage_index_to_group_rank == torchs.stage_index_to_group_rank
                assert all(
                    s.stage_index_to_group_rank == torchs.stage_index_to_group_rank for s in built._stages
                )


@pytest.mark.parametrize("name", MULTI)
def test_the_lowered_lists_differ_between_the_shapes_the_lookup_tells_apart(name: str) -> None:
    spec = resolve_schedule(name)
    lists = {
        shape: build(spec.cls, *shape, 0, spec.style).pipeline_order_with_comms
        for shape in ((4, 8), (4, 12), (8, 12))
    }
    assert lists[(4, 8)] != lists[(4, 12)] != lists[(8, 12)]


def test_a_class_that_does_not_lower_is_refused() -> None:
    with pytest.raises(TypeError, match="Schedule1F1B does not lower its actions"):
        with_cached_lowering(Schedule1F1B)
