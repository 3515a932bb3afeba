"""The pipeline's steps as Lightning calls them on :class:`~lightning_dynmo.DynMoStrategy`.

:func:`training_step` runs one torch schedule step (forward and backward of every micro-batch), reduces the
loss, logs it, and returns a loss that carries the step's gradients into Lightning's ``backward``.
:func:`evaluation_step` (validation, test) and :func:`predict_step` run a forward-only pipeline step; their
results are the same on every rank. A rank a re-pack released refuses them (:func:`check_not_released`).

One schedule step replaces the LightningModule's ``training_step``: the strategy splits the batch with
``pipeline_batch``, runs forward and backward of every micro-batch through torch's schedule, logs the
true loss (reduced from the last stage) on every rank, and returns a loss that carries the step's
gradients into Lightning's ``backward``, so gradient accumulation, clipping (by the norm over all
stages), LR schedulers and precision plugins work as usual. Gradients are averaged over each stage's
data-parallel group when Lightning would sync (not inside an accumulation window). A parameter the
first-stage and last-stage parts share (a tied embedding and head) lives as one copy on each of the two
ranks when they differ: the two ranks exchange the copies' gradients point to point and add them at the
same moment, and the last stage's copy is left out of the clipping norm, so both take the
single-process step (after a re-pack that puts both parts on one rank, they are one parameter again).
After each step the model's optional ``on_pipeline_step_end(loss, batch, batch_idx)`` hook runs on
every rank.

``validation_step`` / ``test_step`` run a forward-only pipeline step (see
:mod:`lightning_dynmo.pipeline.step.evaluation`) and log the batch's mean loss, the same on every rank, as
``val_loss`` / ``test_loss``; ``predict_step`` runs the same forward-only step without a loss and
broadcasts the last stage's output, so ``Trainer.predict`` returns the whole model's predictions on
every rank.

Each function takes the strategy for what Lightning makes public on it (its device, precision plugin,
``guard``, ``rebuild_pipeline``) and the run's state objects (:mod:`lightning_dynmo.strategy.state`) it
reads and writes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dynmo.pipeline import (
    PipelineEvaluator,
    broadcast_from,
    call_step_end_hook,
    checked_loss_fn,
    global_mean_loss,
    reduce_step_losses,
    run_schedule_step,
    split_batch,
    stage_to_pipeline_rank,
)
from lightning_dynmo.pipeline import grads as pipeline_grads
from lightning_dynmo.strategy import sigterm
from lightning_dynmo.strategy.collectives import Guard
from lightning_dynmo.strategy.state import PipelineState, RankState, module_of, trainer_of
from lightning_dynmo.strategy.trainer_checks import check_same_batch_in_pipeline

if TYPE_CHECKING:
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

log = logging.getLogger(__name__)


def training_step(
    strategy: DynMoStrategy,
    ranks: RankState,
    pipeline: PipelineState,
    loss_log_name: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Tensor:
    if ranks.released:
        # Not reached through Lightning (the epoch loop stops first); a harmless zero if called anyway.
        zero = torch.zeros((), device=strategy.root_device)
        return pipeline_grads.loss_carrying_grads(zero, [], [])
    pipeline.step_in_flight = True  # until backward has put this step's gradients into .grad
    module, spec = module_of(strategy), pipeline.require_spec()
    batch = args[0] if args else kwargs["batch"]
    inputs, target, side = split_batch(module, spec, batch)
    # The schedule caches activation shapes from its first step; a new shape needs new stages.
    if pipeline.microbatches.new_pipeline_needed(inputs, target, side):
        strategy.rebuild_pipeline()
    params = list(module.parameters())
    # Keep gradients accumulated so far aside: the schedule adds to .grad and rescales all of it.
    accumulated = pipeline_grads.take_grads(params)
    pipe, scaling = pipeline.require_pipe(), pipeline.loss_scaling
    with (
        strategy.precision_plugin.train_step_context(),
        strategy.guard("a schedule step"),
        scaling.scaled_backward(pipe),  # fp16: the pipeline's backward runs scaled
    ):
        step = run_schedule_step(
            pipe,
            inputs,
            target,
            side,
            aux_losses=spec.aux_losses,
            aux_loss_scale=scaling.scale,
            model_name=type(module).__name__,
            average_grads=False,  # divided in the same pass that carries them into backward (below)
        )
    step_grads = pipeline_grads.take_grads(params)
    pipeline_grads.restore_grads(params, accumulated)
    with strategy.guard("the loss reduction"):
        loss, aux = reduce_step_losses(
            step.losses,
            step.aux,
            spec.aux_losses,
            num_microbatches=pipeline.microbatches.current,
            data_parallel_size=strategy.data_parallel_size,
            group=ranks.active_group,
            device=strategy.root_device,
            dtype=step.losses[0].dtype
            if step.losses
            else (params[0].dtype if params else torch.get_default_dtype()),
        )
    if loss_log_name is not None:
        module.log(loss_log_name, loss, prog_bar=True)
        for name, value in aux.items():
            module.log(f"train_aux/{name}", value)
    call_step_end_hook(module, loss, batch, args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
    return pipeline_grads.loss_carrying_grads(loss, params, step_grads, scale=1.0 / pipe.num_microbatches)


def predict_step(
    strategy: DynMoStrategy,
    ranks: RankState,
    pipeline: PipelineState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Tensor:
    _, evaluator, (inputs, _, side) = _forward_only_step(strategy, ranks, pipeline, "predict", args, kwargs)
    position = last_stage_position(pipeline, strategy.pipeline_size)
    src = pipeline_global_ranks(ranks, strategy.global_rank)[position]
    with (
        strategy.precision_plugin.predict_step_context(),
        strategy.guard("a predict step"),
    ):
        output = evaluator.predict(
            pipeline.require_pipe(),
            inputs,
            side,
            device=strategy.root_device,
            group=ranks.pipeline_group,
        )
        return broadcast_from(output, src, group=ranks.pipeline_group, device=strategy.root_device)


def evaluation_step(
    strategy: DynMoStrategy,
    ranks: RankState,
    pipeline: PipelineState,
    log_name: str | None,
    phase: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Tensor:
    """One forward-only step of ``phase`` (``"validate"`` / ``"test"``), its loss logged as ``log_name``."""
    module, evaluator, (inputs, target, side) = _forward_only_step(
        strategy, ranks, pipeline, phase, args, kwargs
    )
    with strategy.guard(f"a {phase} step"):
        losses = evaluator.step(
            pipeline.require_pipe(),
            inputs,
            target,
            side,
            loss_fn=checked_loss_fn(module),
            device=strategy.root_device,
            group=ranks.pipeline_group,
        )
        params = list(module.parameters())
        dtype = losses[0].dtype if losses else (params[0].dtype if params else torch.get_default_dtype())
        loss, num_samples = global_mean_loss(
            losses,
            int(inputs.shape[0]),
            group=ranks.active_group,
            device=strategy.root_device,
            dtype=dtype,
        )
    if log_name is not None:
        # Already the same value on every rank; sync_dist only silences Lightning's epoch-level warning.
        module.log(log_name, loss, prog_bar=True, batch_size=num_samples, sync_dist=True)
    return loss


def _forward_only_step(
    strategy: DynMoStrategy,
    ranks: RankState,
    pipeline: PipelineState,
    phase: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[pl.LightningModule, PipelineEvaluator, tuple[Any, Any, Any]]:
    check_not_released(ranks, strategy.global_rank, phase)
    sigterm.agree(ranks, strategy.guard, strategy.root_device, trainer_of(strategy))
    module = module_of(strategy)
    batch = args[0] if args else kwargs["batch"]
    split = split_batch(module, pipeline.require_spec(), batch)
    if pipeline.evaluator is None:
        pipeline.evaluator = PipelineEvaluator(pipeline.schedule, pipeline.microbatches.current)
    return module, pipeline.evaluator, split


def last_stage_position(pipeline: PipelineState, pipeline_size: int) -> int:
    """The pipeline rank that runs the last placement stage."""
    num_stages = pipeline.require_placement().num_stages
    return stage_to_pipeline_rank(num_stages - 1, num_stages, pipeline_size, pipeline.schedule.style)


def pipeline_global_ranks(ranks: RankState, global_rank: int) -> list[int]:
    """The global ranks of this rank's pipeline, in pipeline order."""
    if ranks.pipeline_group is None:
        return [global_rank]
    return dist.get_process_group_ranks(ranks.pipeline_group)


