"""The failure board under a TCPStore hosted in another process: bounded when the host dies, and naming it.

Lightning's launcher and ``srun`` make the ranks meet through a TCPStore that lives in rank 0's process.
A board must make its short-timeout client while that host is alive, give up on the store at its first
failed access (a dead host's client would otherwise log and retry), and let a guard name the rank that is
gone; a peer process that ended is named too. Under torchrun's agent store, nobody's death takes the
store with it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from lightning_dynmo.pipeline.faults.failure_board import FailureBoard, FailureRecord, store_host_rank
from lightning_dynmo.pipeline.faults.guard import CommContext, CommunicationError, communication_guard


def _host(port_queue: Any, stop: Any) -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    port_queue.put(store.port)
    stop.wait(30)


def _context(board: FailureBoard) -> CommContext:
    return CommContext(1, (1,), {0: "stage 0 on global rank 0"}, timedelta(seconds=30), board)


def test_a_board_whose_store_host_died_gives_up_at_once_and_names_the_host() -> None:
    ctx = mp.get_context("fork")
    ports, stop = ctx.Queue(), ctx.Event()
    host = ctx.Process(target=_host, args=(ports, stop), daemon=True)
    host.start()
    client = dist.TCPStore("127.0.0.1", ports.get(timeout=60), None, False, timeout=timedelta(minutes=30))
    store = dist.PrefixStore("default_pg", client)
    board = FailureBoard(store, host_rank=store_host_rank(store))
    watch_board = board.client()  # the stall watch's client, made while the host lives too
    assert board.host_rank == 0 and not board.lost
    host.kill()  # what the OOM killer does to rank 0
    host.join()
    start = time.monotonic()
    board.post(FailureRecord(1, "1", "a schedule step", "waiting", "no reply"))  # a set may not notice yet
    with (
        pytest.raises(
            CommunicationError,
            match=r"^DynMo: rank 0 \(stage 0\) is gone: the store the ranks met through lives in its process "
            r"and no longer answers \(it exited or was killed\); so rank 1 \(stage 1\) lost contact with a "
            r"peer during a schedule step\.",
        ),
        communication_guard("a schedule step", _context(board)),
    ):
        raise RuntimeError("Connection closed by peer")
    assert board.lost
    assert watch_board.first_failure(excluding=1) is None
    assert watch_board.wait_for([0], grace_s=60) == {}
    # Before the fix a dead host held the error path for the store's 30-minute timeout.
    assert time.monotonic() - start < 10


def test_a_peer_process_that_ended_is_named_with_its_pid() -> None:
    store = dist.HashStore()  # a store that outlives the ranks: no host to lose
    board = FailureBoard(store, prefix="run/")
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    store.set("run/pid0", f"{socket.gethostname()} {peer.pid}")  # what rank 0's board.register(0) writes
    board.register(1)
    assert store.get("run/pid1").decode() == f"{socket.gethostname()} {os.getpid()}"
    assert board.process_gone(0) is None  # alive
    peer.kill()
    peer.wait()
    assert board.process_gone(0) == peer.pid
    with (
        pytest.raises(
            CommunicationError,
            match=rf"^DynMo: rank 0 \(stage 0\) is gone: its process \(pid {peer.pid}\) no longer exists \("
            r"killed by a signal\? SIGKILL, e.g. from the out-of-memory killer, leaves no traceback\); so "
            r"rank 1 \(stage 1\) lost contact",
        ),
        communication_guard("a schedule step", _context(board)),
    ):
        raise RuntimeError("Connection closed by peer")


def test_only_a_tcp_store_outside_torchruns_agent_is_hosted_by_rank_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert store_host_rank(dist.PrefixStore("default_pg", server)) == 0
    assert store_host_rank(dist.HashStore()) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert store_host_rank(server) is None  # torchrun's agent hosts it: it outlives the ranks


def test_a_store_failure_is_logged_once_and_never_retried(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    class Refusing(dist.HashStore):
        def check(self, keys: list[str]) -> bool:
            calls.append(keys)
            raise RuntimeError("Broken pipe")

    board = FailureBoard(Refusing())
    with caplog.at_level(logging.DEBUG, logger="lightning_dynmo.pipeline.faults.failure_board"):
        for _ in range(3):
            assert board.first_failure(excluding=0) is None
    assert len(calls) == 1 and board.lost


def test_a_gone_peer_that_posted_the_call_it_was_stuck_in_is_named_by_that_call() -> None:
    store = dist.HashStore()
    board = FailureBoard(store, prefix="run/")
    peer = subprocess.Popen([sys.executable, "-c", "pass"])
    peer.wait()
    store.set("run/pid0", f"{socket.gethostname()} {peer.pid}")
    board.post(
        FailureRecord(0, "0", "apply_placement", "waiting", "no reply for 100 s")
    )  # rank 0, before it went
    start = time.monotonic()
    with (
        pytest.raises(
            CommunicationError,
            match=r"^DynMo: rank 1 \(stage 1\) failed in a schedule step while rank 0 \(stage 0\) was "
            r"waiting in apply_placement\.",
        ),
        communication_guard("a schedule step", _context(board)),
    ):
        raise RuntimeError("Connection closed by peer")
    assert time.monotonic() - start < 2  # a gone peer's record is read at once, not waited for
