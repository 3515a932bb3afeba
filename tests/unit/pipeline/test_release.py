"""Re-pack planning: which ranks stay, what moves, and bad re-pack placements."""

from __future__ import annotations

import pytest

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline.placement.layout import PlannedMove, RankGrid, unit_moves
from lightning_dynmo.pipeline.placement.release import (
    PackedGrid,
    ReleaseEvent,
    active_ranks_of,
    plan_repack,
)


def test_each_replica_keeps_its_lowest_ranks_and_rank_zero_stays() -> None:
    grid = RankGrid(world_size=8, pipeline_size=4)
    packed = plan_repack(grid, Placement.from_string("0-1|2-3|4-5|6-7"), Placement.from_string("0-3|4-7"), 1)
    assert packed == PackedGrid(world_size=4, pipeline_size=2, stride=4)
    assert active_ranks_of(packed) == (0, 1, 4, 5)
    assert packed.pipeline_ranks(1) == (4, 5)
    assert packed.data_parallel_ranks(1) == grid.data_parallel_ranks(1) == (1, 5)  # dp groups reusable
    assert [packed.data_parallel_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_repacking_twice_keeps_the_launch_stride() -> None:
    grid = RankGrid(world_size=4, pipeline_size=4)
    three = plan_repack(grid, Placement.from_sizes([1, 1, 1, 1]), Placement.from_sizes([2, 1, 1]), 1)
    two = plan_repack(three, Placement.from_sizes([2, 1, 1]), Placement.from_sizes([2, 2]), 1)
    assert (three.stride, two.stride, active_ranks_of(two)) == (4, 4, (0, 1))


def test_repack_moves_send_every_unit_of_released_ranks_to_kept_ones() -> None:
    old, new = Placement.from_string("0-1|2-3|4-5|6-7"), Placement.from_string("0-2|3-7")
    grid = RankGrid(world_size=4, pipeline_size=4)
    packed = plan_repack(grid, old, new, 1)
    moves = unit_moves(old, new, grid, "loop", ("embed",), ("head",), new_grid=packed)
    assert moves == [
        PlannedMove("layers.2", 1, 0),
        PlannedMove("layers.4", 2, 1),
        PlannedMove("layers.5", 2, 1),
        PlannedMove("layers.6", 3, 1),
        PlannedMove("layers.7", 3, 1),
        PlannedMove("head", 3, 1),
    ]


def test_repack_moves_are_listed_replica_by_replica() -> None:
    old, new = Placement.from_string("0-1|2-3"), Placement.from_string("0-3")
    grid = RankGrid(world_size=4, pipeline_size=2)
    moves = unit_moves(old, new, grid, "loop", new_grid=plan_repack(grid, old, new, 1))
    assert moves == [PlannedMove(f"layers.{i}", 1, 0) for i in (2, 3)] + [
        PlannedMove(f"layers.{i}", 3, 2) for i in (2, 3)
    ]


def test_a_repack_must_have_fewer_stages() -> None:
    grid = RankGrid(world_size=2, pipeline_size=2)
    with pytest.raises(ValueError, match=r"has 3 stages, not fewer than the current 0-1\|2-3 \(2\)"):
        plan_repack(grid, Placement.from_string("0-1|2-3"), Placement.from_string("0-0|1-1|2-3"), 1)


def test_a_repack_must_fit_the_stages_per_rank_of_the_schedule() -> None:
    grid = RankGrid(world_size=2, pipeline_size=2)
    current = Placement.from_sizes([1, 1, 1, 1])
    with pytest.raises(ValueError, match="runs 2 stages per rank; give a multiple of 2 stages"):
        plan_repack(grid, current, Placement.from_sizes([2, 1, 1]), 2)


def test_repack_moves_reject_a_different_model() -> None:
    grid = RankGrid(world_size=2, pipeline_size=2)
    with pytest.raises(ValueError, match="the layers and the replica count must stay the same"):
        unit_moves(Placement.from_sizes([2, 2]), Placement.from_sizes([5]), grid, "loop", new_grid=grid)


def test_packed_grid_needs_a_stride_at_least_the_pipeline_size() -> None:
    with pytest.raises(ValueError, match="stride=1 must be >= pipeline_size=2"):
        PackedGrid(world_size=2, pipeline_size=2, stride=1)


def test_release_event_describes_who_left_and_who_stays() -> None:
    event = ReleaseEvent((2, 3), (0, 1), "0-1|2-3|4-5|6-7", "0-3|4-7", global_step=5)
    text = event.describe()
    assert "released ranks [2, 3]" in text and "continues on ranks [0, 1]" in text and "step 5" in text


def test_repack_layouts_are_the_pipelines_the_schedule_can_run() -> None:
    from lightning_dynmo.pipeline.placement.release import repack_layouts, schedule_runs

    assert repack_layouts("ZBVZeroBubble", "v", 2, 2, 4) == {2: [0, 0], 4: [0, 1, 1, 0]}
    assert repack_layouts("Interleaved1F1B", "loop", 3, 2, 6) == {
        2: [0, 0],
        4: [0, 1, 0, 1],
        6: [0, 1, 2, 0, 1, 2],
    }
    # 9 micro-batches: 4 rounds on 2 ranks (9 % 4 != 0: torch refuses), 3 on 3 ranks, 9 on 1 rank.
    assert list(repack_layouts("InterleavedZeroBubble", "loop", 3, 2, 9)) == [2, 6]
    assert not schedule_runs("Interleaved1F1B", 2, 2, 9) and schedule_runs("Interleaved1F1B", 3, 2, 9)
    assert not schedule_runs("DualPipeV", 2, 2, 3) and schedule_runs("DualPipeV", 1, 2, 3)
    assert schedule_runs("GPipe", 8, 1, 1)
