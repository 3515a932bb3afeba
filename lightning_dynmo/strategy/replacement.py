"""Live re-placement of a running :class:`~lightning_dynmo.DynMoStrategy`: migrate, or re-pack and release.

:func:`apply_placement` is what :meth:`DynMoStrategy.apply_placement` runs: the check that every rank
applies the same placement, then either a migration of units between the ranks (same stage count) or a
re-pack onto fewer ranks (:func:`repack`), which builds the smaller pipeline's groups on the ranks that
stay and releases the others (:func:`release`: they free their units and optimizer state and leave
``fit``), then tells ``on_release`` and the callbacks (:func:`announce_release`). The units move through
the ``migrate`` function the strategy passes (its ``_migrate``, which tests override to spoil a move).

Under ``data_parallel_sharding="fsdp"`` the units are sharded at setup (:func:`shard_local_units`,
before the optimizers are built), each new stage module is made the FSDP root the schedule drives
(:func:`rebuild_pipeline`), and :func:`migrate` moves units shard for shard, sharded again on arrival
(:class:`~lightning_dynmo.pipeline.sharding.StageSharding`); a re-pack keeps the data-parallel groups.

Every function takes the strategy for what Lightning makes public on it (its rank, device, optimizers,
``guard``, ``rebuild_pipeline``) and the run's state objects (:mod:`lightning_dynmo.strategy.state`) it
reads and writes.

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
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

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
    detach_unit,
    find_tied_parameters,
    initial_placement,
    keep_local_units,
    migrate_units,
    pipeline_units,
    plan_repack,
    unit_moves,
    unit_owners,
)
from lightning_dynmo.pipeline import grads as pipeline_grads
from lightning_dynmo.pipeline.model.compiled import compile_blocks
from lightning_dynmo.pipeline.sharding import StageSharding, check_shardable_ties
from lightning_dynmo.pipeline.step.boundaries import (
    BoundaryRecorder,
    StageTensors,
    frozen_names,
    stage_metadata,
)
from lightning_dynmo.strategy import steps
from lightning_dynmo.strategy.state import PipelineState, RankState, module_of, trainer_of

if TYPE_CHECKING:
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

log = logging.getLogger(__name__)

#: ``migrate(moves, what)``: move the planned units and re-attach what arrived (:func:`migrate`).
Migrate = Callable[[list[UnitMove], str], MigrationReport]


def apply_placement(
    strategy: DynMoStrategy,
    ranks: RankState,
    pipeline: PipelineState,
    new: Placement | str,
    num_microbatches: int | None,
    *,
    migrate: Migrate,
    on_release: Callable[[ReleaseEvent], Any] | None,
) -> MigrationReport:
    if ranks.released:
        raise RuntimeError(
            f"apply_placement was called on rank {strategy.global_rank}, which a re-pack released; only the "
            f"active ranks {list(ranks.active_ranks)} take part. Check strategy.is_released first."
        )
    pipeline_grads.check_no_step_in_flight(pipeline.step_in_flight, "apply_placement")
    spec, old = pipeline.require_spec(), pipeline.require_placement()
    target = new if isinstance(new, Placement) else Placement.from_string(new, num_layers=spec.num_layers)
    check = "apply_placement (the check that every rank applies the same placement)"
    with strategy.guard(check, control=True):
        what = "apply_placement was called with different placements (or micro-batch counts)"
        agreed = f"{target}" + ("" if num_microbatches is None else f" num_microbatches={num_microbatches}")
        check_same_on_all_ranks(agreed, ranks.active_ranks, ranks.control_group, what)
    if target.num_stages > old.num_stages:
        raise ValueError(
            f"placement {target} has {target.num_stages} stages but the pipeline runs "
            f"{old.num_stages} on the active ranks {list(ranks.active_ranks)}; "
            "apply_placement keeps or reduces the number of stages (re-pack) but never grows it, "
            "because released ranks have left the job. To train on more stages, save a checkpoint "
            "and resume it with more devices: DynMo checkpoints load at any placement."
        )
    # Before anything moves, so that a bad count fails every rank alike.
    pipeline.microbatches.check_retune(num_microbatches, pipeline.schedule, target, old)
    if target.num_stages < old.num_stages:
        return repack(
            strategy, ranks, pipeline, target, num_microbatches, migrate=migrate, on_release=on_release
        )
    check_placement(target, spec.num_layers, pipeline.num_stages(strategy.pipeline_size))
    if target == old:
        return MigrationReport(moves=(), bytes_sent=0, bytes_received=0, seconds=0.0)
    grid, style = ranks.require_grid(), pipeline.schedule.style
    planned = unit_moves(old, target, grid, style, spec.first_parts, spec.last_parts)
    tensors = recorded_stage_tensors(strategy, ranks, pipeline, target)
    report = migrate(planned, f"migration {old} -> {target}")
    pipeline.placement = target
    rebuild_pipeline(strategy, ranks, pipeline, tensors)
    log.info("rank %d: placement %s -> %s (%d units moved)", strategy.global_rank, old, target, len(planned))
    return report


def recorded_stage_tensors(
    strategy: DynMoStrategy, ranks: RankState, pipeline: PipelineState, target: Placement
) -> dict[int, StageTensors] | None:
    """Every stage's inputs and outputs under ``target`` from the ranks' boundary records (one gather over
    the active ranks), or ``None``: torch's metadata pass runs in the new stages' first step."""
    mine = (pipeline.boundaries.record_now, frozen_names(module_of(strategy)))
    gathered: list[Any] = [None] * len(ranks.active_ranks)
    with strategy.guard("the exchange of the recorded stage boundaries", control=True):
        dist.all_gather_object(gathered, mine, group=ranks.control_group)
    records = [record for record, _ in gathered]
    frozen = frozenset().union(*(names for _, names in gathered))
    batch_shape = pipeline.microbatches.batch_shape
    tensors = stage_metadata(records, frozen, batch_shape, target, range(target.num_stages))
    if tensors is None:
        log.debug(
            "rank %d: no usable boundary record; the new stages infer their tensors", strategy.global_rank
        )
    return tensors


def repack(
    strategy: DynMoStrategy,
    ranks: RankState,
    pipeline: PipelineState,
    target: Placement,
    num_microbatches: int | None,
    *,
    migrate: Migrate,
    on_release: Callable[[ReleaseEvent], Any] | None,
) -> MigrationReport:
    spec, old, old_grid = pipeline.require_spec(), pipeline.require_placement(), ranks.require_grid()
    check_placement(target, spec.num_layers, target.num_stages)
    new_grid = plan_repack(old_grid, old, target, pipeline.schedule.stages_per_rank)
    style = pipeline.schedule.style
    planned = unit_moves(old, target, old_grid, style, spec.first_parts, spec.last_parts, new_grid=new_grid)
    report = migrate(planned, f"re-pack {old} -> {target}")
    old_active = ranks.active_ranks
    ranks.grid, pipeline.placement = new_grid, target
    ranks.active_ranks = active_ranks_of(new_grid)
    trainer = trainer_of(strategy)
    event = ReleaseEvent(
        released_ranks=tuple(r for r in old_active if r not in ranks.active_ranks),
        active_ranks=ranks.active_ranks,
        old_placement=str(old),
        new_placement=str(target),
        global_step=trainer.global_step if trainer is not None else 0,
    )
    if strategy.global_rank in ranks.active_ranks:
        # Only members build the new groups; the data-parallel groups of kept positions are unchanged.
        ranks.pipeline_group, ranks.active_group, ranks.control_group = build_repacked_groups(
            new_grid, strategy.global_rank, ranks.timeout, ranks.control_timeout
        )
        pair_tied_copies(strategy, ranks, pipeline)
        pipeline.microbatches.retune(num_microbatches)
        strategy.rebuild_pipeline()
    else:
        pipeline.ties.clear()
        release(strategy, ranks, pipeline)
    announce_release(strategy, ranks, event, on_release)
    return report


def release(strategy: DynMoStrategy, ranks: RankState, pipeline: PipelineState) -> None:
    module = module_of(strategy)
    for unit in list(pipeline.local_units(module)):
        detach_unit(module, unit)
    for optimizer in strategy.optimizers:
        optimizer.state.clear()
        for group in optimizer.param_groups:
            group["params"] = []
    pipeline.pipe = None
    ranks.release()
    gc.collect()
    if strategy.root_device.type == "cuda":
        torch.cuda.empty_cache()
    trainer = trainer_of(strategy)
    if trainer is not None:
        # Leave fit at the next batch boundary; min_epochs/min_steps must not hold a released rank back.
        trainer.should_stop = True
        trainer.fit_loop.min_epochs = 0
        trainer.fit_loop.epoch_loop.min_steps = 0


def announce_release(
    strategy: DynMoStrategy,
    ranks: RankState,
    event: ReleaseEvent,
    on_release: Callable[[ReleaseEvent], Any] | None,
) -> None:
    if strategy.is_global_zero:
        log.info(event.describe())
    if ranks.released:
        log.info(
            "rank %d: released by the re-pack %s -> %s; freeing its modules and leaving fit.",
            strategy.global_rank,
            event.old_placement,
            event.new_placement,
        )
    if on_release is not None:
        on_release(event)
    trainer = trainer_of(strategy)
    if trainer is None:
        return
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        hook = getattr(callback, "on_dynmo_ranks_released", None)
        if callable(hook):
            hook(trainer, module_of(strategy), event)


def place_initially(
    strategy: DynMoStrategy,
    ranks: RankState,
    pipeline: PipelineState,
    module: nn.Module,
    placement: str | Placement,
) -> None:
    """Check the model, resolve the initial ``placement``, and cut ``module`` down to this rank's units."""
    spec = pipeline.spec = check_model_contract(module)
    check_not_compiled(pipeline_units(module, spec))  # the profiler's hooks must reach blocks
    num_stages = pipeline.num_stages(strategy.pipeline_size)
    if num_stages > 1:
        pipeline.ties = TiedCopies(find_tied_parameters(module, spec))
        check_no_user_hooks(pipeline.local_units(module))  # units may migrate; hooks would not
    blocks = [module.get_submodule(f"layers.{i}") for i in range(spec.num_layers)]
    sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    pipeline.placement = initial_placement(placement, spec.num_layers, num_stages, sizes)
    pair_tied_copies(strategy, ranks, pipeline)
    grid, style = ranks.require_grid(), pipeline.schedule.style
    owners = unit_owners(pipeline.placement, grid, style, spec.first_parts, spec.last_parts)
    mine = (strategy.data_parallel_rank, strategy.global_rank)
    owned = [unit for (replica, unit), rank in owners.items() if (replica, rank) == mine]
    keep_local_units(module, spec, owned, device=strategy.root_device)
    compile_local_blocks(module, pipeline, strategy.global_rank)
    pipeline.cut_module = module
    counts = pipeline.microbatches
    pipeline.boundaries = BoundaryRecorder(
        lambda: counts.batch_shape, lambda: frozen_names(module_of(strategy))
    )


