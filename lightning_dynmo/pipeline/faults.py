"""Turn a lost peer into an error that says who was lost, instead of a bare transport message.

When a pipeline rank dies, its peers see only ``Connection closed by peer [127.0.0.1]:54682``; when it
stalls, ``Timed out waiting 30000ms for recv operation to complete``. Neither says which rank or stage
is gone. :func:`communication_guard` wraps one communicating step (a schedule step, a migration, a
loss reduction) and re-raises such a failure as a ``RuntimeError`` naming this rank's stage, the peers
it exchanges data with and the original error. A stall surfaces after the process-group ``timeout``
(gloo honours it for point-to-point receives and collectives alike), so no rank waits forever.

Errors that are not communication failures (a shape mismatch in the loss, a bad argument) pass through
unchanged: relabelling them as lost peers would send the user looking in the wrong place.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline.layout import RankGrid, StageStyle, stages_of_pipeline_rank

__all__ = [
    "CommContext",
    "communication_guard",
    "describe_failure",
    "describe_peers",
    "is_communication_failure",
]

# Substrings of the transport errors seen from gloo and NCCL when a peer dies or stalls.
_COMM_MARKERS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "pair closure",
    "gloo",
    "nccl",
    "socket",
)


@dataclass(frozen=True)
class CommContext:
    """Who this rank is and whom it talks to, for error messages.

    Attributes:
        rank: This rank's global rank.
        stages: The placement stage(s) this rank runs (empty once released).
        peers: ``{global_rank: description}`` of the ranks this step exchanges data with.
        timeout: The process-group timeout (a stalled peer is reported after it).
    """

    rank: int
    stages: tuple[int, ...]
    peers: dict[int, str]
    timeout: timedelta | None


def is_communication_failure(err: BaseException) -> bool:
    """Whether ``err`` looks like a failed or timed-out exchange with another rank."""
    if isinstance(err, dist.DistError):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err).lower()
    return any(marker in text for marker in _COMM_MARKERS)


def describe_peers(
    rank: int,
    active_ranks: Sequence[int],
    grid: RankGrid,
    placement: Placement,
    style: StageStyle,
) -> dict[int, str]:
    """The other active ranks, each described by its replica and the placement stage(s) it runs.

    Args:
        rank: This rank (left out).
        active_ranks: Global ranks taking part in training.
        grid: The rank grid in use.
        placement: The placement in use.
        style: How stages map onto pipeline ranks.
    """
    peers = {}
    for r in active_ranks:
        if r == rank:
            continue
        prank = grid.pipeline_rank(r)
        stages = stages_of_pipeline_rank(prank, placement.num_stages, grid.pipeline_size, style)
        where = f" of replica {grid.data_parallel_rank(r)}" if grid.data_parallel_size > 1 else ""
        peers[r] = f"stage {'/'.join(map(str, stages))}{where} on global rank {r}"
    return peers


@contextmanager
def communication_guard(what: str, context: CommContext) -> Generator[None, None, None]:
    """Re-raise a communication failure inside the block as a ``RuntimeError`` naming the peers.

    Args:
        what: The step being run, e.g. ``"pipeline schedule step 12"``.
        context: This rank and its peers.

    Raises:
        RuntimeError: chained to the original error, if the block failed to communicate.
    """
    try:
        yield
    except Exception as err:
        if not is_communication_failure(err):
            raise
        raise RuntimeError(describe_failure(what, context, err)) from err


def describe_failure(what: str, context: CommContext, err: BaseException) -> str:
    """The message :func:`communication_guard` raises."""
    stages = "/".join(map(str, context.stages)) or "none (released)"
    peers = "; ".join(context.peers.values()) or "no peers"
    timeout = f"{context.timeout.total_seconds():g} s" if context.timeout is not None else "the default"
    return (
        f"DynMo: rank {context.rank} (stage {stages}) lost contact with a peer during {what}. It exchanges "
        f"data with: {peers}. One of these ranks died or stalled (a stall is reported after the "
        f"process-group timeout of {timeout}); check its log. Original error: {type(err).__name__}: {err}"
    )
