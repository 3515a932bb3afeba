"""Connect the ranks (process groups, failure board, stall watch) and describe them in errors.

The default group is made here unless a launcher script or a test made it already (then its timeout is
theirs, and the active ranks get a group of their own with the strategy's timeout). Under torchrun's agent
store every restart attempt meets on keys of its own (see
:func:`~lightning_dynmo.pipeline.placement.groups.restart_attempt_store`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)

from lightning_dynmo.pipeline import (
    CONTROL_TIMEOUT_NAME,
    CommContext,
    FailureBoard,
    StallWatch,
    build_groups,
    describe_peers,
    restart_attempt_store,
)

if TYPE_CHECKING:
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

__all__ = ["comm_context", "connect"]


def connect(strategy: DynMoStrategy) -> None:
    """Initialise the process groups of ``strategy``'s grid and its failure reporting; every rank calls it."""
    if strategy._process_group_backend is None:
        strategy._process_group_backend = _get_default_process_group_backend_for_device(strategy.root_device)
    assert strategy.cluster_environment is not None
    made_here = not _distributed_is_initialized()  # else made by a script or test, with its timeout
    extra: dict[str, Any] = {}
    if made_here and (store := restart_attempt_store(strategy._timeout)) is not None:
        extra["store"] = store
    env, backend = strategy.cluster_environment, strategy._process_group_backend
    _init_dist_connection(env, backend, timeout=strategy._timeout, **extra)  # extra: torchrun restarts
    strategy._active_ranks = tuple(range(strategy.world_size))
    groups = build_groups(
        strategy._require_grid(),
        strategy.global_rank,
        strategy._timeout,
        world_has_timeout=made_here,
        control_timeout=strategy._control_timeout,
    )
    strategy._active_group, strategy._pipeline_group = groups.active, groups.pipeline
    strategy._data_parallel_group, strategy._control_group = groups.data_parallel, groups.control
    strategy._board = FailureBoard.open(strategy.world_size)
    strategy._board.register(strategy.global_rank)
    peers = [r for r in strategy._active_ranks if r != strategy.global_rank][:8]  # as errors list them
    strategy._watch = StallWatch.for_timeout(
        strategy._board, strategy.global_rank, strategy._control_timeout, peers
    )


def comm_context(strategy: DynMoStrategy, control: bool = False) -> CommContext:
    """Who this rank is, for a guarded step's errors; ``control``: an agreement on the control group."""
    # Cheap: peers and units are described only if the guarded step fails (issue #13's scale).
    me, style = strategy.global_rank, strategy._schedule.style
    peers = partial(describe_peers, me, strategy._active_ranks, strategy._grid, strategy._placement, style)
    context = CommContext(
        me,
        strategy.stage_indices,
        peers,
        strategy._timeout,
        strategy._board,
        strategy._local_units,
        strategy._watch,
    )
    if not control:
        return context
    return replace(context, timeout=strategy._control_timeout, timeout_name=CONTROL_TIMEOUT_NAME)
