"""PipelineView: what callbacks read of a running pipeline, one typed snapshot instead of strategy properties.

:meth:`DynMoStrategy.pipeline_view <lightning_dynmo.strategy.DynMoStrategy.pipeline_view>` builds one; a
migration or a re-pack changes the pipeline, so a callback takes a fresh view after it (views are cheap:
references, no copies). What the strategy *does* (apply a placement, broadcast, guard a collective, rebuild
the pipeline) stays on the strategy; the view only describes, and hands over the batch boundary's SIGTERM
agreement so that the callback's per-step exchange can carry it (one collective per step, not two). Derived
facts a balancer needs (which rank runs each stage, which smaller pipelines a re-pack may build, the layout a
checkpoint records) are answered here, where the schedule is known, rather than re-derived by each reader.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.policy import pipeline_layout
from lightning_dynmo.pipeline import SigtermAgreement, repack_layouts, stage_to_pipeline_rank
from lightning_dynmo.pipeline.step.schedule import ScheduleSpec
from lightning_dynmo.strategy.state import PipelineState, RankState

if TYPE_CHECKING:
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

__all__ = ["PipelineView"]


@dataclass(frozen=True, kw_only=True)
class PipelineView:
    """One rank's view of its pipeline at one moment.

    Attributes:
        placement: The current placement (layers per stage).
        schedule: The resolved pipeline schedule (name, stages per rank, stage-to-rank style).
        num_microbatches: Micro-batches per training step.
        pipeline_size: Ranks per pipeline.
        stage_index: This rank's position in its pipeline; ``None`` once a re-pack released it.
        stage_indices: The placement stages this rank runs (one, or two virtual stages).
        is_first_stage: Whether this rank runs stage 0.
        is_released: Whether a re-pack released this rank.
        global_rank: This process's global rank.
        active_ranks: The global ranks still training, in order; collectives run over them.
        pipeline_rank_of: An active global rank -> its position in its pipeline.
        local_layers: The blocks this rank holds, by global index.
        pipeline_stages: This rank's torch ``PipelineStage`` objects (empty once released).
        root_device: This rank's device.
        pipeline_group: The process group of this rank's pipeline.
        active_group: The process group over ``active_ranks`` (``None`` once released).
        control_group: The same ranks with DynMo's control timeout: the callback's agreements run on it
            (``None`` once released).
        data_parallel_group: The group of the replicas of this rank's stage (``None`` without replicas).
        data_parallel_size: Number of pipeline replicas.
        has_tied_parameters: Whether the first and last parts share a parameter (a tied embedding).
        sigterm: The strategy's batch-boundary SIGTERM agreement: a per-step exchange over the active ranks
            carries its :attr:`~lightning_dynmo.pipeline.SigtermAgreement.flag` and settles it (``None``:
            nothing to carry).
    """

    placement: Placement
    schedule: ScheduleSpec
    num_microbatches: int
    pipeline_size: int
    stage_index: int | None
    stage_indices: tuple[int, ...]
    is_first_stage: bool
    is_released: bool
    global_rank: int
    active_ranks: tuple[int, ...]
    pipeline_rank_of: Callable[[int], int]
    local_layers: Mapping[int, nn.Module]
    pipeline_stages: list[Any]
    root_device: torch.device
    pipeline_group: dist.ProcessGroup | None
    active_group: dist.ProcessGroup | None
    control_group: dist.ProcessGroup | None
    data_parallel_group: dist.ProcessGroup | None
    data_parallel_size: int
    has_tied_parameters: bool
    sigterm: SigtermAgreement | None = None

    @classmethod
    def of(cls, strategy: DynMoStrategy, ranks: RankState, pipeline: PipelineState) -> PipelineView:
        """The view of ``strategy``'s pipeline now (its public properties and its state objects)."""
        same_name = (
            "placement", "num_microbatches", "pipeline_size", "stage_index", "stage_indices",
            "is_first_stage", "is_released", "global_rank", "active_ranks", "pipeline_rank_of",
            "pipeline_stages", "root_device", "pipeline_group", "active_group", "data_parallel_group",
            "data_parallel_size",
        )  # fmt: skip
        return cls(
            schedule=pipeline.schedule,
            control_group=ranks.control_group,
            local_layers=strategy.local_layers if strategy.stage_index is not None else {},
            has_tied_parameters=bool(strategy.tied_parameters),
            sigterm=ranks.sigterm,
            **{name: getattr(strategy, name) for name in same_name},
        )

    @property
    def schedule_name(self) -> str:
        """The canonical schedule name."""
        return self.schedule.name

    @property
    def num_stages(self) -> int:
        """Placement stages (``pipeline_size`` times the stages each rank runs)."""
        return self.placement.num_stages

    @property
    def stage_style(self) -> str:
        """How placement stages map to pipeline ranks: ``"loop"`` (stage ``s`` on rank ``s % p``) or
        ``"v"`` (ZBV, DualPipeV: rank ``r`` runs stages ``r`` and ``2p - 1 - r``)."""
        return self.schedule.style

    @property
    def layout(self) -> dict[str, Any]:
        """The pipeline a checkpointed placement is for (see :func:`~.balancing.policy.resume_plan`)."""
        return pipeline_layout(self.schedule_name, self.pipeline_size, self.num_stages)

    def stage_workers(self, placement: Placement) -> list[int] | None:
        """The pipeline rank of every stage of ``placement`` when ranks run several stages, else ``None``."""
        if placement.num_stages == self.pipeline_size:
            return None
        return [
            stage_to_pipeline_rank(s, placement.num_stages, self.pipeline_size, self.schedule.style)
            for s in range(placement.num_stages)
        ]

    def repack_layouts(self) -> dict[int, list[int]] | None:
        """The pipelines a re-pack may propose when ranks run several stages (``None``: any stage count)."""
        stages_per_rank = self.num_stages // self.pipeline_size
        if stages_per_rank == 1:
            return None
        return repack_layouts(
            self.schedule_name,
            self.schedule.style,
            self.pipeline_size,
            stages_per_rank,
            self.num_microbatches,
        )