def compile_local_blocks(module: nn.Module, pipeline: PipelineState, global_rank: int) -> None:
    """With ``compile_blocks``: compile this rank's blocks not compiled yet (at setup, after arrivals)."""
    if pipeline.compile_options is None:
        return
    blocks = module.get_submodule("layers")
    compiled = compile_blocks(dict(blocks.named_children()), pipeline.compile_options)
    if compiled:
        log.debug("rank %d: compiled blocks %s", global_rank, compiled)


def migrate(
    strategy: DynMoStrategy, ranks: RankState, pipeline: PipelineState, moves: list[UnitMove], what: str
) -> MigrationReport:
    """Move ``moves`` (one plan for every data-parallel replica) and re-attach what arrived."""
    module = module_of(strategy)
    # One plan for every data-parallel replica (each moves its own copy of a unit inside the replica):
    # one agreement over the active ranks, and all replicas' transfers at the same time.
    schedulers = [config.scheduler for config in strategy.lr_scheduler_configs]
    with strategy.guard(what):
        if pipeline.sharding is not None:  # shard for shard, received units sharded on arrival
            received, report = pipeline.sharding.migrate(
                moves,
                pipeline.local_units(module),
                strategy.optimizers,
                data_parallel_rank=ranks.require_grid().data_parallel_rank,
                group=ranks.active_group,
                lr_schedulers=schedulers,
            )
        else:
            received, report = migrate_units(
                moves,
                pipeline.local_units(module),
                strategy.optimizers,
                device=strategy.root_device,
                group=ranks.active_group,
                lr_schedulers=schedulers,
            )
    for move in moves:
        if move.src == strategy.global_rank:
            detach_unit(module, move.unit)
    for unit, arrived in received.items():
        attach_unit(module, unit, arrived)
    compile_local_blocks(module, pipeline, strategy.global_rank)  # what arrived; the rest keep theirs
    return report


