"""The callback's exchanges between ranks, a fixed number of collectives whatever the number of ranks.

Read in this order: :func:`exchange_rows` (the per-step row of numbers every rank shares; on gloo a gather
and a broadcast, not gloo's ring), :class:`EventInbox` (a rank's events until that row, and whether one came
while its stages computed), :func:`pack_events` and :func:`exchange_events` (what every rank saw, one more
row exchange on the steps that had an event), :func:`broadcast_object` (the decision),
:class:`PositionIndex` and :func:`busy_per_position` (the per-step rows reduced per pipeline position with
tensor ops, no Python loop over ranks; :meth:`PositionIndex.means` skips the reduction when there is
nothing to reduce), then :func:`keep_recent` (the event and rebalance histories a checkpoint keeps, capped).

At 720 ranks a loop over ranks on every step costs milliseconds and a loop of collectives over ranks costs
720 round trips; here every step and every decision costs a fixed number of collectives, each carrying a
few bytes per rank at most. All of them run on the strategy's *control group*, whose timeout is short
(``DynMoStrategy(control_timeout=...)``): ranks reach them within a step of each other.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_dynmo.events import DynamismEvent

__all__ = [
    "MAX_HISTORY",
    "EventInbox",
    "PositionIndex",
    "broadcast_object",
    "busy_per_position",
    "exchange_events",
    "exchange_rows",
    "keep_recent",
    "pack_events",
]

#: The event and rebalance histories keep at most this many records each (the most recent).
MAX_HISTORY = 1024


def exchange_rows(
    row: torch.Tensor, active_ranks: Sequence[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """One row per active rank, in ``active_ranks`` order (plain collectives over ``group``, no autograd).

    Rows on the GPU go through one ``all_gather``. Rows on the CPU (gloo) are gathered on the group's
    first rank and broadcast back: gloo's all-gather is a ring of ``n - 1`` hops, one after another, while
    a gather and a broadcast are each one round between the first rank and every other. On a 2-core
    machine with 16 gloo ranks that is about 11 ms a call against 37 through the ring (wall time,
    2026-11-28; ``python -m benchmarks.control_plane`` measures both).
    """
    if not (dist.is_available() and dist.is_initialized()) or len(active_ranks) == 1:
        return row.reshape(1, -1).cpu()
    if row.device.type == "cpu":
        rows = torch.empty((len(active_ranks), *row.shape), dtype=row.dtype)
        first = dist.get_rank(group) == 0
        dist.gather(row, list(rows.unbind()) if first else None, group=group, group_dst=0)
        dist.broadcast(rows, group=group, group_src=0)
        return rows
    gathered = [torch.empty_like(row) for _ in active_ranks]
    dist.all_gather(gathered, row, group=group)
    return torch.stack(gathered).cpu()


class EventInbox:
    """This rank's dynamism events since its last per-step exchange, and whether one came mid-step.

    An event that came before this rank's stages computed anything in a step (from a batch-start hook, or
    after the previous step's exchange) changed the model that step runs: the step's loads show it. One
    that came once they had computed (at the optimizer step, at the batch end) shows from the next step.
    The per-step row carries which, so that when no rank had one mid-step the event is judged on its own
    step's loads, a step sooner (:meth:`~lightning_dynmo.callback.window.ProfilingWindow.observe_loads`).

    Attributes:
        events: The events not yet exchanged, oldest first.
        mid_step: Whether one of them came while this rank's stages were computing.
        computing: Whether this rank's stages have run in the current step
            (:attr:`~lightning_dynmo.profiling.StageBusyTimer.ran`); ``None`` (before training starts):
            every event counts as mid-step.
    """

    def __init__(self) -> None:
        self.events: list[DynamismEvent] = []
        self.mid_step = False
        self.computing: Callable[[], bool] | None = None

    def add(self, event: DynamismEvent) -> None:
        """Keep ``event`` (the bus's subscriber) and note whether the stages were computing."""
        self.events.append(event)
        self.mid_step = self.mid_step or self.computing is None or self.computing()

    def take(self) -> tuple[bytes, bool]:
        """The events packed for :func:`exchange_events` and whether one came mid-step; empties the inbox."""
        packed, mid_step = pack_events([e.to_dict() for e in self.events]), self.mid_step
        self.events.clear()
        self.mid_step = False
        return packed, mid_step


def pack_events(events: Sequence[Mapping[str, Any]]) -> bytes:
    """This rank's new events as bytes for :func:`exchange_events` (``b""`` when there are none).

    Their length rides in the per-step row every rank already shares, so the exchange needs no size round.

    Args:
        events: :meth:`~lightning_dynmo.events.DynamismEvent.to_dict` dicts.
    """
    return pickle.dumps([dict(e) for e in events], protocol=pickle.HIGHEST_PROTOCOL) if events else b""


def exchange_events(
    payload: bytes,
    sizes: Sequence[int],
    active_ranks: Sequence[int],
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Every rank's events, in ``active_ranks`` order, each distinct event once; collective over ``group``.

    Each rank's :func:`pack_events` bytes, padded to the longest, go through one :func:`exchange_rows`
    (on gloo a gather and a broadcast; before 2026-11-27 an ``all_gather_object``, two of gloo's ring
    all-gathers, about 55 ms a call at 16 ranks on 2 cores). Data-parallel replicas report the same event
    (the same layers pruned at the same step) from every replica: an event equal to one already listed is
    dropped, so the history grows with what happened, not with the number of replicas.

    Args:
        payload: This rank's :func:`pack_events`.
        sizes: Every active rank's payload length, in ``active_ranks`` order (from the per-step rows).
        active_ranks: The ranks of ``group``, in group rank order.
        group: The active ranks' group (``None``: the default group).
        device: Where the bytes travel: the rank's device (NCCL needs CUDA tensors); ``None``: the CPU.

    Raises:
        ValueError: if ``sizes`` does not give one length per active rank.
    """
    if len(sizes) != len(active_ranks):
        raise ValueError(
            f"sizes has {len(sizes)} entries for {len(active_ranks)} active ranks; give one payload length "
            "per active rank, in the order of active_ranks."
        )
    width = max(sizes, default=0)
    if width == 0:
        return []
    row = torch.zeros(width, dtype=torch.uint8, device=device)
    if payload:
        row[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = exchange_rows(row, active_ranks, group)
    seen: set[str] = set()
    events = []
    for i, size in enumerate(sizes):
        for event in pickle.loads(rows[i, :size].numpy().tobytes()) if size else []:
            key = repr(sorted(event.items()))
            if key not in seen:
                seen.add(key)
                events.append(dict(event))
    return events


class PositionIndex:
    """The pipeline position of every active rank as a tensor, rebuilt only when the active ranks change.

    Args:
        pipeline_rank_of: Global rank -> pipeline position (``strategy.pipeline_rank_of``).
    """

    def __init__(self, pipeline_rank_of: Callable[[int], int]) -> None:
        self._pipeline_rank_of = pipeline_rank_of
        self._ranks: tuple[int, ...] | None = None
        self._positions = torch.zeros(0, dtype=torch.long)
        self._in_order = False

    def of(self, active_ranks: Sequence[int]) -> torch.Tensor:
        """``positions[i]``: the pipeline position of ``active_ranks[i]``."""
        ranks = tuple(active_ranks)
        if ranks != self._ranks:
            order = [self._pipeline_rank_of(r) for r in ranks]
            self._positions = torch.tensor(order, dtype=torch.long)
            self._ranks = ranks
            self._in_order = order == list(range(len(order)))  # one rank per position, in position order
        return self._positions

    def means(self, values: torch.Tensor, active_ranks: Sequence[int], pipeline_size: int) -> list[float]:
        """:func:`busy_per_position` of ``values`` (one per active rank); without replicas, no reduction."""
        positions = self.of(active_ranks)
        if self._in_order and len(positions) == pipeline_size and values.shape == positions.shape:
            means: list[float] = values.to(torch.float64).tolist()
            return means
        return busy_per_position(values, positions, pipeline_size)


def busy_per_position(busy: torch.Tensor, positions: torch.Tensor, pipeline_size: int) -> list[float]:
    """Mean busy seconds of each pipeline position over the data-parallel replicas.

    Args:
        busy: One value per active rank (a column of the per-step rows).
        positions: The pipeline position of each active rank (:meth:`PositionIndex.of`).
        pipeline_size: Pipeline positions; a position no active rank holds is left out.
    """
    if busy.shape != positions.shape:
        raise ValueError(
            f"busy has shape {tuple(busy.shape)} but positions has {tuple(positions.shape)}; give one busy "
            "time per active rank, in the order of the positions."
        )
    values = busy.to(torch.float64)
    sums = torch.zeros(pipeline_size, dtype=torch.float64).index_add_(0, positions, values)
    counts = torch.bincount(positions, minlength=pipeline_size)
    held = counts > 0
    means: list[float] = (sums[held] / counts[held]).tolist()
    return means


def keep_recent(records: list[Any], limit: int = MAX_HISTORY) -> int:
    """Drop the oldest entries of ``records`` in place so at most ``limit`` remain; return how many went."""
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit={limit!r} must be an integer >= 1 (the records kept).")
    extra = len(records) - limit
    if extra <= 0:
        return 0
    del records[:extra]
    return extra


def broadcast_object(obj: Any, src: int, active_ranks: Sequence[int], group: dist.ProcessGroup | None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (``active_ranks``, in order)."""
    if not (dist.is_available() and dist.is_initialized()) or len(active_ranks) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
