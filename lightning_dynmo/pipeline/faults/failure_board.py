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
so posting costs nothing until something fails. Every store access is best effort and bounded: the
board talks through a client of its own with a few-second timeout, made when the board is opened (while
the store's host is surely alive: cloning a store whose host died retries for the store's whole
timeout, 30 minutes by default), and gives up on the store at the first failed access (no retry loop).

Under Lightning's launcher and ``srun`` the store is a TCPStore hosted *in rank 0's process*, so it dies
with rank 0; under torchrun the agent hosts it and it outlives every rank. :attr:`FailureBoard.host_rank`
says which: when the board finds its store gone, the rank hosting it is gone (:attr:`FailureBoard.lost`).
Every rank also registers its host name and pid (:meth:`FailureBoard.register`), so a rank whose peer
closed its connection without posting anything can tell a peer process that no longer exists (killed by
a signal, e.g. ``SIGKILL`` from the out-of-memory killer, which leaves no traceback) from one that lives.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Literal, TypeVar

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed import distributed_c10d

log = logging.getLogger(__name__)

__all__ = ["REPORT_GRACE_S", "FailureBoard", "FailureRecord", "store_host_rank"]

#: After a timed-out exchange, how long a rank waits at most for its peers' records. Peers that timed out
#: too post within one timeout of when they started waiting, which on a loaded machine can be several
#: seconds after this rank; a dead peer never posts, so this is also the extra delay its error costs.
REPORT_GRACE_S = 15.0
# Store operations on the error path must not wait for the process-group timeout (30 min by default).
_STORE_TIMEOUT = timedelta(seconds=5)
_POLL_S = 0.1
_NAMESPACE = "dynmo/failures"

FailureKind = Literal["raised", "waiting"]
_T = TypeVar("_T")


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

    def __init__(
        self, store: Store | None, prefix: str = f"{_NAMESPACE}/0/", host_rank: int | None = None
    ) -> None:
        self._store = store
        self._prefix = prefix
        self._host_rank = host_rank
        self._lost = False
        # Made now, while the store's host is alive (see the module docstring); every access goes through it.
        self._short_store: Store | None = _short_client(store) if store is not None else None

    @property
    def host_rank(self) -> int | None:
        """The rank whose process hosts the store (``None``: a store that outlives the ranks, or none)."""
        return self._host_rank

    @property
    def lost(self) -> bool:
        """Whether an access to the store failed: the board gave up on it (its host is gone)."""
        return self._lost

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
        return cls(store, f"{_NAMESPACE}/{run}/", store_host_rank(store))

    def register(self, rank: int) -> None:
        """Record this process's host name and pid as rank ``rank``'s (read by :meth:`process_gone`)."""
        self._access(lambda s: s.set(f"{self._prefix}pid{rank}", f"{socket.gethostname()} {os.getpid()}"))

    def process_gone(self, rank: int) -> int | None:
        """Rank ``rank``'s pid if its process ran on this host and no longer exists, else ``None``.

        ``None`` also when it is unknown (another host, an unregistered rank, the store gone).
        """

        def read(store: Store) -> str | None:
            key = f"{self._prefix}pid{rank}"
            return store.get(key).decode() if store.check([key]) else None

        entry = self._access(read)
        if entry is None:
            return None
        host, pid = entry.rsplit(" ", 1)
        if host != socket.gethostname():
            return None
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return int(pid)
        except OSError:  # alive, another user's
            return None
        return _zombie_pid(int(pid))

    def post(self, record: FailureRecord) -> None:
        """Publish this rank's record; a raised error also becomes the run's first failure if none is."""

        def write(store: Store) -> None:
            store.set(self._key(record.rank), record.encode())
            if record.kind == "raised":
                store.compare_set(self._prefix + "first", "", record.encode())

        self._access(write)

    def client(self) -> FailureBoard:
        """The same board through a store client of its own (for another thread), made now."""
        return FailureBoard(self._store, self._prefix, self._host_rank)

    def clear(self, rank: int) -> None:
        """Take back rank ``rank``'s record (a wait it posted that ended well)."""
        self._access(lambda s: s.delete_key(self._key(rank)))

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
            done = not pending or self._lost or time.monotonic() >= deadline
            if done or self._read(self._prefix + "first"):
                break
            time.sleep(_POLL_S)
        return found

    def _key(self, rank: int) -> str:
        return f"{self._prefix}rank{rank}"

    def _read(self, key: str) -> FailureRecord | None:
        def read(store: Store) -> FailureRecord | None:
            if not store.check([key]):  # get() would block until the key exists
                return None
            return FailureRecord.decode(store.get(key))

        return self._access(read)

    def _access(self, operation: Callable[[Store], _T]) -> _T | None:
        """``operation`` on the short-timeout client; ``None`` once the store failed (it is not retried)."""
        store = self._short_store
        if store is None or self._lost:
            return None
        try:
            return operation(store)
        except Exception as err:
            # Every later access would fail the same way (and log a C++ warning each time): give up on it.
            self._lost = True
            log.debug("DynMo: the failure board's store failed (%s: %s)", type(err).__name__, err)
            return None


def store_host_rank(store: Store) -> int | None:
    """The rank hosting ``store`` when it lives in a rank's process, else ``None``.

    A TCPStore made by ``env://`` initialisation (Lightning's launcher, ``srun``) is hosted by rank 0;
    under torchrun the elastic agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``) and it outlives the ranks,
    as a file store does.
    """
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if not isinstance(store, TCPStore):
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    return 0


def _short_client(store: Store) -> Store:
    # A private client with a short timeout: the shared store waits as long as the process group, and its
    # client is not to be shared between threads. A store that cannot be cloned is used as it is.
    try:
        short: Store = store.clone()  # type: ignore[attr-defined]  # missing from torch's stubs
        short.set_timeout(_STORE_TIMEOUT)
    except Exception as err:
        log.debug("DynMo: the failure board shares its store (%s: %s)", type(err).__name__, err)
        return store
    return short


def _zombie_pid(pid: int) -> int | None:
    """``pid`` if that process has exited but was not reaped yet (it counts as gone), else ``None``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return pid if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X") else None
    except OSError:
        return None
