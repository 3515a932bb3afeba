"""Apply torch's FSDP2 ``fully_shard`` to a stage's units and container; the policy a precision implies."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["mixed_precision_policy", "shard_stage", "shard_unit"]


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


def shard_stage(
    stage: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> FSDPModule:
    """Make a stage container of sharded units an FSDP root, so that torch's pipeline schedules drive it.

    :class:`~torch.distributed.pipelining.PipelineStage` runs FSDP the pipelined way (no gradient
    reduce-scatter nor re-sharding after each micro-batch's backward, one reduce-scatter after the last,
    and weight gradients apart from input gradients under the zero-bubble schedules) only when the module
    it runs is itself an ``FSDPModule``. Build a new container after every migration (units arrived or
    left) and call this on it: its units are sharded already (:func:`shard_unit`); the container's own
    parameters, if any, are sharded here.

    FSDP2 records the states under a root at the root's first forward and keeps that record; a unit that
    trained under a former container is marked as a non-root for good, and a new root would refuse it
    ("FSDP state has already been lazily initialized for ..."). torch 2.13 offers no public reset, so this
    function clears that one mark (``_is_root``) on the units' FSDP states; the new root's first forward
    then records them afresh and shares its communication state with them.

    Args:
        stage: A new container holding this rank's units of one stage (not sharded itself yet).
        mesh: The stage's data-parallel mesh, the one its units are sharded over.
        mp_policy: The policy the units were sharded with.

    Raises:
        ValueError: ``stage`` is already an FSDP module, or a parameter inside is sharded over another mesh.
    """
    if isinstance(stage, FSDPModule):
        raise ValueError(
            f"stage {type(stage).__name__} is already an FSDP root; build a new container of the units "
            "after a migration and shard that one."
        )
    for name, param in stage.named_parameters():
        if isinstance(param, DTensor) and param.device_mesh != mesh:
            raise ValueError(
                f"parameter {name!r} is sharded over {param.device_mesh}, the stage over {mesh}; shard every "
                "unit of a stage over the stage's data-parallel mesh."
            )
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            fully_shard.state(module)._is_root = None  # type: ignore[attr-defined]  # see above
    return shard_unit(stage, mesh, mp_policy=mp_policy)


#: Lightning's precision names (as ``Trainer(precision=...)`` resolves them) and what FSDP2 casts for each:
#: ``(parameter dtype in forward/backward, gradient reduce-scatter dtype)``; ``None`` keeps the dtype the
#: parameters have. The "-true" precisions keep every dtype (the parameters already have it).
_PRECISION_DTYPES: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "64-true": (None, None),
    "32-true": (None, None),
    "16-true": (None, None),
    "bf16-true": (None, None),
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "16-mixed": (torch.float16, torch.float32),
}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy for a Lightning precision name.

    "bf16-mixed" and "16-mixed" all-gather the parameters in bfloat16 / float16 for forward and backward
    and reduce-scatter the gradients in float32 (torchtitan's choice: the sum over shards keeps its
    precision); the sharded parameters, gradients and optimizer state stay in the parameters' dtype. The
    "-true" precisions cast nothing. "16-mixed" still needs loss scaling, as without sharding.

    Args:
        precision: ``"64-true"``, ``"32-true"``, ``"16-true"``, ``"bf16-true"``, ``"bf16-mixed"`` or
            ``"16-mixed"`` (the names ``Trainer(precision=...)`` resolves to).

    Raises:
        ValueError: any other name.
    """
    if precision not in _PRECISION_DTYPES:
        raise ValueError(
            f"precision={precision!r} has no FSDP2 mixed-precision policy; use one of "
            f"{sorted(_PRECISION_DTYPES)} (Lightning's resolved names: 'bf16' is 'bf16-mixed')."
        )
    param_dtype, reduce_dtype = _PRECISION_DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
