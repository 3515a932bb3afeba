"""MicrobatchCount: which count a batch runs with, when the pipeline is rebuilt, and the re-tune checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline.step.microbatches import MicrobatchCount, retune_candidates
from lightning_dynmo.pipeline.step.schedule import resolve_schedule

TWO = Placement.from_string("0-1|2-3", num_layers=4)
ONE = Placement.from_string("0-3", num_layers=4)


def _seen(count: MicrobatchCount, batch: int) -> MicrobatchCount:
    count.new_pipeline_needed(torch.zeros(batch, 3), torch.zeros(batch), {})
    return count


def test_a_retuned_count_runs_only_the_batches_it_divides() -> None:
    count = MicrobatchCount(4)
    count.retune(8)
    assert count.for_batch(16) == 8
    assert count.for_batch(12) == 4  # 8 does not divide 12: the configured count, which does


def test_a_batch_neither_count_divides_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"a batch of 6 samples cannot be cut into num_microbatches=4"):
        MicrobatchCount(4).for_batch(6)


def test_the_pipeline_is_rebuilt_when_the_count_or_the_shapes_change() -> None:
    count = MicrobatchCount(4)
    x, y = torch.zeros(8, 3), torch.zeros(8)
    assert not count.new_pipeline_needed(x, y, {})  # the first batch: the pipeline was built for it
    assert not count.new_pipeline_needed(x, y, {})
    assert count.new_pipeline_needed(torch.zeros(12, 3), torch.zeros(12), {})  # same count, other shapes
    count.retune(2)
    count.batch_shape = None  # the strategy rebuilt its pipeline with the re-tuned count
    assert (count.current, count.new_pipeline_needed(x, y, {})) == (2, False)
    assert count.new_pipeline_needed(torch.zeros(6, 3), torch.zeros(6), {})  # 2 divides 6: shapes changed
    count.retune(8)
    count.batch_shape = None
    assert not count.new_pipeline_needed(x, y, {})
    # 8 does not divide 12: the configured 4 runs it, another count, so the pipeline is rebuilt for it
    assert (count.new_pipeline_needed(torch.zeros(12, 3), torch.zeros(12), {}), count.current) == (True, 4)


def test_a_valid_retune_passes_the_checks() -> None:
    _seen(MicrobatchCount(4), 8).check_retune(2, resolve_schedule("1F1B"), ONE, TWO)
    MicrobatchCount(4).check_retune(None, resolve_schedule("1F1B"), TWO, TWO)  # no re-tune: nothing to check


@pytest.mark.parametrize(
    ("count", "target", "schedule", "match"),
    [
        (3, ONE, "1F1B", r"num_microbatches=3 does not divide the batch of 8 samples.*\[1, 2, 4, 8\]"),
        (2, TWO, "1F1B", r"num_microbatches=2 was passed with placement 0-1\|2-3.*only with a re-pack"),
        (0, ONE, "1F1B", r"num_microbatches=0 must be an integer >= 1"),
        (True, ONE, "1F1B", r"num_microbatches=True must be an integer >= 1"),
        (2.0, ONE, "1F1B", r"num_microbatches=2.0 must be an integer >= 1"),
    ],
)
def test_bad_retunes_are_rejected(count: Any, target: Placement, schedule: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _seen(MicrobatchCount(4), 8).check_retune(count, resolve_schedule(schedule), target, TWO)


def test_a_count_the_schedule_rejects_is_rejected() -> None:
    # DualPipeV runs two stages per rank and needs a micro-batch per stage: 1 is too few for 2 stages.
    four = Placement.from_string("0|1|2|3", num_layers=4)
    with pytest.raises(
        ValueError, match=r"num_microbatches=1 is rejected by schedule 'DualPipeV' on 1 ranks"
    ):
        _seen(MicrobatchCount(8), 8).check_retune(1, resolve_schedule("DualPipeV"), TWO, four)


def test_candidates_divide_the_batch_and_run_on_the_schedule() -> None:
    assert retune_candidates(resolve_schedule("1F1B"), 2, 8) == [2, 4, 8]
    assert retune_candidates(resolve_schedule("GPipe"), 1, 12) == [1, 2, 3, 4, 6, 12]
