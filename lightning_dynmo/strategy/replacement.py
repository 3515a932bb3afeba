"""Live re-placement of a running :class:`~lightning_dynmo.DynMoStrategy`: migrate, or re-pack and release.

:func:`apply_placement` is what :meth:`DynMoStrategy.apply_placement` runs: the check that every rank
applies the same placement, then either a migration of units between the ranks (same stage count) or a
re-pack onto fewer ranks (:func:`repack`), which builds the smaller pipeline's groups on the ranks that
stay and releases the others (:func:`release`: they free their units and optimizer state and leave
``fit``), then tells ``on_release`` and the callbacks (:func:`announce_release`). The strategy's
``_migrate`` moves the units (tests override it to spoil a move).

Re-pack and release in detail: the layers are packed onto the lowest pipeline ranks of each data-parallel
replica (global rank 0 always stays) and a new pipeline group is built among them. The released ranks
free their modules and optimizer state, their Trainer leaves ``fit`` cleanly (``trainer.should_stop``; the
epoch loop ends at the next ``on_train_batch_start``), and from then on the strategy's collectives,
checkpoint gathering and training steps are no-ops there, while on the active ranks they run over the
active ranks only. The release is logged (global rank 0) and announced to ``on_release`` and to callbacks
defining ``on_dynmo_ranks_released(trainer, pl_module, event)``. Released ranks never come back, so a
placement with more stages than now is an error.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING, Any

import torch

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline import (
    MigrationReport,
    ReleaseEvent,
    TiedCopies,
    UnitMove,
    active_ranks_of,
    attach_unit,
    build_pipeline,
    build_repacked_groups,
    check_model_contract,
    check_no_user_hooks,
    check_not_compiled,
    check_placement,
    check_same_on_all_ranks,
    communication_guard,
    detach_unit,
    find_tied_parameters,
    keep_local_units,
    migrate_units,
    pipeline_units,
    plan_repack,
    unit_moves,
    unit_owners,
)
from lightning_dynmo.pipeline import grads as pipeline_grads
from lightning_dynmo.pipeline.model.compiled import compile_blocks
from lightning_dynmo.strategy import steps

if TYPE_CHECKING:
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

log = logging.getLogger(__name__)


def apply_placement(
    strategy: DynMoStrategy, new: Placement | str, num_microbatches: int | None = None
) -> MigrationReport:
    if strategy._released:
        raise RuntimeError(
            f"apply_placement was called on rank {strategy.global_rank}, which a re-pack released; only the "
            f"active ranks {list(strategy._active_ranks)} take part. Check strategy.is_released first."
        )
    pipeline_grads.check_no_step_in_flight(strategy._step_in_flight, "apply_placement")
    spec = strategy._require_spec()
    target = new if isinstance(new, Placement) else Placement.from_string(new, num_layers=spec.num_layers)
    check = "apply_placement (the check that every rank applies the same placement)"
    with strategy.guard(check, control=True):
        what = "apply_placement was called with different placements (or micro-batch counts)"
        agreed = f"{target}" + ("" if num_microbatches is None else f" num_microbatches={num_microbatches}")
        check_same_on_all_ranks(agreed, strategy._active_ranks, strategy._control_group, what)
    if target.num_stages > strategy.placement.num_stages:
        raise ValueError(
            f"placement {target} has {target.num_stages} stages but the pipeline runs "
            f"{strategy.placement.num_stages} on the active ranks {list(strategy._active_ranks)}; "
            "apply_placement keeps or reduces the number of stages (re-pack) but never grows it, "
            "because released ranks have left the job. To train on more stages, save a checkpoint "
            "and resume it with more devices: DynMo checkpoints load at any placement."
        )
    # Before anything moves, so that a bad count fails every rank alike.
    strategy._microbatches.check_retune(num_microbatches, strategy._schedule, target, strategy.placement)
    if target.num_stages < strategy.placement.num_stages:
        return repack(strategy, target, num_microbatches)
    check_placement(target, spec.num_layers, strategy._num_stages_of_run())
    old = strategy.placement
    if target == old:
        return MigrationReport(moves=(), bytes_sent=0, bytes_received=0, seconds=0.0)
    planned = unit_moves(
        old, target, strategy._require_grid(), strategy._schedule.style, spec.first_parts, spec.last_parts
    )
    report = strategy._migrate(planned, f"migration {old} -> {target}")
    strategy._placement = target
    strategy.rebuild_pipeline()
    log.info("rank %d: placement %s -> %s (%d units moved)", strategy.global_rank, old, target, len(planned))
    return report


def repack(strategy: DynMoStrategy, target: Placement, num_microbatches: int | None) -> MigrationReport:
    spec, old, old_grid = strategy._require_spec(), strategy.placement, strategy._require_grid()
    check_placement(target, spec.num_layers, target.num_stages)
    new_grid = plan_repack(old_grid, old, target, strategy._schedule.stages_per_rank)
    style = strategy._schedule.style
    planned = unit_moves(old, target, old_grid, style, spec.first_parts, spec.last_parts, new_grid=new_grid)
    report = strategy._migrate(planned, f"re-pack {old} -> {target}")
    old_active = strategy._active_ranks
    strategy._grid, strategy._placement = new_grid, target
    strategy._active_ranks = active_ranks_of(new_grid)
    trainer = strategy._trainer()
    event = ReleaseEvent(
        released_ranks=tuple(r for r in old_active if r not in strategy._active_ranks),
        active_ranks=strategy._active_ranks,
        old_placement=str(old),
        new_placement=str(target),
        global_step=trainer.global_step if trainer is not None else 0,
    )
    if strategy.global_rank in strategy._active_ranks:
        # Only members build the new groups; the data-parallel groups of kept positions are unchanged.
        strategy._pipeline_group, strategy._active_group, strategy._control_group = build_repacked_groups(
            new_grid, strategy.global_rank, strategy._timeout, strategy._control_timeout
        )
        pair_tied_copies(strategy)
        strategy._microbatches.retune(num_microbatches)
        strategy.rebuild_pipeline()
    else:
        strategy._ties.clear()
        release(strategy)
    announce_release(strategy, event)
    return report


def release(strategy: DynMoStrategy) -> None:
    for unit in list(strategy._local_units()):
        detach_unit(strategy._module(), unit)
    for optimizer in strategy.optimizers:
        optimizer.state.clear()
        for group in optimizer.param_groups:
            group["params"] = []
    strategy._pipe = None
    strategy._pipeline_group = strategy._active_group = strategy._data_parallel_group = None
    strategy._control_group = None
    strategy._released = True
    gc.collect()
    if strategy.root_device.type == "cuda":
        torch.cuda.empty_cache()
    trainer = strategy._trainer()
    if trainer is not None:
        # Leave fit at the next batch boundary; min_epochs/min_steps must not hold a released rank back.
        trainer.should_stop = True
        trainer.fit_loop.min_epochs = 0
        trainer.fit_loop.epoch_loop.min_steps = 0


def announce_release(strategy: DynMoStrategy, event: ReleaseEvent) -> None:
    if strategy.is_global_zero:
        log.info(event.describe())
    if strategy._released:
        log.info(
            "rank %d: released by the re-pack %s -> %s; freeing its modules and leaving fit.",
            strategy.global_rank,
            event.old_placement,
            event.new_placement,
        )
    if strategy._on_release is not None:
        strategy._on_release(event)
    trainer = strategy._trainer()
    if trainer is None:
        return
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        hook = getattr(callback, "on_dynmo_ranks_released", None)
        if callable(hook):
            hook(trainer, strategy._module(), event)


def place_initially(strategy: DynMoStrategy, module: Any) -> None:
    """Check the model, resolve the initial placement, and cut ``module`` down to this rank's units."""
    strategy._spec = check_model_contract(module)
    check_not_compiled(pipeline_units(module, strategy._spec))  # the profiler's hooks must reach blocks
    if strategy._num_stages_of_run() > 1:
        strategy._ties = TiedCopies(find_tied_parameters(module, strategy._spec))
        check_no_user_hooks(strategy._local_units())  # units may migrate; hooks would not
    strategy._placement = strategy._resolve_placement(strategy._spec, module)
    pair_tied_copies(strategy)
    spec, grid, style = strategy._spec, strategy._require_grid(), strategy._schedule.style
    owners = unit_owners(strategy._placement, grid, style, spec.first_parts, spec.last_parts)
    mine = (strategy.data_parallel_rank, strategy.global_rank)
    owned = [unit for (replica, unit), rank in owners.items() if (replica, rank) == mine]
    keep_local_units(module, spec, owned, device=strategy.root_device)
    compile_local_blocks(strategy, module)
    strategy._cut_module = module


