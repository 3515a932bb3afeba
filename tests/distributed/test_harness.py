"""The harness itself: results by rank, every failing rank's traceback, no hang on a blocked peer."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed


def _rank_info(rank: int, world_size: int, offset: int) -> tuple[int, int, int, int]:
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return rank, world_size, int(t), torch.get_num_threads()


def _rank1_fails_while_rank0_waits(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one broke on purpose")
    dist.recv(torch.empty(1), src=1)  # would block until the process-group timeout


def _rank0_fails_while_rank1_stalls(rank: int, world_size: int) -> None:
    if rank == 0:
        raise RuntimeError("rank zero broke on purpose")
    time.sleep(600)  # a stalled peer that never reports


def _everyone_stalls(rank: int, world_size: int) -> None:
    time.sleep(600)


def test_results_come_back_by_rank_with_one_thread(tmp_path):
    assert run_distributed(_rank_info, 3, tmp_path, args=(10,)) == [(r, 3, 33, 1) for r in range(3)]


def test_stalled_peer_of_a_failed_rank_is_killed_quickly(tmp_path):
    start = time.monotonic()
    stalled = r"rank 1 -----\nno result after another rank failed; process still running \(killed\)"
    with pytest.raises(AssertionError, match=rf"(?s)rank zero broke on purpose.*{stalled}"):
        run_distributed(_rank0_fails_while_rank1_stalls, 2, tmp_path, timeout_s=120)
    assert time.monotonic() - start < 60  # far below the 120 s deadline: it did not wait for the stalled rank


def test_deadline_kills_a_hung_run(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)2 of 2 rank\(s\) failed.*no result after 2 s"):
        run_distributed(_everyone_stalls, 2, tmp_path, timeout_s=2)


def test_failing_rank_traceback_is_shown(tmp_path):
    with pytest.raises(
        AssertionError, match=r"(?s)rank 1 -----\nTraceback.*RuntimeError: rank one broke on purpose"
    ):
        run_distributed(_rank1_fails_while_rank0_waits, 2, tmp_path, timeout_s=120)


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        run_distributed(_rank_info, 0, tmp_path)
    with pytest.raises(ValueError, match=r"timeout_s must be > 0, got -1"):
        run_distributed(_rank_info, 1, tmp_path, timeout_s=-1)


def test_missing_store_directory_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"is not an existing directory; create it first"):
        run_distributed(_rank_info, 2, tmp_path / "missing", args=(0,))
