"""Failure records shared through the process group's store, so a rank's error names the rank that failed.

Read in this order: :class:`FailureRecord` (one rank's account: where it was and what went wrong),
:class:`FailureBoard` (post and read records; :meth:`FailureBoard.open` per training run).

When a rank raises, its peers see only a transport error (``Connection closed by peer``) or a timeout:
the cause is on another machine's log. A rank that raises its own error (a layer's ``ValueError``)
posts it here first, and a rank whose communication then fails reads it and names that rank and its
error. A rank whose collective times out posts what it was waiting in, and waits a few seconds for the
other ranks' posts: two ranks stuck in *different* calls (``apply_placement`` on one rank only) then
each name the call the other was in.

The board lives in the default process group's store (the file or TCP store the ranks met through),
so posting costs nothing until something fails. Every store access is best effort: a store that is
gone (its host died) leaves the error as the transport reported it, never hides it or hangs on it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Literal

from torch._C._distributed_c10d import Store
from torch.distributed import distributed_c10d

log = logging.getLogger(__name__)

__all__ = ["REPORT_GRACE_S", "FailureBoard", "FailureRecord"]

#: After a timed-out exchange, how long a rank waits at most for its peers' records. Peers that timed out
#: too post within one timeout of when they started waiting, which on a loaded machine can be several
#: seconds after this rank; a dead peer never posts, so this is also the extra delay its error costs.
REPORT_GRACE_S = 15.0
# Store operations on the error path must not wait for the process-group timeout (30 min by default).
_STORE_TIMEOUT = timedelta(seconds=5)
_POLL_S = 0.1
_NAMESPACE = "dynmo/failures"

FailureKind = Literal["raised", "waiting"]


@dataclass(frozen=True)
class FailureRecord:
    """One rank's account of a failure.

    Attributes:
        rank: The global rank that posted it.
        stages: Its placement stage(s), e.g. ``"1"`` or ``"0/3"`` (``"none"`` when it runs none).
        what: The step or call it was in, e.g. ``"a schedule step"`` or ``"apply_placement"``.
        kind: ``"raised"`` (its own error) or ``"waiting"`` (its exchange with a peer failed).
        error: ``"ValueError: ..."`` for a raised error, the transport error for a failed exchange.
        where: For a raised error, the unit that raised it (``"layers.3"``) when known, else ``""``.
    """

    rank: int
    stages: str
    what: str
    kind: FailureKind
    error: str
    where: str = ""

    def describe(self) -> str:
        """One clause for another rank's message, e.g. ``rank 1 (stage 1) raised ValueError: ...``."""
        who = f"rank {self.rank} (stage {self.stages})"
        if self.kind == "waiting":
            return f"{who} was waiting in {self.what}"
        where = f" in {self.where}" if self.where else ""
        return f"{who} failed first: {self.error} (raised{where} during {self.what})"

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str | bytes) -> FailureRecord:
        return cls(**json.loads(text))


class FailureBoard:
    """Failure records of one training run in a ``torch.distributed`` store.

    Args:
        store: The store (``None``: a board that posts and finds nothing).
        prefix: Key prefix of this run (see :meth:`open`).
    """

    def __init__(self, store: Store | None, prefix: str = f"{_NAMESPACE}/0/") -> None:
        self._store = store
        self._prefix = prefix
        self._short_store: Store | None = None

    @classmethod
    def open(cls, world_size: int) -> FailureBoard:
        """The board of a new run on the default process group's store; every rank calls it once per run.

        Each run gets its own keys (a counter in the store), so records of an earlier failed run in the
        same processes are never read as this run's.
        """
        try:
            store = distributed_c10d._get_default_store()
            run = (store.add(f"{_NAMESPACE}/opened", 1) - 1) // max(world_size, 1)
        except Exception as err:  # no store (a single process) or one that refuses: errors stay as they are
            log.debug("DynMo: no failure board (%s: %s)", type(err).__name__, err)
            return cls(None)
        return cls(store, f"{_NAMESPACE}/{run}/")

    def post(self, record: FailureRecord) -> None:
        """Publish this rank's record; a raised error also becomes the run's first failure if none is."""
        store = self._error_path_store()
        if store is None:
            return
        try:
            store.set(self._key(record.rank), record.encode())
            if record.kind == "raised":
                store.compare_set(self._prefix + "first", "", record.encode())
        except Exception as err:
            log.debug("DynMo: could not post a failure record (%s: %s)", type(err).__name__, err)

    def client(self) -> FailureBoard:
        """The same board through a store client of its own (for another thread)."""
        return FailureBoard(self._store, self._prefix)

    def clear(self, rank: int) -> None:
        """Take back rank ``rank``'s record (a wait it posted that ended well)."""
        store = self._error_path_store()
        if store is None:
            return
        try:
            store.delete_key(self._key(rank))
        except Exception as err:
            log.debug("DynMo: could not clear a failure record (%s: %s)", type(err).__name__, err)

    def first_failure(self, excluding: int) -> FailureRecord | None:
        """The run's first raised error, unless rank ``excluding`` (the reader) raised it."""
        record = self._read(self._prefix + "first")
        return record if record is not None and record.rank != excluding else None

    def wait_for(self, ranks: Iterable[int], grace_s: float) -> dict[int, FailureRecord]:
        """The records of ``ranks``, waited for up to ``grace_s`` (less once a first failure is posted)."""
        pending = list(ranks)
        found: dict[int, FailureRecord] = {}
        deadline = time.monotonic() + grace_s
        while pending and self._store is not None:
            for rank in list(pending):
                record = self._read(self._key(rank))
                if record is not None:
                    found[rank] = record
                    pending.remove(rank)
            if not pending or time.monotonic() >= deadline or self._read(self._prefix + "first"):
                break
            time.sleep(_POLL_S)
        return found

    def _key(self, rank: int) -> str:
        return f"{self._prefix}rank{rank}"

    def _read(self, key: str) -> FailureRecord | None:
        store = self._error_path_store()
        if store is None:
            return None
        try:
            if not store.check([key]):  # get() would block until the key exists
                return None
            return FailureRecord.decode(store.get(key))
        except Exception as err:
            log.debug("DynMo: could not read failure record %s (%s: %s)", key, type(err).__name__, err)
            return None

    def _error_path_store(self) -> Store | None:
        # A private client with a short timeout, made on first use (on the error path only): the shared
        # store waits as long as the process group, and a store whose host died must not hold the error.
        if self._store is None or self._short_store is not None:
            return self._short_store or self._store
        try:
            short: Store = self._store.clone()  # type: ignore[attr-defined]  # missing from torch's stubs
            short.set_timeout(_STORE_TIMEOUT)
            self._short_store = short
        except Exception:
            self._short_store = self._store
        return self._short_store
