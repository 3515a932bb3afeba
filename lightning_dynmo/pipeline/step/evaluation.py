"""Forward-only pipelined evaluation: validation and test losses of a model cut into pipeline stages.

Read in this order: :func:`forward_only_order` (the evaluation schedule as data),
:func:`eval_microbatches` (how a batch is cut), :class:`PipelineEvaluator` (keeps an evaluation
pipeline next to the training one and runs it) and :func:`global_mean_loss` (one collective that gives
every rank the batch's mean loss).

Why a separate pipeline: torch's schedules cache per-stage state from their first step (receive
buffers, activation shapes, whether a backward follows). Calling ``eval()`` on the *training*
schedule flips that state, so the next training step would redo its metadata inference, and a
validation batch of another size would corrupt the cached shapes. The evaluation pipeline therefore
has its own ``PipelineStage`` objects and schedule over the *same* stage modules (no parameter is
copied). It is built lazily, and rebuilt when the training pipeline is rebuilt (after
``apply_placement`` or a training batch-shape change) or when the evaluation batch shape changes.

Which schedule: evaluation is forward only, so the order of the micro-batches does not change any
number; only the stage-to-rank layout must match the training placement. Single-stage runs use torch's
GPipe. Multi-stage runs (interleaved and V layouts) use torch's schedule runtime with a forward-only
action list (every stage, in order, runs all micro-batches): torch's own multi-stage schedules cannot run
``eval()`` in torch 2.13 (ZBV and DualPipeV fail on their backward-input actions), and its schedule
validation insists on a backward per micro-batch, which :class:`_ForwardOnlyRuntime` skips. All
evaluation schedules accept any micro-batch count, and run with ``scale_grads=False``: torch's
``eval()`` still ends with the gradient scaling of a training step, which would divide gradients
accumulated so far (validation inside an accumulation window) by the micro-batch count.

Micro-batches: a validation batch may be smaller than a training batch (the last, partial batch). torch
cuts a batch into *equal* micro-batches only when the count divides the batch size (otherwise stages
would receive activations of a shape they did not allocate), so evaluation uses the largest divisor
of the batch size that does not exceed the configured ``num_microbatches``. The loss is the same
either way: the mean of equal-size micro-batch means is the batch mean.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    ScheduleGPipe,
    _Action,
    _add_send_recv,
    _ComputationType,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)

from lightning_dynmo.pipeline.placement.layout import StageStyle, stage_to_pipeline_rank
from lightning_dynmo.pipeline.step.schedule import BuiltPipeline, ScheduleSpec
from lightning_dynmo.pipeline.step.stage import guard_shape_inference

log = logging.getLogger(__name__)


def forward_only_order(
    num_stages: int, pipeline_size: int, num_microbatches: int, style: StageStyle
) -> dict[int, list[_Action]]:
    """Each pipeline rank's compute actions for a forward-only step: stage by stage, all micro-batches.

    Deadlock free: a rank only waits for inputs of an earlier stage, and sends do not block.
    """
    order: dict[int, list[_Action]] = {rank: [] for rank in range(pipeline_size)}
    for stage in range(num_stages):
        rank = stage_to_pipeline_rank(stage, num_stages, pipeline_size, style)
        order[rank] += [_Action(stage, _ComputationType.FORWARD, mb) for mb in range(num_microbatches)]
    return order


class _ForwardOnlyRuntime(_PipelineScheduleRuntime):
    """torch's schedule runtime driving a forward-only action list (see the module docstring)."""

    def load_forward_order(self, order: dict[int, list[_Action]]) -> None:
        """Use ``order`` (from :func:`forward_only_order`) with torch's send/receive lowering pass.

        Replaces ``_prepare_schedule_with_comms``, whose validation demands a backward for every
        micro-batch; the unshard and gradient-reduction passes it also runs do nothing without FSDP
        and gradients.
        """
        mapping = {a.stage_index: rank for rank, actions in order.items() for a in actions}
        assert sorted(mapping) == list(range(self._num_stages)), f"stages missing from {mapping}"
        self.stage_index_to_group_rank = mapping
        for stage in self._stages:
            stage.stage_index_to_group_rank = mapping
        self.pipeline_order = dict(order)  # type: ignore[arg-type]
        self.pipeline_order_with_comms = _add_send_recv(
            dict(order), stage_to_rank=lambda s: mapping[s], num_stages=self._num_stages
        )


