"""Each pipeline rank's ordered compute actions under one of our schedules, taken from torch's schedules.

:func:`schedule_actions` feeds :func:`lightning_dynmo.balancing.schedule_model.simulate_step` (and
:func:`schedule_order` the policy's step model, :class:`~lightning_dynmo.balancing.step_prediction.
ScheduleOrder`): per rank,
``(stage, kind, micro_batch)`` in the order the rank runs them, kind ``"F"``, ``"B"`` (full backward),
``"I"`` (input gradient) or ``"W"`` (weight gradient).

- Multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) are
  built by torch's own class on stand-in stages (building the order needs only the stage counts and the
  rank); we read the compute actions of ``pipeline_order_with_comms``, the lowered list torch's runtime
  executes, and run an ``OVERLAP_F_B`` action's sub-actions in order, as that runtime does.
- Single-stage schedules (GPipe, 1F1B) have no order as data that matches what they run: torch 2.13's
  ``Schedule1F1B._get_pipeline_order`` starts the last rank at micro-batch 1 and ends it at ``n``. We
  write the order of their ``_step_microbatches`` (``_single_stage_order``).

``tests/unit/pipeline/test_schedule_actions.py`` runs ``_step_microbatches`` of all seven torch classes
on stand-in stages that log their compute calls, and compares the recording with these lists.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from torch.distributed.pipelining.schedules import _Action, _ComputationType

from lightning_dynmo.balancing.step_prediction import ScheduleOrder
from lightning_dynmo.pipeline.step.schedule import resolve_schedule

#: One action: ``(stage, kind, micro_batch)``, as :mod:`lightning_dynmo.balancing.schedule_model` takes it.
Action = tuple[int, str, int]

_COMPUTE_KINDS = {
    _ComputationType.FORWARD: "F",
    _ComputationType.FULL_BACKWARD: "B",
    _ComputationType.BACKWARD_INPUT: "I",
    _ComputationType.BACKWARD_WEIGHT: "W",
}


def schedule_actions(schedule_name: str, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Per pipeline rank, the compute actions it runs in one training step, in order.

    Args:
        schedule_name: One of :data:`~lightning_dynmo.pipeline.step.schedule.SCHEDULE_NAMES`
            (case-insensitive).
        num_stages: The placement's stages (for multi-stage schedules, two per rank).
        num_microbatches: Micro-batches per step.

    Returns:
        One list per pipeline rank of ``(stage, kind, micro_batch)``.

    Raises:
        ValueError: for an unknown schedule, a stage count the schedule cannot spread over its ranks, or
            a micro-batch count torch's schedule rejects.
    """
    spec = resolve_schedule(schedule_name)
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1.")
    if num_stages % spec.stages_per_rank:
        raise ValueError(
            f"num_stages={num_stages} cannot run under {spec.name}, which puts {spec.stages_per_rank} stages "
            f"on each rank; use a multiple of {spec.stages_per_rank}."
        )
    pipeline_size = num_stages // spec.stages_per_rank
    stubs = [_stage_stub(s, num_stages, pipeline_size) for s in range(spec.stages_per_rank)]
    cls: Any = spec.cls  # the concrete classes take stages first; their base class does not
    try:  # torch's own checks of the micro-batch count, with the messages its runtime gives
        schedule = cls(stubs[0] if spec.stages_per_rank == 1 else stubs, num_microbatches, loss_fn=_no_loss)
    except ValueError as err:
        raise ValueError(
            f"num_microbatches={num_microbatches} is rejected by schedule {spec.name!r} with {num_stages} "
            f"stages: {err}"
        ) from err
    if spec.stages_per_rank == 1:
        return [_single_stage_order(spec.name, s, num_stages, num_microbatches) for s in range(num_stages)]
    lowered = schedule.pipeline_order_with_comms
    return [_compute_actions(lowered[rank]) for rank in range(pipeline_size)]


def _stage_stub(local_index: int, num_stages: int, pipeline_size: int) -> SimpleNamespace:
    # What the schedules' constructors read of a PipelineStage; they set stage_index_to_group_rank on it.
    return SimpleNamespace(
        num_stages=num_stages,
        group_size=pipeline_size,
        group_rank=0,
        stage_index=local_index,
        submod=None,
        is_first=local_index == 0,
        is_last=False,
    )


def _no_loss(output: Any, target: Any) -> Any:
    return output  # never called: building the order runs no step


def _compute_actions(lowered: list[_Action]) -> list[Action]:
    out: list[Action] = []
    for action in lowered:
        for leaf in action.sub_actions or (action,):
            kind = _COMPUTE_KINDS.get(leaf.computation_type)
            if kind is not None:
                assert leaf.microbatch_index is not None, f"torch compute action {leaf} has no micro-batch"
                out.append((leaf.stage_index, kind, leaf.microbatch_index))
    return out


def _single_stage_order(name: str, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """What ``ScheduleGPipe`` / ``Schedule1F1B._step_microbatches`` run on ``stage`` (torch 2.13)."""
    forwards = [(stage, "F", m) for m in range(num_microbatches)]
    backwards = [(stage, "B", m) for m in range(num_microbatches)]
    if name == "GPipe":
        return forwards + backwards
    # 1F1B: warm-up of min(n, num_stages - stage) forwards, then "1B1F" (a backward, then a forward while
    # forwards remain), then the remaining backwards.
    warmup = min(num_microbatches, num_stages - stage)
    order = forwards[:warmup]
    for m in range(num_microbatches):
        order.append(backwards[m])
        if warmup + m < num_microbatches:
            order.append(forwards[warmup + m])
    return order


@functools.cache  # one order per schedule, so its action lists are built once per pipeline shape
def schedule_order(schedule_name: str, weight_grad_share: float = 0.5) -> ScheduleOrder:
    """``schedule_name`` with its action lists, for the policy's step model (lists built once per shape)."""
    name = resolve_schedule(schedule_name).name
    return ScheduleOrder(name, functools.cache(functools.partial(schedule_actions, name)), weight_grad_share)
