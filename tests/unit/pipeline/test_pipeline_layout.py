"""Rank grid, stage -> rank maps, unit ownership and moves, initial placement resolution."""

from __future__ import annotations

import pytest

from lightning_dynmo.balancing import Placement
from lightning_dynmo.pipeline.placement.layout import (
    PlannedMove,
    RankGrid,
    initial_placement,
    stage_to_pipeline_rank,
    stages_of_pipeline_rank,
    unit_moves,
    unit_owners,
)

FIRST, LAST = ("tok_emb",), ("head",)


def test_rank_grid_puts_each_pipeline_on_contiguous_ranks() -> None:
    grid = RankGrid(world_size=6, pipeline_size=3)
    assert grid.data_parallel_size == 2
    assert grid.pipeline_ranks(1) == (3, 4, 5)
    assert grid.data_parallel_ranks(2) == (2, 5)
    assert [(grid.data_parallel_rank(g), grid.pipeline_rank(g)) for g in range(6)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert all(grid.global_rank(grid.data_parallel_rank(g), grid.pipeline_rank(g)) == g for g in range(6))


def test_pipeline_size_must_divide_world_size() -> None:
    with pytest.raises(
        ValueError, match=r"pipeline_size=4 does not divide the world size 6.*divisors \[1, 2, 3, 6\]"
    ):
        RankGrid(world_size=6, pipeline_size=4)


def test_loop_and_v_stage_maps_match_torch() -> None:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for pp, stages in ((2, 4), (4, 8), (3, 6), (2, 6)):
        loop = generate_stage_to_rank_mapping(pp, stages, style="loop")
        assert [stage_to_pipeline_rank(s, stages, pp, "loop") for s in range(stages)] == [
            loop[s] for s in range(stages)
        ]
    for pp in (1, 2, 4):
        v = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        assert [stage_to_pipeline_rank(s, 2 * pp, pp, "v") for s in range(2 * pp)] == [
            v[s] for s in range(2 * pp)
        ]
    assert stages_of_pipeline_rank(0, 4, 2, "v") == (0, 3)


def test_unit_owners_follow_stages_and_replicas() -> None:
    grid = RankGrid(world_size=4, pipeline_size=2)
    owners = unit_owners(Placement.from_string("0-0|1-2"), grid, "loop", FIRST, LAST)
    assert owners[(0, "tok_emb")] == 0 and owners[(1, "tok_emb")] == 2
    assert owners[(0, "layers.2")] == 1 and owners[(1, "layers.2")] == 3
    assert owners[(1, "head")] == 3


def test_unit_moves_list_every_changed_owner_in_model_order() -> None:
    grid = RankGrid(world_size=4, pipeline_size=4)
    old, new = Placement.from_string("0-1|2-3|4-5|6-7"), Placement.from_string("0-0|1-1|2-2|3-7")
    moves = unit_moves(old, new, grid, "loop", FIRST, LAST)
    assert moves == [
        PlannedMove("layers.1", 0, 1),
        PlannedMove("layers.2", 1, 2),
        PlannedMove("layers.3", 1, 3),
        PlannedMove("layers.4", 2, 3),
        PlannedMove("layers.5", 2, 3),
    ]
    assert unit_moves(old, old, grid, "loop", FIRST, LAST) == []


def test_v_style_keeps_first_and_last_parts_on_rank_zero() -> None:
    grid = RankGrid(world_size=2, pipeline_size=2)
    old, new = Placement.from_string("0|1|2|3-4"), Placement.from_string("0-1|2|3|4")
    owners = unit_owners(new, grid, "v", FIRST, LAST)
    assert owners[(0, "tok_emb")] == owners[(0, "head")] == 0
    assert unit_moves(old, new, grid, "v", FIRST, LAST) == [
        PlannedMove("layers.1", 1, 0),
        PlannedMove("layers.3", 0, 1),
    ]


def test_unit_moves_reject_placements_of_different_models() -> None:
    grid = RankGrid(world_size=2, pipeline_size=2)
    with pytest.raises(ValueError, match=r"covers 5 layers but the current placement 0-1\|2-3 covers 4"):
        unit_moves(Placement.from_string("0-1|2-3"), Placement.from_string("0-1|2-4"), grid, "loop")


def test_initial_placement_policies() -> None:
    assert str(initial_placement("uniform", 7, 3)) == "0-2|3-4|5-6"
    assert str(initial_placement("0-0|1-3", 4, 2)) == "0-0|1-3"
    assert initial_placement(Placement.from_sizes([1, 3]), 4, 2) == Placement.from_sizes([1, 3])
    assert str(initial_placement("parameters", 4, 2, [10, 10, 10, 30])) == "0-2|3-3"


def test_initial_placement_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="4 pipeline stages but the model has only 3 layers"):
        initial_placement("uniform", 3, 4)


def test_initial_placement_string_must_cover_the_model() -> None:
    with pytest.raises(ValueError, match="covers 3 layers but the model has 4"):
        initial_placement("0-1|2-2", 4, 2)


def test_initial_placement_needs_one_range_per_stage() -> None:
    with pytest.raises(ValueError, match="has 3 stages but this run has 2"):
        initial_placement(Placement.from_string("0|1|2-3"), 4, 2)