def eval_microbatches(batch_size: int, num_microbatches: int) -> int:
    """The largest divisor of ``batch_size`` that is at most ``num_microbatches``.

    Raises:
        ValueError: if either argument is not a positive integer.
    """
    for name, value in (("batch_size", batch_size), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{name}={value!r} must be an integer >= 1; an evaluation batch needs at least one sample "
                "per micro-batch."
            )
    return max(m for m in range(1, min(batch_size, num_microbatches) + 1) if batch_size % m == 0)


@dataclass
class _EvalPipeline:
    source: BuiltPipeline
    shape: tuple[Any, ...]
    num_microbatches: int
    schedule: _PipelineSchedule


class PipelineEvaluator:
    """Runs forward-only pipeline steps for validation, test and predict, next to a training pipeline.

    Args:
        schedule: The training schedule (its stage layout decides the evaluation schedule).
        num_microbatches: The configured micro-batch count; evaluation uses at most this many.
    """

    def __init__(self, schedule: ScheduleSpec, num_microbatches: int) -> None:
        self._schedule = schedule
        self._num_microbatches = num_microbatches
        self._pipe: _EvalPipeline | None = None
        self._builds = 0

    @property
    def num_builds(self) -> int:
        """How many evaluation pipelines were built so far (for logs and tests)."""
        return self._builds

    def step(
        self,
        source: BuiltPipeline,
        inputs: Tensor,
        target: Tensor,
        side_inputs: Mapping[str, Tensor] | None = None,
        *,
        loss_fn: Any,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> list[Tensor]:
        """Run every micro-batch of one batch forward through the pipeline, without gradients.

        Args:
            source: The current training pipeline (its stage modules are reused).
            inputs: The whole batch's first-stage input (every rank passes it; only stage 0 uses it).
            target: The whole batch's target (only the last stage uses it).
            side_inputs: The batch's side inputs (every stage receives them).
            loss_fn: The model's ``pipeline_loss``.
            device: This rank's device.
            group: The pipeline's process group.

        Returns:
            The per-micro-batch losses on the rank running the last stage, ``[]`` elsewhere.
        """
        side: dict[str, Any] = dict(side_inputs or {})
        pipe = self._pipeline_for(source, inputs, target, side, loss_fn, device, group)
        losses: list[Tensor] = []
        args = (inputs,) if source.has_first else ()
        with torch.no_grad():
            pipe.schedule.eval(
                *args,
                target=target if source.has_last else None,
                losses=losses if source.has_last else None,
                **side,
            )
        return losses

    def predict(
        self,
        source: BuiltPipeline,
        inputs: Tensor,
        side_inputs: Mapping[str, Tensor] | None = None,
        *,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> Tensor | None:
        """Run one batch forward through the pipeline without a loss; the output, on the last stage only.

        Args:
            source: The current training pipeline (its stage modules are reused).
            inputs: The whole batch's first-stage input (every rank passes it; only stage 0 uses it).
            side_inputs: The batch's side inputs (every stage receives them).
            device: This rank's device.
            group: The pipeline's process group.

        Returns:
            The last stage's output for the whole batch (micro-batches merged) on the rank running the
            last stage, ``None`` elsewhere.
        """
        side: dict[str, Any] = dict(side_inputs or {})
        pipe = self._pipeline_for(source, inputs, None, side, None, device, group)
        args = (inputs,) if source.has_first else ()
        with torch.no_grad():
            output = pipe.schedule.eval(*args, **side)
        return output if source.has_last else None

    def _pipeline_for(
        self,
        source: BuiltPipeline,
        inputs: Tensor,
        target: Tensor | None,
        side_inputs: Mapping[str, Tensor],
        loss_fn: Any,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> _EvalPipeline:
        # A predict pipeline (no target, no loss) is never reused for a loss, nor the other way round.
        shape = (
            tuple(inputs.shape),
            None if target is None else tuple(target.shape),
            *((k, tuple(v.shape)) for k, v in sorted(side_inputs.items())),
        )
        current = self._pipe
        if current is not None and current.source is source and current.shape == shape:
            return current
        count = eval_microbatches(int(inputs.shape[0]), self._num_microbatches)
        if count != self._num_microbatches:
            log.info(
                "evaluation batch of %d samples: %d micro-batches instead of num_microbatches=%d "
                "(the largest count that divides the batch)",
                inputs.shape[0],
                count,
                self._num_microbatches,
            )
        self._pipe = _EvalPipeline(source, shape, count, self._build(source, count, loss_fn, device, group))
        self._builds += 1
        return self._pipe

    def _build(
        self,
        source: BuiltPipeline,
        num_microbatches: int,
        loss_fn: Any,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> _PipelineSchedule:
        num_stages = source.schedule._num_stages  # type: ignore[attr-defined]
        stages = [
            PipelineStage(module, index, num_stages, device, group=group)
            for module, index in zip(source.modules, source.stage_indices, strict=True)
        ]
        for stage, module in zip(stages, source.modules, strict=True):
            guard_shape_inference(stage, module)
        if self._schedule.stages_per_rank == 1:
            return ScheduleGPipe(
                stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False
            )
        runtime = _ForwardOnlyRuntime(  # type: ignore[no-untyped-call]
            stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False
        )
        pipeline_size = stages[0].group_size
        order = forward_only_order(num_stages, pipeline_size, num_microbatches, self._schedule.style)
        runtime.load_forward_order(order)
        return runtime


def global_mean_loss(
    losses: list[Tensor],
    num_samples: int,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Tensor, int]:
    """The mean loss over every replica's batch, known on every rank of ``group``; one collective.

    Each replica's last stage contributes ``batch mean * batch size`` and its batch size (the other
    ranks contribute zeros), so the result weighs every sample equally, as the single-process loss
    of the union of the replicas' batches would.

    Args:
        losses: This rank's per-micro-batch losses (equal-size micro-batches), ``[]`` off the last stage.
        num_samples: The samples in this replica's batch.
        group: The group over which to reduce (all active ranks).
        device: Where the collective's tensor lives.
        dtype: The dtype of the returned loss (the same on every rank).

    Returns:
        ``(mean_loss, total_samples)``: the global mean and the number of samples it covers.
    """
    box = torch.zeros(2, dtype=torch.float64, device=device)
    if losses:
        box[0] = torch.stack([x.detach().double() for x in losses]).mean() * num_samples
        box[1] = num_samples
    dist.all_reduce(box, op=dist.ReduceOp.SUM, group=group)
    total = round(box[1].item())
    if total < 1:
        raise RuntimeError(
            "no last pipeline stage contributed an evaluation loss; every replica's last stage must run "
            "the same evaluation step as the other ranks."
        )
    return (box[0] / total).to(dtype), total


def broadcast_from(
    value: Tensor | None, src: int, *, group: dist.ProcessGroup | None, device: torch.device
) -> Tensor:
    """``value`` from global rank ``src`` on every rank of ``group`` (shape and dtype travel first).

    Args:
        value: The tensor on ``src``; ignored elsewhere (pass ``None``).
        src: The global rank that holds the tensor.
        group: The process group to broadcast over (``src`` must belong to it).
        device: Where the received tensor lives (the collective's device).
    """
    meta: list[Any] = [None]
    if dist.get_rank() == src:
        if value is None:
            raise RuntimeError(f"broadcast_from: rank {src} is the source but holds no tensor.")
        meta[0] = (tuple(value.shape), value.dtype)
    dist.broadcast_object_list(meta, src=src, group=group, device=device)
    shape, dtype = meta[0]
    out = (
        cast(Tensor, value).to(device).contiguous()  # the source holds a tensor (checked above)
        if dist.get_rank() == src
        else torch.empty(shape, dtype=dtype, device=device)
    )
    dist.broadcast(out, src=src, group=group)
    return out
