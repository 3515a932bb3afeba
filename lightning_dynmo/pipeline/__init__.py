"""The pipeline runtime on torch.distributed: stages, schedules, placement, migration, checkpoints, faults.

This package imports torch, never lightning (a test enforces it); :mod:`lightning_dynmo.strategy` is the
Lightning glue over it. This front door exports what the strategy, the callback, the models and the
dynamic cases use; the subpackages group the mechanisms, each module summarised in its package:

- :mod:`.model`: the model contract and its units (contract, units, construction, unit state, ties).
- :mod:`.step`: one step on torch's schedules (stage, schedule, micro-batches, auxiliary losses, gradients,
  loss scaling, evaluation).
- :mod:`.placement`: the rank grid, stage -> rank maps, process groups, re-packing (layout, groups, release).
- :mod:`.migration`: moving units between ranks with all their state (transport, pack, optimizer,
  parameter groups).
- :mod:`.checkpoint`: placement-independent, crash-safe checkpoints (contents, state, sharded, atomic,
  checksums, renaming).
- :mod:`.sharding`: FSDP2 inside a stage: units sharded over the stage's data-parallel mesh, the bytes a rank
  holds, and sharded units moved between stages shard for shard (apply, memory, migrate).
- :mod:`.faults`: failures that name the failing rank, and a clean stop on SIGTERM (guard, board, shutdown).

:mod:`.aux` and :mod:`.sharded` keep the import paths of 0.1 (``pipeline.aux.add_aux_loss``,
``pipeline.sharded.export_full_checkpoint``); new code imports from this front door.

Imports point down only: ``faults`` and ``model`` need nothing else of the pipeline; ``step`` and
``placement`` build on them; ``migration`` on ``model``; ``sharding`` on ``migration``; ``checkpoint`` on
``migration`` and ``model``.
"""

from lightning_dynmo.pipeline.checkpoint.atomic import repair as repair_checkpoint
from lightning_dynmo.pipeline.checkpoint.contents import (
    CHECKPOINT_KEY,
    full_state_from_checkpoint,
    layout_of,
    read_checkpoint,
    staged_file_save,
    state_to_save,
)
from lightning_dynmo.pipeline.checkpoint.renaming import rename_checkpoint_keys
from lightning_dynmo.pipeline.checkpoint.resume import resume_path
from lightning_dynmo.pipeline.checkpoint.sharded import (
    CheckpointSaveError,
    export_full_checkpoint,
    is_sharded_checkpoint,
    read_full_checkpoint,
    save_sharded,
)
from lightning_dynmo.pipeline.checkpoint.state import load_local_state
from lightning_dynmo.pipeline.faults.failure_board import FailureBoard
from lightning_dynmo.pipeline.faults.guard import (
    CommContext,
    RemoteFailure,
    communication_guard,
    describe_peers,
    report_interrupt,
)
from lightning_dynmo.pipeline.faults.shutdown import SigtermAgreement
from lightning_dynmo.pipeline.faults.stall_watch import StallWatch
from lightning_dynmo.pipeline.migration.transport import MigrationReport, UnitMove, migrate_units
from lightning_dynmo.pipeline.model.construction import keep_local_units
from lightning_dynmo.pipeline.model.contract import (
    HIDDEN,
    ModelSpec,
    TiedParameter,
    block_inputs,
    call_step_end_hook,
    check_model_contract,
    find_tied_parameters,
    split_batch,
)
from lightning_dynmo.pipeline.model.ties import TiedCopies
from lightning_dynmo.pipeline.model.unit_state import check_no_user_hooks, check_not_compiled
from lightning_dynmo.pipeline.model.units import attach_unit, detach_unit, pipeline_units
from lightning_dynmo.pipeline.placement.groups import (
    CONTROL_TIMEOUT_NAME,
    DEFAULT_CONTROL_TIMEOUT,
    build_groups,
    check_same_on_all_ranks,
    control_timeout_of,
    restart_attempt_store,
)
from lightning_dynmo.pipeline.placement.layout import (
    PlannedMove,
    RankGrid,
    check_placement,
    initial_placement,
    stage_to_pipeline_rank,
    unit_moves,
    unit_owners,
)
from lightning_dynmo.pipeline.placement.release import (
    ReleaseEvent,
    active_ranks_of,
    build_repacked_groups,
    plan_repack,
    repack_layouts,
)
from lightning_dynmo.pipeline.step import grads
from lightning_dynmo.pipeline.step.actions import schedule_order
from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss, collect_aux_losses, reduce_step_losses
from lightning_dynmo.pipeline.step.evaluation import PipelineEvaluator, broadcast_from, global_mean_loss
from lightning_dynmo.pipeline.step.loss_scaling import PipelineLossScaling
from lightning_dynmo.pipeline.step.microbatches import MicrobatchCount, retune_candidates
from lightning_dynmo.pipeline.step.schedule import (
    BuiltPipeline,
    build_pipeline,
    checked_loss_fn,
    resolve_schedule,
    run_schedule_step,
)
from lightning_dynmo.pipeline.step.stage import in_shape_inference, part_modules, run_block

__all__ = [
    "CHECKPOINT_KEY",
    "CONTROL_TIMEOUT_NAME",
    "DEFAULT_CONTROL_TIMEOUT",
    "HIDDEN",
    "BuiltPipeline",
    "CheckpointSaveError",
    "CommContext",
    "FailureBoard",
    "MicrobatchCount",
    "MigrationReport",
    "ModelSpec",
    "PipelineEvaluator",
    "PipelineLossScaling",
    "PlannedMove",
    "RankGrid",
    "ReleaseEvent",
    "RemoteFailure",
    "SigtermAgreement",
    "StallWatch",
    "TiedCopies",
    "TiedParameter",
    "UnitMove",
    "active_ranks_of",
    "add_aux_loss",
    "attach_unit",
    "block_inputs",
    "broadcast_from",
    "build_groups",
    "build_pipeline",
    "build_repacked_groups",
    "call_step_end_hook",
    "check_model_contract",
    "check_no_user_hooks",
    "check_not_compiled",
    "check_placement",
    "check_same_on_all_ranks",
    "checked_loss_fn",
    "collect_aux_losses",
    "communication_guard",
    "control_timeout_of",
    "describe_peers",
    "detach_unit",
    "export_full_checkpoint",
    "find_tied_parameters",
    "full_state_from_checkpoint",
    "global_mean_loss",
    "grads",
    "in_shape_inference",
    "initial_placement",
    "is_sharded_checkpoint",
    "keep_local_units",
    "layout_of",
    "load_local_state",
    "migrate_units",
    "part_modules",
    "pipeline_units",
    "plan_repack",
    "read_checkpoint",
    "read_full_checkpoint",
    "reduce_step_losses",
    "rename_checkpoint_keys",
    "repack_layouts",
    "repair_checkpoint",
    "report_interrupt",
    "resolve_schedule",
    "restart_attempt_store",
    "resume_path",
    "retune_candidates",
    "run_block",
    "run_schedule_step",
    "save_sharded",
    "schedule_order",
    "split_batch",
    "stage_to_pipeline_rank",
    "staged_file_save",
    "state_to_save",
    "unit_moves",
    "unit_owners",
]
