"""FSDP2 inside a pipeline stage: shard each unit over the stage's data-parallel mesh, count what a rank
holds, and move a sharded unit between stages shard for shard.

- :mod:`.apply`: :func:`~.apply.shard_unit` applies torch's ``fully_shard`` to one unit.
- :mod:`.memory`: :func:`~.memory.local_bytes`, the bytes of parameters, gradients and optimizer state a
  rank holds for some units (its shards only).
- :mod:`.migrate`: :func:`~.migrate.migrate_sharded_units`, data-parallel rank ``i`` of the source stage
  sends its local shards (parameters, gradients, optimizer state, buffers) to data-parallel rank ``i`` of
  the destination stage, which rebuilds the unit, shards it the same way and takes the shards in. No
  all-gather.

Each unit is its own FSDP root (the stage module that :class:`~torch.distributed.pipelining.PipelineStage`
runs is a plain container of sharded units), so a unit can arrive or leave without touching the state of
the units that stay: FSDP2 records the states under a root once, at its first forward, and offers no
public way to refresh that record.
"""

from lightning_dynmo.pipeline.sharding.apply import shard_unit
from lightning_dynmo.pipeline.sharding.memory import ShardedBytes, local_bytes
from lightning_dynmo.pipeline.sharding.migrate import migrate_sharded_units

__all__ = ["ShardedBytes", "local_bytes", "migrate_sharded_units", "shard_unit"]
