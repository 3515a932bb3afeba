"""The state of a running :class:`~lightning_dynmo.DynMoStrategy`, in two typed objects it owns.

The strategy's modules share one run's state: a re-pack (:mod:`.replacement`) narrows the ranks that the
collectives (:mod:`.collectives`) and the steps (:mod:`.steps`) run over, and a migration changes the
placement that errors (:mod:`.connection`) and checkpoints (:mod:`.checkpointing`) describe. So the state
lives in these objects, the strategy holds one of each, and it passes them to a module's function
explicitly: a signature says what the function reads and writes, and no module reaches into the strategy.

- :class:`RankState`: who trains and over which process groups (filled by
  :func:`~lightning_dynmo.strategy.connection.connect`; a re-pack narrows it, a release empties it).
- :class:`PipelineState`: what this rank runs (the model's spec, the placement, the built pipeline, the
  tied copies, the micro-batch count, the schedule).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline import (
    BuiltPipeline,
    FailureBoard,
    MicrobatchCount,
    ModelSpec,
    PipelineEvaluator,
    PipelineLossScaling,
    RankGrid,
    SigtermAgreement,
    StallWatch,
    TiedCopies,
    pipeline_units,
)
from lightning_dynmo.pipeline.placement.groups import GridGroups
from lightning_dynmo.pipeline.sharding import StageSharding
from lightning_dynmo.pipeline.step.boundaries import BoundaryRecorder
from lightning_dynmo.pipeline.step.schedule import ScheduleSpec
from lightning_dynmo.strategy.args import DataParallelSharding

__all__ = ["PipelineState", "RankState", "module_of", "trainer_of"]

_CPU = torch.device("cpu")


def _no_group() -> None:
    return None


@dataclass(kw_only=True)
class RankState:
    """The ranks of the run and the process groups over them, as this rank sees them.

    Attributes:
        timeout: Every process group's timeout (``DynMoStrategy(timeout=...)``).
        control_timeout: The control group's timeout (DynMo's own agreements).
        grid: The ``data_parallel x pipeline`` grid (set when the Trainer sets the ranks; a re-pack
            replaces it with the smaller grid).
        active_ranks: The global ranks taking part in training, in order.
        active_group: The group over ``active_ranks``; the strategy's collectives run over it.
        control_group: The same ranks with ``control_timeout``.
        pipeline_group: This rank's pipeline, ranks in pipeline order.
        data_parallel_group: The replicas of this rank's stage (``None`` without data parallelism).
        board: The run's failure board (``None`` before the processes connect).
        watch: Posts the call this rank stalls in (``None`` before the processes connect).
        sigterm: The batch-boundary SIGTERM agreement (:mod:`.sigterm`).
        released: Whether a re-pack released this rank (its groups are then ``None``).
    """

    timeout: timedelta | None
    control_timeout: timedelta | None
    grid: RankGrid | None = None
    active_ranks: tuple[int, ...] = ()
    active_group: dist.ProcessGroup | None = None
    control_group: dist.ProcessGroup | None = None
    pipeline_group: dist.ProcessGroup | None = None
    data_parallel_group: dist.ProcessGroup | None = None
    board: FailureBoard | None = None
    watch: StallWatch | None = None
    sigterm: SigtermAgreement = field(default_factory=SigtermAgreement)
    released: bool = False

    def require_grid(self) -> RankGrid:
        """The grid; raises before the Trainer has set up the processes."""
        if self.grid is None:
            raise RuntimeError(
                "DynMoStrategy's rank layout is only known once the Trainer has set up the processes."
            )
        return self.grid

    def use_groups(self, groups: GridGroups) -> None:
        """Take the groups that :func:`~lightning_dynmo.pipeline.build_groups` made for this rank."""
        self.active_group, self.pipeline_group = groups.active, groups.pipeline
        self.data_parallel_group, self.control_group = groups.data_parallel, groups.control

    def release(self) -> None:
        """This rank left the run (a re-pack released it): it shares no group any more."""
        self.pipeline_group = self.active_group = self.data_parallel_group = self.control_group = None
        self.released = True


@dataclass(kw_only=True)
class PipelineState:
    """What this rank runs of the pipeline.

    Attributes:
        schedule: The resolved schedule (name, stages per rank, stage-to-rank style).
        microbatches: The configured, re-tuned and current micro-batch counts.
        spec: The model's contract, checked at setup (``None`` before).
        placement: The current placement (``None`` before setup).
        pipe: The built stages and schedule of this rank (``None`` before setup and once released).
        ties: The first/last-part parameter ties and, when the two parts are on different ranks, which
            rank holds the other copy.
        evaluator: The forward-only pipeline of validation, test and predict (built on first use).
        cut_module: The module that setup cut to this rank's units (a later ``Trainer.validate`` keeps it).
        step_in_flight: Between a training step and its ``backward`` (a placement change then is refused).
        loss_scaling: The precision plugin's loss scaling, applied inside the pipeline (set at setup).
        recompute: ``DynMoStrategy(activation_checkpointing=...)``: stages recompute each block's forward.
        compile_options: ``DynMoStrategy(compile_blocks=...)`` as ``torch.compile``'s keyword arguments
            (``None``: blocks are not compiled).
        data_parallel_sharding: ``DynMoStrategy(data_parallel_sharding=...)``: ``"replicate"`` or ``"fsdp"``.
        sharding: Under ``"fsdp"``, how this rank's units are sharded (its stage's data-parallel mesh and the
            precision's policy; set at setup); ``None`` while every replica holds whole stages.
        boundaries: What crossed each layer boundary in the last metadata pass of torch's stages (a
            migration builds its stages from it: :mod:`lightning_dynmo.pipeline.step.boundaries`).
    """

    schedule: ScheduleSpec
    microbatches: MicrobatchCount
    recompute: bool = False
    compile_options: Mapping[str, Any] | None = None
    data_parallel_sharding: DataParallelSharding = "replicate"
    sharding: StageSharding | None = None
    spec: ModelSpec | None = None
    placement: Placement | None = None
    pipe: BuiltPipeline | None = None
    ties: TiedCopies = field(default_factory=TiedCopies)
    evaluator: PipelineEvaluator | None = None
    cut_module: nn.Module | None = None
    step_in_flight: bool = False
    loss_scaling: PipelineLossScaling = field(
        default_factory=lambda: PipelineLossScaling(None, _no_group, _CPU)
    )
    boundaries: BoundaryRecorder = field(default_factory=BoundaryRecorder)

    def require_spec(self) -> ModelSpec:
        """The model's spec; raises before setup."""
        if self.spec is None:
            raise RuntimeError("DynMoStrategy has not checked the model yet; this is known after setup().")
        return self.spec

    def require_pipe(self) -> BuiltPipeline:
        """The built pipeline; raises before setup."""
        if self.pipe is None:
            raise RuntimeError("DynMoStrategy has no pipeline yet; it is built in setup().")
        return self.pipe

    def require_placement(self) -> Placement:
        """The current placement; raises before setup."""
        if self.placement is None:
            raise RuntimeError("DynMoStrategy.placement is only known after Trainer.fit set up the model.")
        return self.placement

    def num_stages(self, pipeline_size: int) -> int:
        """Placement stages of a pipeline of ``pipeline_size`` ranks under this schedule."""
        return pipeline_size * self.schedule.stages_per_rank

    def local_units(self, module: nn.Module) -> dict[str, nn.Module]:
        """The units (blocks, first and last parts) ``module`` holds, by name."""
        return pipeline_units(module, self.require_spec())


def module_of(strategy: pl.strategies.Strategy) -> pl.LightningModule:
    """``strategy``'s LightningModule; raises outside a Trainer call."""
    module = strategy.lightning_module
    if module is None:
        raise RuntimeError("DynMoStrategy has no LightningModule yet; call it from within Trainer.fit.")
    return module


def trainer_of(strategy: pl.strategies.Strategy) -> pl.Trainer | None:
    """The Trainer ``strategy``'s LightningModule is attached to (``None``: none yet)."""
    module = strategy.lightning_module
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None
