"""Re-packing a pipeline onto fewer ranks: which ranks stay, what moves, the new groups, the event.

Read in this order: :func:`repack_layouts` (the smaller pipelines a schedule can run, for the planner),
:func:`plan_repack` (check a smaller placement and work out the new rank grid),
:class:`PackedGrid` (a grid whose pipelines use only the lowest ranks of each replica),
:func:`build_repacked_groups` (the process groups of the smaller pipeline, created by their members
only) and :class:`ReleaseEvent` (what is announced). What moves is
:func:`~lightning_dynmo.pipeline.placement.layout.unit_moves` with the new grid.

Which ranks stay. Each data-parallel replica keeps its lowest pipeline positions: with 2 replicas of 4
ranks re-packed to 2 stages, ranks 0, 1 (replica 0) and 4, 5 (replica 1) stay, 2, 3, 6, 7 are released.
Global rank 0 therefore always stays: under Lightning's script launcher it is the launching process,
and the file/TCP store the process groups meet through lives there. Kept ranks keep their pipeline
position and replica, so the data-parallel groups of the kept positions are unchanged and are reused.

Pure except :func:`build_repacked_groups`: every rank computes the same plan from the same inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline.placement.layout import RankGrid, StageStyle, stage_to_pipeline_rank

log = logging.getLogger(__name__)

__all__ = [
    "PackedGrid",
    "ReleaseEvent",
    "active_ranks_of",
    "build_repacked_groups",
    "plan_repack",
    "repack_layouts",
    "schedule_runs",
]

# Schedules that split micro-batches into rounds of pipeline_size (torch checks the count divides evenly).
_ROUNDS_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
# Schedules that need at least one micro-batch per stage.
_ONE_PER_STAGE_SCHEDULES = ("1F1B", "DualPipeV")


def schedule_runs(schedule: str, pipeline_size: int, stages_per_rank: int, num_microbatches: int) -> bool:
    """Whether torch's ``schedule`` accepts ``num_microbatches`` on a pipeline of ``pipeline_size`` ranks.

    The rules torch 2.13 checks when a schedule is built: the interleaved schedules need the micro-batch
    count to be a multiple of its number of rounds (``max(1, num_microbatches // pipeline_size)``);
    1F1B and DualPipeV need at least one micro-batch per stage.
    """
    if schedule in _ROUNDS_SCHEDULES:
        rounds = max(1, num_microbatches // pipeline_size)
        return num_microbatches % rounds == 0
    if schedule in _ONE_PER_STAGE_SCHEDULES:
        return num_microbatches >= pipeline_size * stages_per_rank
    return True


def repack_layouts(
    schedule: str, style: StageStyle, pipeline_size: int, stages_per_rank: int, num_microbatches: int
) -> dict[int, list[int]]:
    """The pipelines of up to ``pipeline_size`` ranks the schedule can run: stage count -> each stage's rank.

    What the re-pack planner may propose (:func:`lightning_dynmo.balancing.repack`): a multiple of
    ``stages_per_rank`` stages (exactly two per rank for the V schedules), on a number of ranks the
    schedule accepts with ``num_microbatches``, each stage mapped to its rank as the strategy will run it.
    The current pipeline (``pipeline_size`` ranks) is included.
    """
    layouts = {}
    for ranks in range(1, pipeline_size + 1):
        if ranks < pipeline_size and not schedule_runs(schedule, ranks, stages_per_rank, num_microbatches):
            continue
        num_stages = ranks * stages_per_rank
        layouts[num_stages] = [stage_to_pipeline_rank(s, num_stages, ranks, style) for s in range(num_stages)]
    return layouts


@dataclass(frozen=True)
class PackedGrid(RankGrid):
    """A rank grid after re-packing: each replica's pipeline runs on its lowest ``pipeline_size`` ranks.

    Global rank ``g`` still belongs to replica ``g // stride`` at position ``g % stride``; only positions
    below ``pipeline_size`` are active. ``world_size`` counts the active ranks
    (``data_parallel_size * pipeline_size``).

    Args:
        world_size: Active ranks (replicas times the new pipeline size).
        pipeline_size: Ranks per pipeline after re-packing.
        stride: Ranks per replica at launch (the original pipeline size).
    """

    stride: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stride < self.pipeline_size:
            raise ValueError(
                f"stride={self.stride} must be >= pipeline_size={self.pipeline_size}: a re-packed pipeline "
                "uses a subset of its replica's original ranks."
            )

    @property
    def replica_stride(self) -> int:
        """Global ranks from one replica's first rank to the next one's: the launch pipeline size.

        A released rank has a position ``>= pipeline_size`` in its replica.
        """
        return self.stride


def active_ranks_of(grid: RankGrid) -> tuple[int, ...]:
    """Every active global rank of ``grid``, ascending (replica by replica, pipeline order)."""
    return tuple(r for replica in range(grid.data_parallel_size) for r in grid.pipeline_ranks(replica))


def plan_repack(grid: RankGrid, current: Placement, target: Placement, stages_per_rank: int) -> PackedGrid:
    """Check that ``target`` re-packs ``current`` onto fewer ranks and return the grid it runs on.

    Args:
        grid: The grid in use now (a :class:`RankGrid` or an earlier :class:`PackedGrid`).
        current: The placement in use now.
        target: The placement to re-pack onto; fewer stages than ``current``.
        stages_per_rank: Stages each rank runs (1 for GPipe/1F1B, 2 for multi-stage schedules).

    Raises:
        ValueError: if ``target`` does not have fewer stages, or its stage count is not a multiple of
            ``stages_per_rank``.
    """
    if target.num_stages >= current.num_stages:
        raise ValueError(
            f"placement {target} has {target.num_stages} stages, not fewer than the current {current} "
            f"({current.num_stages}); re-packing needs fewer stages, and released ranks cannot come back. "
            "Pass a placement with fewer '|'-separated stages, or the current number to only move layers."
        )
    if target.num_stages % stages_per_rank != 0:
        raise ValueError(
            f"placement {target} has {target.num_stages} stages, but this schedule runs {stages_per_rank} "
            f"stages per rank; give a multiple of {stages_per_rank} stages."
        )
    new_size = target.num_stages // stages_per_rank
    return PackedGrid(grid.data_parallel_size * new_size, new_size, stride=grid.replica_stride)


def build_repacked_groups(
    grid: PackedGrid, rank: int, timeout: timedelta | None, control_timeout: timedelta | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]:
    """Create this active rank's new pipeline group and the groups of all active ranks.

    Only members call ``new_group`` (``use_local_synchronization=True``), so released ranks need not
    take part; ``sort_ranks=False`` keeps pipeline order equal to group-rank order (torch's stages pair
    up by group rank). With one replica the active group is the pipeline group.

    Args:
        grid: The re-packed grid.
        rank: This (active) global rank.
        timeout: The strategy's timeout.
        control_timeout: The control group's timeout (already capped by ``timeout``).

    Returns:
        ``(pipeline_group, active_group, control_group)``.
    """
    pipeline = list(grid.pipeline_ranks(grid.data_parallel_rank(rank)))
    active = list(active_ranks_of(grid))
    kwargs = {"use_local_synchronization": True, "sort_ranks": False}
    pipeline_group = dist.new_group(pipeline, timeout=timeout, **kwargs)  # type: ignore[arg-type]
    active_group = pipeline_group
    if grid.data_parallel_size > 1:
        active_group = dist.new_group(active, timeout=timeout, **kwargs)  # type: ignore[arg-type]
    control_group = dist.new_group(active, timeout=control_timeout, **kwargs)  # type: ignore[arg-type]
    return pipeline_group, active_group, control_group


@dataclass(frozen=True)
class ReleaseEvent:
    """A re-pack that released ranks, as announced to ``on_release`` and callbacks.

    Attributes:
        released_ranks: Global ranks that left training (their processes finish ``fit`` and may be reused).
        active_ranks: Global ranks that train on.
        old_placement: Placement before the re-pack (canonical text).
        new_placement: Placement after it.
        global_step: Optimizer steps taken when it happened.
    """

    released_ranks: tuple[int, ...]
    active_ranks: tuple[int, ...]
    old_placement: str
    new_placement: str
    global_step: int

    def describe(self) -> str:
        """One readable line for logs."""
        return (
            f"DynMo re-packed the pipeline {self.old_placement} -> {self.new_placement} at step "
            f"{self.global_step}: released ranks {list(self.released_ranks)} (no longer needed for the "
            f"smaller pipeline; they leave fit), training continues on ranks {list(self.active_ranks)}."
        )
