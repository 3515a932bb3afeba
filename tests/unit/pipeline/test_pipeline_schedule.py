"""Schedule names resolve to torch's classes with the right stages per rank and stage layout."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV, ScheduleInterleavedZeroBubble

from lightning_dynmo.pipeline.step.schedule import SCHEDULE_NAMES, resolve_schedule


def test_names_resolve_case_insensitively() -> None:
    spec = resolve_schedule("1f1b")
    assert (spec.name, spec.cls, spec.stages_per_rank, spec.style) == ("1F1B", Schedule1F1B, 1, "loop")
    assert resolve_schedule("interleavedzerobubble").cls is ScheduleInterleavedZeroBubble
    dual = resolve_schedule("DualPipeV")
    assert (dual.cls, dual.stages_per_rank, dual.style) == (ScheduleDualPipeV, 2, "v")


def test_every_listed_schedule_resolves() -> None:
    assert {resolve_schedule(n).stages_per_rank for n in SCHEDULE_NAMES} == {1, 2}


def test_unknown_schedule_lists_the_names() -> None:
    with pytest.raises(
        ValueError, match=r"schedule='PipeDream' is not a pipeline schedule; use one of \['GPipe'"
    ):
        resolve_schedule("PipeDream")