def compile_local_blocks(strategy: DynMoStrategy, module: Any) -> None:
    """With ``compile_blocks``: compile this rank's blocks not compiled yet (at setup, after arrivals)."""
    if strategy._compile_options is None:
        return
    blocks = module.get_submodule("layers")
    compiled = compile_blocks(dict(blocks.items()), strategy._compile_options)
    if compiled:
        log.debug("rank %d: compiled blocks %s", strategy.global_rank, compiled)


def migrate(strategy: DynMoStrategy, moves: list[UnitMove], what: str) -> MigrationReport:
    """Move ``moves`` (one plan for every data-parallel replica) and re-attach what arrived."""
    # One plan for every data-parallel replica (each moves its own copy of a unit inside the replica):
    # one agreement over the active ranks, and all replicas' transfers at the same time.
    with communication_guard(what, strategy._comm_context()):
        received, report = migrate_units(
            moves,
            strategy._local_units(),
            strategy.optimizers,
            device=strategy.root_device,
            group=strategy._active_group,
            lr_schedulers=[config.scheduler for config in strategy.lr_scheduler_configs],
        )
    for move in moves:
        if move.src == strategy.global_rank:
            detach_unit(strategy._module(), move.unit)
    for unit, module in received.items():
        attach_unit(strategy._module(), unit, module)
    compile_local_blocks(strategy, strategy._module())  # what arrived; the blocks that stayed keep theirs
    return report


def rebuild_pipeline(strategy: DynMoStrategy) -> None:
    """New stages and schedule on this rank for the current placement and micro-batch count."""
    strategy._pipe = build_pipeline(
        strategy._module(),
        strategy._require_spec(),
        strategy.placement,
        strategy._schedule,
        pipeline_rank=strategy._require_grid().pipeline_rank(strategy.global_rank),
        pipeline_size=strategy.pipeline_size,
        num_microbatches=strategy._microbatches.current,
        device=strategy.root_device,
        group=strategy._pipeline_group,
        recompute=strategy._activation_checkpointing,
    )
    strategy._microbatches.batch_shape = None


def pair_tied_copies(strategy: DynMoStrategy) -> None:
    """Pair this rank's copy of each tied parameter with the other stage's (a tied embedding and head)."""
    strategy._ties.pair(
        strategy._module(),
        strategy.optimizers,
        rank=strategy.global_rank,
        pipeline_ranks=steps.pipeline_global_ranks(strategy),
        last_position=steps.last_stage_position(strategy),
    )
