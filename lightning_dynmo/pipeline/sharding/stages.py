"""What a rank of a sharded pipeline shards with: :class:`StageSharding`, the one object a strategy holds.

Read in this order: :meth:`StageSharding.over_group` (the stage's data-parallel mesh and the precision's
policy), :meth:`~StageSharding.shard_units` (at setup, before the optimizers are built, and for every unit
that arrives), :meth:`~StageSharding.shard_stage` (each new stage module becomes the FSDP root torch's
schedules drive), :meth:`~StageSharding.migrate` (sharded units move shard for shard) and
:meth:`~StageSharding.clip_grad_norm_` (by the norm over every shard of every stage).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from lightning_dynmo.balancing.moves import UnitMove
from lightning_dynmo.pipeline.migration.transport import MigrationReport
from lightning_dynmo.pipeline.sharding.apply import mixed_precision_policy, shard_stage, shard_unit
from lightning_dynmo.pipeline.sharding.grads import clip_sharded_grad_norm_
from lightning_dynmo.pipeline.sharding.memory import local_bytes
from lightning_dynmo.pipeline.sharding.migrate import migrate_sharded_units

__all__ = ["StageSharding", "check_shardable_ties"]


@dataclass(frozen=True)
class StageSharding:
    """How this rank shards its units: over its stage's data-parallel mesh, with one precision policy.

    Attributes:
        mesh: The one-dimensional mesh of the ranks holding this rank's pipeline position in every
            data-parallel replica (the same position keeps its group through migrations and re-packs).
        mp_policy: FSDP2's mixed-precision policy (:func:`~.apply.mixed_precision_policy`).
        reshard_after_forward: As for :func:`~.apply.shard_unit` (``False``: a unit is gathered once per
            step).
    """

    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool = False

    @classmethod
    def over_group(
        cls, group: dist.ProcessGroup | None, *, device_type: str, precision: str
    ) -> StageSharding:
        """The sharding over ``group`` (this rank's data-parallel group) for a Lightning precision name.

        Raises:
            ValueError: ``group`` is ``None`` (no data parallelism: nothing to shard over), or
                ``precision`` has no FSDP2 policy.
        """
        if group is None:
            raise ValueError(
                "data_parallel_sharding='fsdp' shards each stage over its data-parallel group, but this rank "
                "has none (data_parallel_size=1). Run world_size // pipeline_size >= 2 replicas, or keep "
                "data_parallel_sharding='replicate'."
            )
        policy = mixed_precision_policy(precision)
        return cls(DeviceMesh.from_group(group, device_type), policy)

    @property
    def data_parallel_size(self) -> int:
        """The number of shards of each unit."""
        return int(self.mesh.size())

    def shard_units(self, units: Mapping[str, nn.Module]) -> list[str]:
        """Shard every unit of ``units`` not sharded yet, in place (collective over :attr:`mesh`).

        Returns:
            The names of the units sharded now.
        """
        sharded = []
        for name, unit in units.items():
            if not isinstance(unit, FSDPModule):
                shard_unit(
                    unit,
                    self.mesh,
                    mp_policy=self.mp_policy,
                    reshard_after_forward=self.reshard_after_forward,
                )
                sharded.append(name)
        return sharded

    def shard_stage(self, module: nn.Module) -> None:
        """Make a new stage module (a container of sharded units) the FSDP root (see
        :func:`~.apply.shard_stage`)."""
        shard_stage(module, self.mesh, mp_policy=self.mp_policy)

    def migrate(
        self,
        moves: Sequence[UnitMove],
        local_units: Mapping[str, nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        data_parallel_rank: Any,
        group: dist.ProcessGroup | None,
        lr_schedulers: Sequence[Any] = (),
    ) -> tuple[dict[str, nn.Module], MigrationReport]:
        """Move sharded units shard for shard (:func:`~.migrate.migrate_sharded_units`); collective.

        Args:
            moves: The moves, identical on every rank (one per data-parallel replica of a unit).
            local_units: The units this rank holds now.
            optimizers: This rank's optimizers.
            data_parallel_rank: The data-parallel index of a global rank (a callable).
            group: Every rank taking part (the active ranks).
            lr_schedulers: This rank's LR schedulers.

        Returns:
            The units received (sharded, from the senders' skeletons) and this rank's report, counting the
            local shards' bytes (parameters, gradients, optimizer state) sent and received.
        """
        me = dist.get_rank()
        sent = [local_units[m.unit] for m in moves if m.src == me and m.unit in local_units]
        start = time.perf_counter()
        bytes_sent = _total(local_bytes(sent, optimizers)) if sent else 0
        received = migrate_sharded_units(
            moves,
            local_units,
            optimizers,
            mesh=self.mesh,
            data_parallel_rank=data_parallel_rank,
            group=group,
            lr_schedulers=lr_schedulers,
            mp_policy=self.mp_policy,
            reshard_after_forward=self.reshard_after_forward,
        )
        bytes_received = _total(local_bytes(received.values(), optimizers)) if received else 0
        report = MigrationReport(tuple(moves), bytes_sent, bytes_received, time.perf_counter() - start)
        return received, report

    @staticmethod
    def clip_grad_norm_(
        params: Sequence[torch.Tensor], max_norm: float, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        """Clip by the exact norm over ``group`` (every rank holding a part of the model once: the active
        ranks); see :func:`~.grads.clip_sharded_grad_norm_`."""
        return clip_sharded_grad_norm_(params, max_norm, group=group)


def check_shardable_ties(tied: Sequence[Any]) -> None:
    """Refuse parameters the first and last stages share (a tied embedding and head) under sharding.

    Raises:
        ValueError: naming the tied parameters and the way out.
    """
    if tied:
        raise ValueError(
            f"data_parallel_sharding='fsdp' does not support parameters shared by the first and last "
            f"stages yet (found {list(tied)}): their two copies would have to exchange sharded gradients. "
            "Untie them (e.g. tie_embeddings=False), or keep data_parallel_sharding='replicate'."
        )


def _total(held: Any) -> int:
    return int(held.parameters + held.gradients + held.optimizer_state)
