"""FSDP2 inside a pipeline stage: shard each unit over the stage's data-parallel mesh, count what a rank
holds, and move a sharded unit between stages shard for shard.

- :mod:`.apply`: :func:`~.apply.shard_unit` applies torch's ``fully_shard`` to one unit;
  :func:`~.apply.shard_stage` makes a stage's container of sharded units the FSDP root the pipeline
  schedules drive; :func:`~.apply.mixed_precision_policy` maps a Lightning precision to FSDP2's policy.
- :mod:`.memory`: :func:`~.memory.local_bytes`, the bytes of parameters, gradients and optimizer state a
  rank holds for some units (its shards only).
- :mod:`.migrate`: :func:`~.migrate.migrate_sharded_units`, data-parallel rank ``i`` of the source stage
  sends its local shards (parameters, gradients, optimizer state, buffers) to data-parallel rank ``i`` of
  the destination stage, which rebuilds the unit, shards it the same way and takes the shards in. No
  all-gather.
- :mod:`.grads`: :func:`~.grads.clip_sharded_grad_norm_`, clipping by the exact norm over all shards and
  stages.
- :mod:`.skeleton`: :func:`~.skeleton.unit_skeleton`, a sharded unit's unsharded ``meta`` copy (classes,
  shapes, plain attributes), what travels so that the receiver can rebuild the unit.
- :mod:`.stages`: :class:`~.stages.StageSharding`, the one object a strategy holds for a sharded run: the
  stage's data-parallel mesh and precision policy, and the calls above with them bound.
- :mod:`.checkpoint`: :func:`~.checkpoint.save_sharded_units` / :func:`~.checkpoint.load_sharded_units`,
  distributed checkpoints of sharded units and their optimizer state, loadable at another placement and
  shard count.

Each unit is sharded on its own (one all-gather and one reduce-scatter per unit), and the module a
:class:`~torch.distributed.pipelining.PipelineStage` runs is a container of the stage's units, made an FSDP
root with :func:`~.apply.shard_stage` and built anew after every migration.
"""

from lightning_dynmo.pipeline.sharding.apply import mixed_precision_policy, shard_stage, shard_unit
from lightning_dynmo.pipeline.sharding.checkpoint import (
    load_sharded_units,
    save_sharded_units,
    sharded_unit_items,
)
from lightning_dynmo.pipeline.sharding.grads import clip_sharded_grad_norm_
from lightning_dynmo.pipeline.sharding.memory import ShardedBytes, local_bytes
from lightning_dynmo.pipeline.sharding.migrate import migrate_sharded_units
from lightning_dynmo.pipeline.sharding.skeleton import unit_skeleton
from lightning_dynmo.pipeline.sharding.stages import StageSharding, check_shardable_ties

__all__ = [
    "ShardedBytes",
    "StageSharding",
    "check_shardable_ties",
    "clip_sharded_grad_norm_",
    "load_sharded_units",
    "local_bytes",
    "migrate_sharded_units",
    "mixed_precision_policy",
    "save_sharded_units",
    "shard_stage",
    "shard_unit",
    "sharded_unit_items",
    "unit_skeleton",
]
