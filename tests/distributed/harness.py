"""Run a function on N forked ranks of a real gloo process group and collect what each returns.

    results = run_distributed(worker, world_size=2, tmp_path=tmp_path, args=(k,))

``worker(rank, world_size, *args)`` runs in a forked process (the test module is already imported, so
module-level helpers and classes pickle by reference) with one torch thread and a gloo group that meets
through a file store in ``tmp_path``. Its return value must be picklable; it is pickled by value (plain
``pickle``, not shared memory), so tensors come back intact after the worker exits.

Failures never hang pytest: every wait has a deadline, a rank that fails makes the harness stop waiting
for the others after a short grace period (they are probably blocked on the failed peer), stragglers are
killed, and one AssertionError shows every rank's traceback or exit code.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_distributed"]

# After the first rank fails, how long the others get to report (they usually fail fast on a closed pair).
_GRACE_AFTER_FAILURE_S = 3.0
# After a rank process died without reporting, how long its queued message may still take to arrive.
_GRACE_AFTER_DEATH_S = 1.0
_MISSING = "no result"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path | str,
    timeout_s: float = 60,
    args: Sequence[Any] = (),
) -> list[Any]:
    """Fork ``world_size`` ranks, run ``fn(rank, world_size, *args)`` in each, return results by rank.

    Args:
        fn: the per-rank function; must be defined at module level of an importable module.
        world_size: number of ranks (>= 1).
        tmp_path: a directory for the file store (pytest's ``tmp_path``); each call uses a fresh file.
        timeout_s: deadline for the whole run; also the process-group timeout, so a collective waiting on
            a dead peer fails inside the worker rather than hanging.
        args: extra positional arguments passed to ``fn`` (inherited through fork, need not pickle).

    Returns:
        The list of per-rank return values, index = rank.

    Raises:
        ValueError: if ``world_size`` < 1, ``timeout_s`` <= 0 or ``tmp_path`` is not a directory.
        AssertionError: if any rank raised, died or did not finish in time; shows every rank's story.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    if not Path(tmp_path).is_dir():
        # gloo's file store would wait for the file forever instead of failing.
        raise ValueError(f"tmp_path={str(tmp_path)!r} is not an existing directory; create it first.")
    store = Path(tmp_path) / f"store-{uuid.uuid4().hex}"
    ctx = mp.get_context("fork")
    results: mp.Queue[tuple[int, bool, bytes]] = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, str(store), timeout_s, tuple(args), results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        outcomes = _collect(procs, results, timeout_s)
    finally:
        _stop(procs, reported={r for r, (ok, msg) in outcomes.items() if ok or not _is_missing(msg)})
    failures = {r: msg for r, (ok, msg) in outcomes.items() if not ok}
    if failures:
        raise AssertionError(_describe(failures, world_size))
    return [outcomes[r][1] for r in range(world_size)]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store: str,
    timeout_s: float,
    args: tuple[Any, ...],
    results: mp.Queue[tuple[int, bool, bytes]],
) -> None:
    torch.set_num_threads(1)
    # A fresh rank: a SIGTERM handler an earlier test left in the parent (torch's elastic launcher installs
    # one) would keep Lightning from installing its own, which it only does over the default handler.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        # gloo's init returns on a rank once its own side of the mesh is up; a rank whose work fails at once
        # would then tear the group down under a peer still connecting ("connectFullMesh ... closed by
        # peer", seen under load). Meet once so every rank starts ``fn`` with the mesh complete.
        dist.barrier()
        value = fn(rank, world_size, *args)
        payload = (rank, True, pickle.dumps(value))
    except BaseException:
        payload = (rank, False, pickle.dumps(traceback.format_exc()))
    results.put(payload)
    # Tear down only after reporting: a peer that failed may never join a final barrier.
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # best effort; the process exits right after
            dist.destroy_process_group()
    results.close()
    results.join_thread()


def _collect(
    procs: list[mp.process.BaseProcess], results: mp.Queue[tuple[int, bool, bytes]], timeout_s: float
) -> dict[int, tuple[bool, Any]]:
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    dead_since: dict[int, float] = {}
    while len(outcomes) < len(procs):
        now = time.monotonic()
        if now > deadline:
            break
        if first_failure is not None and now > first_failure + _GRACE_AFTER_FAILURE_S:
            break
        try:
            rank, ok, blob = results.get(timeout=0.1)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank in outcomes or p.exitcode is None:
                    continue
                since = dead_since.setdefault(rank, now)
                if now - since > _GRACE_AFTER_DEATH_S:
                    outcomes[rank] = (False, f"process died without reporting (exit code {p.exitcode})")
                    first_failure = first_failure or now
            continue
        outcomes[rank] = (ok, pickle.loads(blob))
        if not ok and first_failure is None:
            first_failure = time.monotonic()
    for rank, p in enumerate(procs):
        if rank not in outcomes:
            state = "still running (killed)" if p.is_alive() else f"exited with code {p.exitcode}"
            why = "after another rank failed" if first_failure is not None else f"after {timeout_s} s"
            outcomes[rank] = (False, f"{_MISSING} {why}; process {state}")
    return outcomes


def _is_missing(message: Any) -> bool:
    return isinstance(message, str) and message.startswith(_MISSING)


def _stop(procs: list[mp.process.BaseProcess], reported: set[int]) -> None:
    """Ranks that reported get a shared 2 s to exit on their own; the others (hung) are killed at once."""
    deadline = time.monotonic() + 2.0
    for rank, p in enumerate(procs):
        if rank in reported:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def _describe(failures: dict[int, Any], world_size: int) -> str:
    parts = [f"{len(failures)} of {world_size} rank(s) failed (pid {os.getpid()} harness):"]
    for rank in sorted(failures):
        parts.append(f"\n----- rank {rank} -----\n{failures[rank]}")
    return "".join(parts)
