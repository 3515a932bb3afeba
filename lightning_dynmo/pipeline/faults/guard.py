"""Make a failure inside a communicating step say which rank failed, where, and why.

Read in this order: :class:`CommContext` (who this rank is; cheap to build, described only on error),
:func:`communication_guard` (wraps one communicating step), then what it does with the two kinds of
failure: :func:`report_own_error` and :func:`describe_failure`; last :class:`RemoteFailure` (what a
rank broadcasts instead of a result it failed to compute).

Two kinds of failure reach a guarded step (a schedule step, a migration, a collective of the strategy):

- This rank's own error: a layer raised (torch wraps it as ``[Stage 1] failed to run forward`` or
  ``Failed to run stage backward``, the cause 30 frames up), a loss got a bad shape. The guard re-raises
  the *original* exception (its type and message last in the traceback, where users read first) with a
  note naming this rank, the unit and stage it came from and the step, and posts it on the run's
  :class:`FailureBoard` for the others.
- A failed exchange: the peer died (``Connection closed by peer``) or never came (a timeout: gloo and
  NCCL honour the process-group ``timeout`` for receives and collectives alike, so no rank waits
  forever). The guard raises a :class:`CommunicationError` naming this rank's stage and peers and, from
  the board, the rank that failed first and its error, or what the other ranks were waiting in: two
  ranks in different collectives (``apply_placement`` or ``strategy.broadcast`` called on one rank only)
  time out together and each names the other's call.

Nothing is described unless something fails: a guarded step that succeeds costs a ``try`` block.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import NoReturn

import torch.distributed as dist
from torch import nn

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline.faults.failure_board import REPORT_GRACE_S, FailureBoard, FailureRecord
from lightning_dynmo.pipeline.faults.stall_watch import StallWatch
from lightning_dynmo.pipeline.placement.layout import RankGrid, StageStyle, stages_of_pipeline_rank

log = logging.getLogger(__name__)

__all__ = [
    "CommContext",
    "CommunicationError",
    "RemoteFailure",
    "communication_guard",
    "describe_failure",
    "describe_peers",
    "is_communication_failure",
    "report_interrupt",
    "report_own_error",
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
# torch.distributed.pipelining wraps an error raised in a stage's forward or backward in a RuntimeError with
# one of these texts (lower case), the original error as its cause.
_TORCH_STAGE_WRAPPERS = ("failed to run forward", "failed to run stage backward")
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
# At most this many peers are listed in a message (the rest are counted).
_MAX_PEERS_LISTED = 8
# After a closed connection, how long to wait for the peers' records: gloo closes a pair as soon as one end
# times out, so the peer that closed it may still be posting what it was waiting in.
_CLOSED_GRACE_S = 3.0


@dataclass(frozen=True)
class CommContext:
    """Who this rank is and whom it talks to, for error messages; built per step, described on error only.

    Attributes:
        rank: This rank's global rank.
        stages: The placement stage(s) this rank runs (empty once released or before setup).
        peers: ``{global_rank: description}`` of the ranks this step exchanges data with, or a function
            returning it (called only when an error is described: at scale it walks every rank).
        timeout: The process-group timeout (a stalled peer is reported after it).
        board: The run's failure board (``None``: no records are posted or read).
        units: A function returning this rank's units by name (``"layers.3"``), to name the unit an error
            came from (called on error only).
        watch: Posts the call this rank is in once it stalls (``None``: nothing is posted until it fails).
        timeout_name: What ``timeout`` is called in messages, e.g. DynMo's control-plane timeout.
    """

    rank: int
    stages: tuple[int, ...]
    peers: Mapping[int, str] | Callable[[], Mapping[int, str]]
    timeout: timedelta | None
    board: FailureBoard | None = None
    units: Callable[[], Mapping[str, nn.Module]] | None = None
    watch: StallWatch | None = None
    timeout_name: str = "the process-group timeout"

    def peer_map(self) -> Mapping[int, str]:
        """The peers, described (the expensive part, deferred until an error)."""
        return self.peers() if callable(self.peers) else self.peers

    @property
    def stage_text(self) -> str:
        return "/".join(map(str, self.stages)) or "none"


class CommunicationError(RuntimeError):
    """A guarded step could not exchange data with its peers; the message names them and the cause."""


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
    grid: RankGrid | None,
    placement: Placement | None,
    style: StageStyle,
) -> dict[int, str]:
    """The other active ranks, each described by its replica and the placement stage(s) it runs.

    Args:
        rank: This rank (left out).
        active_ranks: Global ranks taking part in training.
        grid: The rank grid in use (``None`` before it is known: ranks are then named only).
        placement: The placement in use (``None`` before setup: ranks are then named only).
        style: How stages map onto pipeline ranks.
    """
    peers = {}
    for r in active_ranks:
        if r == rank:
            continue
        if grid is None or placement is None:
            peers[r] = f"global rank {r}"
            continue
        prank = grid.pipeline_rank(r)
        stages = stages_of_pipeline_rank(prank, placement.num_stages, grid.pipeline_size, style)
        where = f" of replica {grid.data_parallel_rank(r)}" if grid.data_parallel_size > 1 else ""
        peers[r] = f"stage {'/'.join(map(str, stages))}{where} on global rank {r}"
    return peers


@contextmanager
def communication_guard(what: str, context: CommContext) -> Generator[None, None, None]:
    """Make a failure inside the block name the rank that failed and its error.

    Args:
        what: The step being run, e.g. ``"a schedule step"`` or ``"strategy.broadcast"``.
        context: This rank and its peers.

    Raises:
        CommunicationError: chained to the transport error, if the block failed to communicate.
        Exception: this rank's own error, unchanged in type and message, with a note naming the rank,
            unit, stage and step (torch's forward and backward wrappers are taken off).
    """
    try:
        with context.watch.watching(what, context.stage_text) if context.watch else nullcontext():
            yield
    except CommunicationError:
        raise  # an inner guard described it already
    except Exception as err:
        if is_communication_failure(_unwrap_stage_error(err)):
            raise CommunicationError(_describe_with_board(what, context, err)) from err
        own = report_own_error(what, context, err)
        if own is err:
            raise
        raise own  # noqa: B904  # the original error, instead of torch's wrapper around it


def report_own_error(what: str, context: CommContext, err: Exception) -> BaseException:
    """Note on this rank's own error where it came from, post it on the board, and return what to raise.

    Returns:
        The original exception (``err``, or the cause torch wrapped in a stage's forward or backward),
        with a note ``DynMo: raised on rank R in layers.K (stage S) during <what>``.
    """
    if getattr(err, "_dynmo_reported", False):
        return err
    cause = _unwrap_stage_error(err)
    unit, stage = _origin(cause, context)
    stages = str(stage) if stage is not None else context.stage_text
    where = f" in {unit} (stage {stages})" if unit else (f" in stage {stages}" if context.stages else "")
    cause.add_note(f"DynMo: raised on rank {context.rank}{where} during {what}.")
    if cause is not err:
        cause.__suppress_context__ = True  # the wrapper only repeats it
    cause._dynmo_reported = True  # type: ignore[attr-defined]  # outer guards pass it on as is
    if context.board is not None:
        error = f"{type(cause).__name__}: {cause}"
        context.board.post(FailureRecord(context.rank, stages, what, "raised", error[:500], unit))
    return cause


def report_interrupt(err: BaseException, what: str, context: CommContext) -> None:
    """Post an error that stops this rank outside a guarded step (a callback, the data loader).

    Failed exchanges (symptoms of another rank's failure, not causes) and non-errors (``SystemExit`` such
    as Lightning's ``SIGTERMException``, ``KeyboardInterrupt``) are not posted.
    """
    if isinstance(err, Exception) and not is_communication_failure(_unwrap_stage_error(err)):
        report_own_error(what, context, err)


def describe_failure(
    what: str,
    context: CommContext,
    err: BaseException,
    *,
    first: FailureRecord | None = None,
    reports: Mapping[int, FailureRecord] | None = None,
    gone: str | None = None,
) -> str:
    """The message of the :class:`CommunicationError` the guard raises.

    Args:
        what: The step that failed.
        context: This rank and its peers.
        err: The transport error.
        first: The run's first raised error, if another rank posted one: it leads the message.
        reports: What other ranks posted when their own exchanges failed.
        gone: Which peer is gone and how it is known (its process no longer exists, or the store it
            hosted no longer answers), when no rank posted anything.
    """
    me = f"rank {context.rank} (stage {context.stage_text})"
    timeout = f"{context.timeout.total_seconds():g} s" if context.timeout is not None else "the default"
    peers = f"It exchanges data with: {_peer_list(context)}."
    waiting = [r for r in (reports or {}).values() if r.kind == "waiting"]
    if first is not None:
        text = (
            f"DynMo: {first.describe()}; so {me} lost contact with a peer during {what}. {peers} See rank "
            f"{first.rank}'s traceback for the cause."
        )
    elif waiting:
        text = (
            f"DynMo: {me} failed in {what} while {'; '.join(r.describe() for r in waiting)}. {peers} "
            "The ranks were in different calls: every active rank must make the same collective calls in "
            "the same order (apply_placement, strategy.broadcast / barrier / reduce / all_gather and "
            "checkpoint saving are collective: call them on every rank, not under `if "
            "trainer.is_global_zero`); a call made on some ranks only waits for the others until "
            f"{context.timeout_name} of {timeout}."
        )
    elif gone is not None:
        text = (
            f"DynMo: {gone}; so {me} lost contact with a peer during {what}. {peers} That rank left no "
            "error on the failure board: check its log, or the system log if it was killed."
        )
    else:
        text = (
            f"DynMo: {me} lost contact with a peer during {what}. {peers} One of these ranks died or stalled "
            f"(a stall is reported after {context.timeout_name} of {timeout}); check its log."
        )
    return f"{text} Original error: {type(err).__name__}: {err}"


@dataclass(frozen=True)
class RemoteFailure:
    """Broadcast by a rank in place of a result it failed to compute, so that every rank stops at once.

    Attributes:
        rank: The rank that failed.
        what: What it was computing, e.g. ``"the rebalance decision"``.
        error: ``"KeyError: 'x'"``.
    """

    rank: int
    what: str
    error: str

    @classmethod
    def of(cls, err: BaseException, rank: int, what: str) -> RemoteFailure:
        return cls(rank, what, f"{type(err).__name__}: {err}")

    def raise_here(self) -> NoReturn:
        """Raise, on a rank that received this marker, an error naming the failed rank and its error."""
        raise RuntimeError(
            f"DynMo: rank {self.rank} failed while computing {self.what}: {self.error}. It told every rank "
            f"instead of leaving them waiting; see rank {self.rank}'s traceback for the cause."
        )


def _describe_with_board(what: str, context: CommContext, err: BaseException) -> str:
    board = context.board
    if board is None:
        return describe_failure(what, context, err)
    kind = FailureRecord(context.rank, context.stage_text, what, "waiting", f"{type(err).__name__}: {err}")
    board.post(kind)
    first = board.first_failure(excluding=context.rank)
    reports: dict[int, FailureRecord] = {}
    gone = None
    if first is None:
        # A peer that is gone posted what it had to say before it went, or never will: read it, don't wait.
        gone = _gone_peer(context, board)
        # A peer that timed out too posts about now (within one timeout of when *it* started waiting,
        # which under load can be seconds after us); one that closed the connection because it timed
        # out first posts right after closing it (one that raised its own error has posted already).
        grace = REPORT_GRACE_S if _TIMED_OUT.search(str(err)) else _CLOSED_GRACE_S
        reports = board.wait_for(list(context.peer_map())[:_MAX_PEERS_LISTED], 0.0 if gone else grace)
        first = board.first_failure(excluding=context.rank)
        if board.lost and first is None and not reports and context.watch is not None:
            first, reports = context.watch.seen()  # read while this rank was stalled, before the store went
        if gone is None and first is None and not reports:
            gone = _gone_peer(context, board)
    return describe_failure(what, context, err, first=first, reports=reports, gone=gone)


def _gone_peer(context: CommContext, board: FailureBoard) -> str | None:
    """A peer known to be gone: the host of a store that stopped answering, or a process that has ended."""
    peers = context.peer_map()
    host = board.host_rank
    if board.lost and host is not None and host != context.rank:
        return (
            f"{_rank_and_stage(host, peers)} is gone: the store the ranks met through lives in its process "
            "and no longer answers (it exited or was killed)"
        )
    for rank in list(peers)[:_MAX_PEERS_LISTED]:
        pid = board.process_gone(rank)
        if pid is not None:
            return (
                f"{_rank_and_stage(rank, peers)} is gone: its process (pid {pid}) no longer exists (killed "
                "by a signal? SIGKILL, e.g. from the out-of-memory killer, leaves no traceback)"
            )
    return None


def _rank_and_stage(rank: int, peers: Mapping[int, str]) -> str:
    """``rank 1 (stage 1)`` (with its replica, if any) from a peer's description."""
    described = peers.get(rank, "")
    if not described.startswith("stage "):
        return f"rank {rank}"
    return f"rank {rank} ({described.replace(f' on global rank {rank}', '')})"


def _peer_list(context: CommContext) -> str:
    peers = list(context.peer_map().values())
    if not peers:
        return "no peers"
    more = len(peers) - _MAX_PEERS_LISTED
    return "; ".join(peers[:_MAX_PEERS_LISTED]) + (f"; and {more} more" if more > 0 else "")


def _unwrap_stage_error(err: Exception) -> BaseException:
    cause: BaseException = err
    while (
        isinstance(cause, RuntimeError)
        and any(wrapper in str(cause).lower() for wrapper in _TORCH_STAGE_WRAPPERS)
        and cause.__cause__ is not None
    ):
        cause = cause.__cause__
    return cause


def _origin(err: BaseException, context: CommContext) -> tuple[str, int | None]:
    """The unit (``"layers.3"``, ``""`` if unknown) and torch stage index an error was raised in.

    Walks the frames the error passed through; the innermost frame whose ``self`` is one of this rank's
    units names the unit, the innermost torch ``PipelineStage`` frame names the stage.
    """
    try:
        by_id = {id(m): name for name, m in context.units().items()} if context.units is not None else {}
    except Exception:  # e.g. before setup: name the stage only
        by_id = {}
    unit, stage = "", None
    tb: TracebackType | None = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in by_id:
            unit = by_id[id(owner)]
        elif hasattr(owner, "submod") and isinstance(index := getattr(owner, "stage_index", None), int):
            stage = index
        tb = tb.tb_next
    return unit, stage
