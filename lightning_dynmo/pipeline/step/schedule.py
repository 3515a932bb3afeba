"""Build this rank's pipeline: stage modules, torch ``PipelineStage`` objects and one schedule.

Read in this order: :func:`resolve_schedule` (a schedule name -> class, stages per rank and stage
layout), :func:`build_pipeline` (everything one rank needs for a placement: one
:class:`~lightning_dynmo.pipeline.step.stage.StageModule` per stage, torch ``PipelineStage`` objects and a
schedule) and :func:`run_schedule_step` (one forward + backward over all micro-batches).

Building is cheap (about a millisecond once the schedule's lowering is known: :mod:`.lowering`), so after
a migration or a batch-shape change the whole pipeline is rebuilt instead of being patched in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
    get_schedule_class,
)

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline.model.contract import ModelSpec
from lightning_dynmo.pipeline.placement.layout import StageStyle, stages_of_pipeline_rank
from lightning_dynmo.pipeline.step.aux_loss import AuxLossRecord, collect_aux_losses
from lightning_dynmo.pipeline.step.boundaries import BoundaryRecorder, StageTensors
from lightning_dynmo.pipeline.step.gradless import guard_gradless_inputs
from lightning_dynmo.pipeline.step.lowering import with_cached_lowering
from lightning_dynmo.pipeline.step.stage import PipelineLoss, StageModule, guard_shape_inference

log = logging.getLogger(__name__)

#: The schedule names DynMo accepts (torch's names, matched case-insensitively).
SCHEDULE_NAMES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
_V_STYLE = (ScheduleZBVZeroBubble, ScheduleDualPipeV)


@dataclass(frozen=True)
class ScheduleSpec:
    """A resolved schedule name.

    Attributes:
        name: The canonical name (one of :data:`SCHEDULE_NAMES`).
        cls: torch's schedule class.
        stages_per_rank: 1 for single-stage schedules (GPipe, 1F1B), 2 for multi-stage ones: a
            placement then has ``pipeline_size * 2`` (virtual) stages.
        style: How stages map onto ranks (:func:`~lightning_dynmo.pipeline.stage_to_pipeline_rank`).
    """

    name: str
    cls: type[_PipelineSchedule]
    stages_per_rank: int
    style: StageStyle


def resolve_schedule(name: str) -> ScheduleSpec:
    """Resolve a schedule name, case-insensitively.

    Raises:
        ValueError: if ``name`` is not one of :data:`SCHEDULE_NAMES`.
    """
    canonical = {n.lower(): n for n in SCHEDULE_NAMES}.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"schedule={name!r} is not a pipeline schedule; use one of {list(SCHEDULE_NAMES)}.")
    cls = get_schedule_class(canonical)
    multi = issubclass(cls, PipelineScheduleMulti)
    style: StageStyle = "v" if issubclass(cls, _V_STYLE) else "loop"
    return ScheduleSpec(canonical, cls, 2 if multi else 1, style)


@dataclass
class BuiltPipeline:
    """One rank's share of a pipeline for one placement.

    Attributes:
        stage_indices: The placement stages this rank runs, in increasing order.
        modules: One :class:`StageModule` per stage index.
        schedule: The torch schedule driving them.
        has_first: Whether this rank runs stage 0 (it feeds the inputs).
        has_last: Whether this rank runs the last stage (it computes the loss).
        num_microbatches: Micro-batches per step (the schedule's, which gradients are averaged over).
    """

    stage_indices: tuple[int, ...]
    modules: list[StageModule]
    schedule: _PipelineSchedule
    has_first: bool
    has_last: bool
    num_microbatches: int

    @property
    def stages(self) -> list[Any]:
        """The torch ``PipelineStage`` objects of :attr:`schedule` (one, or one per virtual stage)."""
        stages = getattr(self.schedule, "_stages", None)  # multi-stage schedules
        if stages is None:
            stages = [self.schedule._stage]  # type: ignore[attr-defined]  # single-stage schedules
        return list(stages)


def build_pipeline(
    model: nn.Module,
    spec: ModelSpec,
    placement: Placement,
    schedule: ScheduleSpec,
    *,
    pipeline_rank: int,
    pipeline_size: int,
    num_microbatches: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
    recompute: bool = False,
    prepare_stage: Callable[[nn.Module], object] | None = None,
    recorder: BoundaryRecorder | None = None,
    stage_tensors: Mapping[int, StageTensors] | None = None,
) -> BuiltPipeline:
    """Build this rank's stages and schedule for ``placement``.

    The model must already hold exactly the units this rank owns under ``placement``. ``recompute``:
    activation checkpointing of every block (:mod:`lightning_dynmo.pipeline.step.recompute`).
    ``prepare_stage``: called on each new :class:`StageModule` before torch's ``PipelineStage`` wraps it
    (a sharded run makes it the FSDP root there:
    :meth:`lightning_dynmo.pipeline.sharding.StageSharding.shard_stage`). ``recorder``: keeps what
    crosses each layer boundary when torch's metadata pass runs (:mod:`.boundaries`).
    ``stage_tensors``: every local stage's inputs and outputs
    (:func:`~lightning_dynmo.pipeline.step.boundaries.stage_metadata`): torch's stages are given them
    and skip that pass.

    Raises:
        ValueError: if the schedule rejects ``num_microbatches`` (the message says which counts work).
    """
    indices = stages_of_pipeline_rank(pipeline_rank, placement.num_stages, pipeline_size, schedule.style)
    last_stage = placement.num_stages - 1
    known = stage_tensors or {}
    modules = [
        StageModule(
            model,
            spec,
            placement.layers_of(s),
            s == 0,
            s == last_stage,
            recompute,
            recorder=recorder,
            expected_outputs=known[s].outputs if s in known else None,
        )
        for s in indices
    ]
    if prepare_stage is not None:
        for module in modules:
            prepare_stage(module)
    stages = []
    for m, s in zip(modules, indices, strict=True):
        inputs, outputs = known[s].examples() if s in known else (None, None)
        stages.append(
            PipelineStage(
                m, s, placement.num_stages, device, input_args=inputs, output_args=outputs, group=group
            )
        )
    for stage, module in zip(stages, modules, strict=True):
        guard_shape_inference(stage, module)
        guard_gradless_inputs(stage)  # behind a frozen prefix (see pipeline/gradless.py)
    loss_fn = next((m.loss for m in modules if m.loss is not None), None) or checked_loss_fn(model)
    # torch divides each stage's gradients by the micro-batch count; a parameter two local stages share
    # (a tied embedding under a V schedule) would be divided twice. run_schedule_step divides once.
    kwargs = {"n_microbatches": num_microbatches, "loss_fn": loss_fn, "scale_grads": False}
    try:
        if schedule.stages_per_rank == 1:
            built = schedule.cls(stages[0], **kwargs)  # type: ignore[arg-type]
        else:  # a rebuild after a migration lowers the same lists: looked up (.lowering)
            built = with_cached_lowering(schedule.cls)(stages, **kwargs)
    except ValueError as err:
        raise ValueError(
            f"num_microbatches={num_microbatches} is rejected by schedule {schedule.name!r} with "
            f"{placement.num_stages} stages over {pipeline_size} ranks: {err} Pick a num_microbatches the "
            "schedule accepts (1F1B and DualPipeV need at least one per stage)."
        ) from err
    _check_stage_map(built, schedule, placement, pipeline_size)
    return BuiltPipeline(indices, modules, built, 0 in indices, last_stage in indices, num_microbatches)


def _check_stage_map(built: Any, schedule: ScheduleSpec, placement: Placement, pipeline_size: int) -> None:
    # Our stage -> rank layout must be the one the schedule itself assumes, or p2p pairs up wrongly.
    mapping = getattr(built, "stage_index_to_group_rank", None)
    if mapping is None:
        return
    for s in range(placement.num_stages):
        expected = stages_of_pipeline_rank(mapping[s], placement.num_stages, pipeline_size, schedule.style)
        assert s in expected, f"schedule {schedule.name} maps stage {s} to rank {mapping[s]}, not ours"


def checked_loss_fn(model: nn.Module) -> PipelineLoss:
    """``model.pipeline_loss``, checked to return a scalar on the gradient path (see ``check_loss``)."""
    return PipelineLoss(model)


@dataclass(frozen=True)
class StepResult:
    """What one schedule step leaves on this rank.

    Attributes:
        losses: The per-micro-batch main losses on the rank running the last stage, ``[]`` elsewhere.
        aux: The auxiliary losses this rank's blocks and parts added, over all micro-batches.
    """

    losses: list[Tensor]
    aux: AuxLossRecord


def run_schedule_step(
    pipe: BuiltPipeline,
    inputs: Tensor | None,
    target: Tensor | None,
    side_inputs: Mapping[str, Tensor] | None = None,
    *,
    aux_losses: Sequence[str] = (),
    aux_loss_scale: float = 1.0,
    model_name: str = "the model",
    average_grads: bool = True,
) -> StepResult:
    """Run one schedule step (forward and backward of every micro-batch) on this rank.

    The stage parameters' ``.grad`` must be empty (``None``) before; afterwards it holds the step's
    gradients averaged over micro-batches (the loss is a mean per micro-batch; each micro-batch's
    auxiliary losses count with it), each parameter divided once even when several local stages share it.
    With ``average_grads=False`` it holds their sum: the caller divides by ``pipe.num_microbatches``
    itself (the training step folds that into the pass that carries the gradients into backward).

    Args:
        pipe: This rank's pipeline.
        inputs: The batch's first-stage input (used on the rank running stage 0).
        target: The batch's target (used on the rank running the last stage).
        side_inputs: The batch's side inputs, passed to every local stage (cut into micro-batches).
        aux_losses: The model's declared auxiliary loss names.
        aux_loss_scale: The gradient each auxiliary loss receives (1, or the factor an fp16 loss
            scaler applied to the main loss).
        model_name: For error messages.
        average_grads: Divide the gradients by the micro-batch count here (``False``: the caller does).
    """
    losses: list[Tensor] = []
    args = (inputs,) if pipe.has_first else ()
    side: dict[str, Any] = dict(side_inputs or {})
    with collect_aux_losses(scale=aux_loss_scale, allowed=aux_losses, model_name=model_name) as aux:
        pipe.schedule.step(
            *args,
            target=target if pipe.has_last else None,
            losses=losses if pipe.has_last else None,
            return_outputs=False,
            **side,
        )
    if average_grads:
        divide_grads(pipe.modules, pipe.num_microbatches)
    return StepResult(losses, aux)


def divide_grads(modules: Sequence[nn.Module], divisor: int) -> None:
    """Divide the ``.grad`` of every parameter of ``modules`` by ``divisor``, each parameter once.

    One fused multi-tensor op per dtype and device rather than one op per parameter (on a GPU, one
    kernel launch per group instead of one per parameter).
    """
    seen: set[int] = set()
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for module in modules:
        for p in module.parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                if p.grad.layout != torch.strided:
                    p.grad.div_(divisor)  # a sparse gradient: the fused ops take dense ones only
                    continue
                by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for same in by_kind.values():
        torch._foreach_div_(same, divisor)
