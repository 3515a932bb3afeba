"""The process groups a rank grid trains over, and the check that their ranks agree on an argument.

:func:`build_groups` creates, at launch, every rank's pipeline group, data-parallel group and the
group of the active ranks, in the same order on every rank (``new_group`` is collective over the
world), each with the strategy's timeout, so that a collective called on some ranks only fails after
*that* timeout with an error naming the call (see :mod:`lightning_dynmo.pipeline.faults.guard`). The groups
of a re-packed (smaller) grid come from :func:`lightning_dynmo.pipeline.build_repacked_groups`.
:func:`check_same_on_all_ranks` refuses a collective call whose argument differs between ranks (one
all-reduce of a digest; the values themselves are gathered only to name a mismatch).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from lightning_dynmo.pipeline.placement.layout import RankGrid

__all__ = [
    "CONTROL_TIMEOUT_NAME",
    "DEFAULT_CONTROL_TIMEOUT",
    "GridGroups",
    "build_groups",
    "check_same_on_all_ranks",
    "control_timeout_of",
    "restart_attempt_store",
]

#: How long DynMo's control-plane agreements wait for every active rank by default. Ranks reach them within
#: one training step of each other (the pipeline's sends and receives keep them in step), so this bounds a
#: call made on some ranks only (a user's bug) to under two minutes instead of the process group's 30; the
#: same figure torchtitan uses for its training collectives after the first step.
DEFAULT_CONTROL_TIMEOUT = timedelta(seconds=100)
#: How error messages name the control group's timeout (``DynMoStrategy(control_timeout=...)`` sets it).
CONTROL_TIMEOUT_NAME = "DynMo's control timeout"


def control_timeout_of(timeout: timedelta | None, control_timeout: timedelta | None) -> timedelta | None:
    """The control group's timeout: ``control_timeout``, never longer than the process groups' ``timeout``.

    ``None`` for either means torch's default for that one (30 minutes for gloo).
    """
    if control_timeout is None:
        return timeout
    if timeout is None:
        return control_timeout
    return min(timeout, control_timeout)


@dataclass(frozen=True)
class GridGroups:
    """One rank's process groups.

    Attributes:
        active: All training ranks (the strategy's collectives run over it).
        pipeline: This rank's pipeline, ranks in pipeline order.
        data_parallel: The ranks holding the same pipeline position in every replica (``None`` without
            data parallelism).
        control: All training ranks again, with the control timeout: DynMo's own agreements run on it.
    """

    active: dist.ProcessGroup
    pipeline: dist.ProcessGroup
    data_parallel: dist.ProcessGroup | None
    control: dist.ProcessGroup


def build_groups(
    grid: RankGrid,
    rank: int,
    timeout: timedelta | None,
    *,
    world_has_timeout: bool,
    control_timeout: timedelta | None = DEFAULT_CONTROL_TIMEOUT,
) -> GridGroups:
    """Create the groups of ``grid``; collective over the world, call on every rank.

    Args:
        grid: The rank grid.
        rank: This global rank.
        timeout: The strategy's timeout, given to every group.
        world_has_timeout: Whether the default group was created with ``timeout`` (by the strategy). If
            not (a process group made by a launcher script or a test), the active ranks get a group of
            their own: the pipeline group itself with a single replica, a new group otherwise.
        control_timeout: The control group's timeout (capped by ``timeout``, see
            :func:`control_timeout_of`).
    """
    pipeline: dist.ProcessGroup | None = None
    for replica in range(grid.data_parallel_size):
        ranks = grid.pipeline_ranks(replica)
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            pipeline = group
    data_parallel = None
    if grid.data_parallel_size > 1:
        for position in range(grid.pipeline_size):
            ranks = grid.data_parallel_ranks(position)
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                data_parallel = group
    assert pipeline is not None, f"rank {rank} is in no pipeline of {grid}"
    active = dist.group.WORLD
    if not world_has_timeout:
        active = pipeline if grid.data_parallel_size == 1 else dist.new_group(timeout=timeout)
    assert active is not None
    control = dist.new_group(timeout=control_timeout_of(timeout, control_timeout))
    return GridGroups(active, pipeline, data_parallel, control)


def check_same_on_all_ranks(
    value: str, ranks: Sequence[int], group: dist.ProcessGroup | None, what: str
) -> None:
    """Refuse a call whose argument differs between ranks; collective over ``group`` (``ranks``, in order).

    Args:
        value: This rank's argument, as text.
        ranks: The global ranks of ``group``, in group order.
        group: The group the call is collective over.
        what: The call and its argument, e.g. ``"apply_placement was called with different placements"``.

    Raises:
        ValueError: naming every rank's value, if they differ.
    """
    digest = int.from_bytes(hashlib.sha256(value.encode()).digest()[:7], "little")
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if int(extremes[0]) == -int(extremes[1]):
        return  # every rank hashed the same text
    gathered: list[Any] = [None] * len(ranks)
    dist.all_gather_object(gathered, value, group=group)
    if len(set(gathered)) != 1:
        per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, gathered, strict=True))
        raise ValueError(
            f"{what} on different ranks ({per_rank}); decide it once (e.g. on rank 0) and broadcast it with "
            "strategy.broadcast before the call."
        )


def restart_attempt_store(timeout: timedelta | None) -> Store | None:
    """Under torchrun's agent store, a store whose keys belong to this restart attempt; else ``None``.

    After ``torchrun --max-restarts`` restarts the workers, the default ``env://`` initialisation reads the
    gloo addresses the previous attempt's ranks published in the agent's store, and connecting to those
    dead ranks fails ("Connection refused"). Prefixing the keys with the attempt
    (``TORCHELASTIC_RESTART_COUNT``) gives every attempt a clean rendezvous.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,  # the agent hosts it
        timeout=timeout or timedelta(minutes=30),
    )
    return PrefixStore(f"/dynmo/attempt_{attempt}", store)