def check_not_released(ranks: RankState, global_rank: int, phase: str) -> None:
    if ranks.released:
        raise RuntimeError(
            f"rank {global_rank} was released by a re-pack and holds no part of the model, so it "
            f"cannot {phase}; run it on the active ranks {list(ranks.active_ranks)} (check "
            "strategy.is_released) or on a single device from a checkpoint."
        )


def route_clipping_through_pipeline(
    strategy: DynMoStrategy, ranks: RankState, pipeline: PipelineState, module: nn.Module
) -> None:
    # Lightning clips through the precision plugin on local parameters only; the norm must cover
    # every stage. Data-parallel replicas hold identical gradients by then: the pipeline group suffices.
    plugin = strategy.precision_plugin
    strategy.precision_plugin = plugin  # pin the instance the Trainer uses

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        params = list(plugin.main_params(optimizer))
        if pipeline.sharding is not None:  # every shard of every stage once: the active ranks
            pipeline.sharding.clip_grad_norm_(params, float(clip_val), ranks.active_group)
            return
        # A tie's second copy (on the last stage) is the same parameter: count it in the norm once.
        second = pipeline.ties.second_copies(module)
        counted = [p for p in params if id(p) not in second]
        pipeline_grads.clip_grad_norm(params, float(clip_val), ranks.pipeline_group, counted=counted)

    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]


def batch_start(
    ranks: RankState,
    guard: Guard,
    device: torch.device,
    trainer: pl.Trainer | None,
    batch: Any,
    batch_idx: int,
) -> None:
    """A released rank leaves the epoch; at the first batch, every stage must read the same batch."""
    if ranks.released:
        if trainer is not None:
            trainer.should_stop = True
        raise StopIteration  # ends the epoch loop on this rank; should_stop then ends fit
    if batch_idx == 0 and len(ranks.active_ranks) > 1:
        grid = ranks.require_grid()
        replicas = [grid.data_parallel_rank(r) for r in ranks.active_ranks]
        with guard("the check that every stage reads the same batch"):
            check_same_batch_in_pipeline(batch, ranks.active_group, ranks.active_ranks, replicas, device)