def rebuild_pipeline(
    strategy: DynMoStrategy,
    ranks: RankState,
    pipeline: PipelineState,
    stage_tensors: Mapping[int, StageTensors] | None = None,
) -> None:
    """New stages and schedule on this rank for the current placement and micro-batch count.

    ``stage_tensors`` (:func:`recorded_stage_tensors`): the stages are built from them (they run the batch
    shapes of the record); ``None``: torch's metadata pass runs in their first step and is recorded.
    """
    if stage_tensors is None:
        pipeline.boundaries.start()
    pipeline.pipe = build_pipeline(
        module_of(strategy),
        pipeline.require_spec(),
        pipeline.require_placement(),
        pipeline.schedule,
        pipeline_rank=ranks.require_grid().pipeline_rank(strategy.global_rank),
        pipeline_size=strategy.pipeline_size,
        num_microbatches=pipeline.microbatches.current,
        device=strategy.root_device,
        group=ranks.pipeline_group,
        recompute=pipeline.recompute,
        prepare_stage=None if pipeline.sharding is None else pipeline.sharding.shard_stage,
        recorder=pipeline.boundaries,
        stage_tensors=stage_tensors,
    )
    if stage_tensors is None:
        pipeline.microbatches.batch_shape = None  # the next batch sets it, whatever its shapes


def pair_tied_copies(strategy: DynMoStrategy, ranks: RankState, pipeline: PipelineState) -> None:
    """Pair this rank's copy of each tied parameter with the other stage's (a tied embedding and head)."""
    pipeline.ties.pair(
        module_of(strategy),
        strategy.optimizers,
        rank=strategy.global_rank,
        pipeline_ranks=steps.pipeline_global_ranks(ranks, strategy.global_rank),
        last_position=steps.last_stage_position(pipeline, strategy.pipeline_size),
    )


def shard_local_units(strategy: DynMoStrategy, ranks: RankState, pipeline: PipelineState) -> None:
    """Under ``data_parallel_sharding="fsdp"``: shard this rank's units over its stage's data-parallel
    group (once; a later ``Trainer.validate`` finds them sharded), with the Trainer's precision's policy."""
    if pipeline.data_parallel_sharding != "fsdp" or pipeline.sharding is not None:
        return
    check_shardable_ties(pipeline.ties.ties)
    pipeline.sharding = StageSharding.over_group(
        ranks.data_parallel_group,
        device_type=strategy.root_device.type,
        precision=str(strategy.precision_plugin.precision),
    )
    pipeline.sharding.shard_units(pipeline.local_units(module_of(strategy)))
