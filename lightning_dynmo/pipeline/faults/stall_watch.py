"""Post what this rank is waiting in once a guarded call stalls, so a peer that times out can name it.

A rank stuck in a receive cannot say anything until its own (possibly 30-minute) timeout fires, yet the
peer whose shorter control-plane agreement times out first wants to name the call that rank is in (a call
made on one rank only leaves the other in a schedule step). :class:`StallWatch` is a daemon thread that
looks, every fraction of a second, at the guarded call this rank is in (the guard records it in memory:
no I/O on the training path) and, once that call has lasted ``after_s``, posts a ``"waiting"`` record on
the :class:`~lightning_dynmo.pipeline.faults.failure_board.FailureBoard`. A call that then finishes
normally takes its record back; one that fails leaves it (the guard overwrites it with the error).

While its call stays stalled, the watch also reads the board's records of its ``peers`` at every look and
keeps them (:meth:`StallWatch.seen`): when the ranks met through a TCPStore that lives in rank 0's process
(Lightning's launcher, ``srun``), rank 0's exit takes the board with it, and this rank's error can still
name the call rank 0 was stuck in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta

from lightning_dynmo.pipeline.faults.failure_board import FailureBoard, FailureRecord

__all__ = ["StallWatch"]


class StallWatch:
    """A daemon thread posting this rank's stalled call on the failure board.

    Args:
        board: The run's failure board (the watch posts through a client of its own).
        rank: This global rank.
        after_s: How long a guarded call runs before it is posted as a wait.
        peers: Ranks whose records are read (and kept) while this rank's call is stalled.
    """

    def __init__(self, board: FailureBoard, rank: int, after_s: float, peers: Sequence[int] = ()) -> None:
        if not after_s > 0:
            raise ValueError(f"after_s={after_s!r} must be > 0 (seconds before a call counts as stalled).")
        self._board = board.client()  # the main thread's store client is not shared with this thread
        self._rank, self._after_s = rank, after_s
        self._lock = threading.Lock()
        self._calls: list[tuple[str, str, float]] = []  # (what, stages, since): innermost last
        self._posted = False
        self._peers = tuple(peers)
        self._seen: tuple[FailureRecord | None, dict[int, FailureRecord]] = (None, {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dynmo-stall-watch-{rank}", daemon=True)
        self._thread.start()

    @classmethod
    def for_timeout(
        cls, board: FailureBoard, rank: int, timeout: timedelta | None, peers: Sequence[int] = ()
    ) -> StallWatch:
        """A watch that posts well before ``timeout`` (a quarter of it, at most 10 s) fires on a peer."""
        after_s = 10.0 if timeout is None else min(10.0, timeout.total_seconds() / 4)
        return cls(board, rank, after_s, peers)

    def seen(self) -> tuple[FailureRecord | None, dict[int, FailureRecord]]:
        """The run's first failure and the peers' records, as last read while this rank was stalled."""
        with self._lock:
            first, records = self._seen
            return first, dict(records)

    @contextmanager
    def watching(self, what: str, stages: str) -> Generator[None, None, None]:
        """Record that this rank is in ``what`` for the duration of the block."""
        with self._lock:
            self._calls.append((what, stages, time.monotonic()))
        failed = True
        try:
            yield
            failed = False
        finally:
            with self._lock:
                self._calls.pop()
                if self._posted and not failed:
                    self._board.clear(self._rank)  # it was slow, not stuck: no record of it stays
                self._posted = self._posted and failed

    def close(self) -> None:
        """Stop the thread (training is over)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        poll_s = min(1.0, self._after_s / 4)
        while not self._stop.wait(poll_s):
            with self._lock:
                if self._posted and self._calls and self._peers:
                    self._read_peers()
                if self._posted or not self._calls:
                    continue
                what, stages, since = self._calls[-1]
                waited = time.monotonic() - since
                if waited >= self._after_s:
                    note = f"no reply for {waited:.0f} s"
                    self._board.post(FailureRecord(self._rank, stages, what, "waiting", note))
                    self._posted = True

    def _read_peers(self) -> None:
        first = self._board.first_failure(excluding=self._rank)
        records = self._board.wait_for(self._peers, grace_s=0.0)
        if first is not None or records:
            self._seen = (first, records)
