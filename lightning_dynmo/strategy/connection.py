"""Connect the ranks (process groups, failure board, stall watch) and describe them in errors.

The default group is made here unless a launcher script or a test made it already (then its timeout is
theirs, and the active ranks get a group of their own with the strategy's timeout). Under torchrun's agent
store every restart attempt meets on keys of its own (see
:func:`~lightning_dynmo.pipeline.placement.groups.restart_attempt_store`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from torch import nn

from lightning_dynmo.pipeline import (
    CONTROL_TIMEOUT_NAME,
    CommContext,
    FailureBoard,
    StallWatch,
    build_groups,
    describe_peers,
    restart_attempt_store,
)
from lightning_dynmo.strategy.state import PipelineState, RankState

__all__ = ["comm_context", "connect"]


def connect(
    ranks: RankState,
    env: ClusterEnvironment,
    backend: str | None,
    device: torch.device,
    global_rank: int,
    world_size: int,
) -> str:
    """Initialise the process groups of ``ranks.grid`` and the failure reporting; every rank calls it.

    Returns:
        The backend in use (``backend``, or the default for ``device`` when ``None``).
    """
    backend = backend or _get_default_process_group_backend_for_device(device)
    made_here = not _distributed_is_initialized()  # else made by a script or test, with its timeout
    extra: dict[str, Any] = {}
    if made_here and (store := restart_attempt_store(ranks.timeout)) is not None:
        extra["store"] = store
    _init_dist_connection(env, backend, timeout=ranks.timeout, **extra)  # extra: torchrun restarts
    ranks.active_ranks = tuple(range(world_size))
    groups = build_groups(
        ranks.require_grid(),
        global_rank,
        ranks.timeout,
        world_has_timeout=made_here,
        control_timeout=ranks.control_timeout,
    )
    ranks.use_groups(groups)
    ranks.board = FailureBoard.open(world_size)
    ranks.board.register(global_rank)
    peers = [r for r in ranks.active_ranks if r != global_rank][:8]  # as errors list them
    ranks.watch = StallWatch.for_timeout(ranks.board, global_rank, ranks.control_timeout, peers)
    return backend


def comm_context(
    ranks: RankState,
    pipeline: PipelineState,
    global_rank: int,
    units: Callable[[], Mapping[str, nn.Module]],
    control: bool = False,
) -> CommContext:
    """Who this rank is, for a guarded step's errors; ``control``: an agreement on the control group.

    ``units`` returns this rank's units (called only if the step fails, to name the unit).
    """
    # Cheap: peers and units are described only if the guarded step fails (issue #13's scale).
    style, stages = pipeline.schedule.style, pipeline.pipe.stage_indices if pipeline.pipe else ()
    peers = partial(describe_peers, global_rank, ranks.active_ranks, ranks.grid, pipeline.placement, style)
    context = CommContext(global_rank, stages, peers, ranks.timeout, ranks.board, units, ranks.watch)
    if not control:
        return context
    return replace(context, timeout=ranks.control_timeout, timeout_name=CONTROL_TIMEOUT_NAME)
