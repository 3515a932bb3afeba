"""Apply torch's FSDP2 ``fully_shard`` to one unit over a stage's data-parallel mesh."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["shard_unit"]


def shard_unit(
    unit: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = False,
) -> FSDPModule:
    """Shard ``unit``'s parameters on dim 0 over ``mesh``, in place; the unit becomes its own FSDP root.

    Collective over ``mesh`` (every rank of the stage's data-parallel group calls it for the same unit).
    Optimizers must hold the sharded parameters, so build them (or insert the parameters) afterwards.

    Args:
        unit: The unit (a block, the embedding, the head); not sharded yet.
        mesh: The stage's data-parallel mesh, one dimension (``init_device_mesh(...)["dp"]``).
        mp_policy: FSDP2's mixed-precision policy (parameter, reduce and output dtypes); ``None`` keeps
            every dtype as the parameters have it.
        reshard_after_forward: Free the gathered parameters after forward and gather them again for
            backward. ``False`` (default) keeps them for the whole step, as torchtitan does under
            pipelining, so a unit is gathered once per step rather than once per micro-batch.

    Raises:
        ValueError: ``mesh`` has more than one dimension, or ``unit`` is already sharded.
    """
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh={mesh} has {mesh.ndim} dimensions; shard_unit shards over the stage's data-parallel "
            "mesh, one dimension. Pass the data-parallel slice, e.g. mesh['dp']."
        )
    if isinstance(unit, FSDPModule):
        raise ValueError(
            f"unit {type(unit).__name__} is already sharded (an FSDPModule); shard each unit once, "
            "after it is built or received."
        )
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    sharded = fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    assert isinstance(sharded, FSDPModule)
    return sharded
