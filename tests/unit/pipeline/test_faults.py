"""Fault guard: a failed exchange names the peers and the rank that failed first; a rank's own error is
raised as itself, unwrapped from torch's stage wrapper, naming its unit and stage; nothing is described
unless something fails. The failure board and the SIGTERM flag work without a process group."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline.faults.failure_board import FailureBoard, FailureRecord
from lightning_dynmo.pipeline.faults.guard import (
    CommContext,
    CommunicationError,
    RemoteFailure,
    communication_guard,
    describe_peers,
    is_communication_failure,
    report_interrupt,
)
from lightning_dynmo.pipeline.faults.shutdown import SigtermAgreement
from lightning_dynmo.pipeline.placement.layout import RankGrid

CONTEXT = CommContext(
    rank=0, stages=(0,), peers={1: "stage 1 on global rank 1"}, timeout=timedelta(seconds=7)
)


def test_a_lost_peer_is_reraised_naming_stage_peer_timeout_and_cause() -> None:
    cause = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5000")
    with (
        pytest.raises(CommunicationError, match=r"rank 0 \(stage 0\) lost contact .* during step 3") as info,
        communication_guard("step 3", CONTEXT),
    ):
        raise cause
    message = str(info.value)
    assert "stage 1 on global rank 1" in message and "timeout of 7 s" in message
    assert "Connection closed by peer" in message and info.value.__cause__ is cause


def test_errors_that_are_not_communication_pass_through_unchanged() -> None:
    with (
        pytest.raises(ValueError, match=r"^Expected input batch_size") as info,
        communication_guard("s", CONTEXT),
    ):
        raise ValueError("Expected input batch_size (32) to match target batch_size (16).")
    assert info.value.__cause__ is None
    assert info.value.__notes__ == ["DynMo: raised on rank 0 in stage 0 during s."]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError("Timed out waiting 3000ms for recv operation to complete"), True),
        (RuntimeError("Application timeout caused pair closure"), True),
        (dist.DistBackendError("NCCL watchdog"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (KeyError("x"), False),
    ],
)
def test_communication_failures_are_recognised(error: Exception, expected: bool) -> None:
    assert is_communication_failure(error) is expected


def test_peers_are_described_by_stage_and_replica() -> None:
    grid = RankGrid(world_size=4, pipeline_size=2)
    peers = describe_peers(0, (0, 1, 2, 3), grid, Placement.from_sizes([2, 2]), "loop")
    assert peers == {
        1: "stage 1 of replica 0 on global rank 1",
        2: "stage 0 of replica 1 on global rank 2",
        3: "stage 1 of replica 1 on global rank 3",
    }


# -- a rank's own error ------------------------------------------------------------------------------


class Exploding(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("block 3 got NaN")


class TorchLikeStage:
    """Stands in for torch's PipelineStage: it wraps an error of its module like forward_one_chunk does."""

    def __init__(self, submod: nn.Module, stage_index: int) -> None:
        self.submod, self.stage_index = submod, stage_index

    def forward_one_chunk(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.submod(x)
        except Exception as e:
            raise RuntimeError(f"[Stage {self.stage_index}] failed to run forward:\n args: ...") from e


def _context(rank: int, board: FailureBoard | None = None, **kwargs: Any) -> CommContext:
    peers = {1 - rank: f"stage {1 - rank} on global rank {1 - rank}"}
    return CommContext(rank, (rank,), peers, timedelta(seconds=0.3), board, **kwargs)


def test_a_layer_error_wrapped_by_torch_is_raised_as_itself_naming_rank_unit_and_stage() -> None:
    block = Exploding()
    stage = TorchLikeStage(nn.Sequential(nn.Identity(), block), stage_index=1)
    context = _context(1, units=lambda: {"layers.2": nn.Identity(), "layers.3": block})
    with (
        pytest.raises(
            ValueError, match=r"^block 3 got NaN\nDynMo: raised on rank 1 in layers.3 \(stage 1\)"
        ) as info,
        communication_guard("a schedule step", context),
    ):
        stage.forward_one_chunk(torch.zeros(1))
    assert info.value.__notes__ == ["DynMo: raised on rank 1 in layers.3 (stage 1) during a schedule step."]
    assert info.value.__suppress_context__  # torch's wrapper is not shown again


def test_an_error_in_backward_wrapped_by_torch_is_raised_as_itself() -> None:
    def backward_like_torch() -> None:  # torch.distributed.pipelining._backward.stage_backward
        try:
            raise ValueError("grad of layer 3 is NaN")
        except Exception as e:
            raise RuntimeError("\n        Failed to run stage backward:\n        Stage output: ...") from e

    with (
        pytest.raises(ValueError, match=r"^grad of layer 3 is NaN\nDynMo: raised on rank 1 in stage") as info,
        communication_guard("a schedule step", _context(1)),
    ):
        backward_like_torch()
    assert info.value.__suppress_context__  # torch's wrapper is not shown again


def test_a_peer_names_the_rank_that_failed_first_and_its_error() -> None:
    board = FailureBoard(dist.HashStore())
    block = Exploding()
    stage = TorchLikeStage(block, stage_index=1)
    with (
        pytest.raises(ValueError),
        communication_guard("a schedule step", _context(1, board, units=lambda: {"layers.3": block})),
    ):
        stage.forward_one_chunk(torch.zeros(1))
    with (
        pytest.raises(
            CommunicationError,
            match=r"^DynMo: rank 1 \(stage 1\) failed first: ValueError: block 3 got NaN "
            r"\(raised in layers.3 during a schedule step\); so rank 0 \(stage 0\) lost contact with a peer "
            r"during a schedule step\. .*"
            r"See rank 1's traceback",
        ),
        communication_guard("a schedule step", _context(0, board)),
    ):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:5000")


def test_ranks_stuck_in_different_calls_name_each_others_call() -> None:
    board = FailureBoard(dist.HashStore())
    board.post(FailureRecord(1, "1", "a schedule step", "waiting", "RuntimeError: Timed out waiting 300ms"))
    with (
        pytest.raises(
            CommunicationError,
            match=r"rank 0 \(stage 0\) failed in strategy.broadcast\(src=0\) while rank 1 \(stage 1\) was "
            r"waiting in a schedule step\..* same collective calls .* timeout of 0.3 s",
        ),
        communication_guard("strategy.broadcast(src=0)", _context(0, board)),
    ):
        raise RuntimeError("Timed out waiting 300ms for recv operation to complete")
    # rank 1's guard, failing in turn, finds rank 0's record
    record = board.wait_for([0], grace_s=0.0)[0]
    assert record.describe() == "rank 0 (stage 0) was waiting in strategy.broadcast(src=0)"


def test_without_any_record_the_error_says_a_peer_died_or_stalled() -> None:
    with (
        pytest.raises(CommunicationError, match=r"died or stalled .* timeout of 0.3 s"),
        communication_guard("a schedule step", _context(0, FailureBoard(dist.HashStore()))),
    ):
        raise RuntimeError("Connection reset by peer")


def test_peers_and_units_are_described_only_when_a_step_fails() -> None:
    calls: list[str] = []

    def peers() -> dict[int, str]:
        calls.append("peers")
        return {1: "stage 1 on global rank 1"}

    def units() -> dict[str, nn.Module]:
        calls.append("units")
        return {}

    context = CommContext(0, (0,), peers, None, None, units)
    for _ in range(3):
        with communication_guard("a schedule step", context):
            pass
    assert calls == []
    with (
        pytest.raises(CommunicationError, match="stage 1 on global rank 1"),
        communication_guard("s", context),
    ):
        raise RuntimeError("Connection closed by peer")
    assert calls == ["peers"]


class BrokenStore:
    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("store host is gone")

        return fail


def test_a_broken_store_neither_raises_nor_hides_the_error() -> None:
    board = FailureBoard(BrokenStore())  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="x"), communication_guard("s", _context(1, board)):
        raise KeyError("x")
    with (
        pytest.raises(CommunicationError, match="died or stalled"),
        communication_guard("s", _context(0, board)),
    ):
        raise RuntimeError("Connection closed by peer")


def test_each_run_reads_only_its_own_records(tmp_path: Path) -> None:
    assert FailureBoard.open(1).first_failure(excluding=-1) is None  # no process group: an inert board
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        first_run = FailureBoard.open(world_size=1)
        first_run.post(FailureRecord(0, "0", "a schedule step", "raised", "ValueError: old"))
        assert first_run.first_failure(excluding=1) is not None
        assert FailureBoard.open(world_size=1).first_failure(excluding=1) is None
    finally:
        dist.destroy_process_group()


def test_an_interrupt_is_posted_only_when_it_is_this_ranks_own_error() -> None:
    board = FailureBoard(dist.HashStore())
    for symptom in (RuntimeError("Connection closed by peer"), SystemExit(), KeyboardInterrupt()):
        report_interrupt(symptom, "Trainer.fit", _context(1, board))
    assert board.first_failure(excluding=0) is None
    err = ValueError("bad batch")
    report_interrupt(err, "Trainer.fit", _context(1, board))
    assert err.__notes__ == ["DynMo: raised on rank 1 in stage 1 during Trainer.fit."]
    first = board.first_failure(excluding=0)
    assert first is not None and first.describe() == (
        "rank 1 (stage 1) failed first: ValueError: bad batch (raised during Trainer.fit)"
    )


def test_a_remote_failure_names_the_rank_and_its_error() -> None:
    marker = RemoteFailure.of(KeyError("stage 7"), rank=0, what="the rebalance decision at step 4")
    with pytest.raises(
        RuntimeError,
        match=r"^DynMo: rank 0 failed while computing the rebalance decision at step 4: KeyError: 'stage 7'",
    ):
        marker.raise_here()


def test_sigterm_is_noted_without_communicating_forwarded_once_and_agreed_later() -> None:
    forwarded: list[int] = []
    flag = SigtermAgreement(forward=forwarded.append)
    assert not flag.agree(None, torch.device("cpu"))
    flag.handle(15)
    flag.handle(15)
    assert forwarded == [15]  # like Lightning: the launcher passes on the first SIGTERM only
    assert flag.noted and flag.agree(None, torch.device("cpu"))  # without a process group: this rank's flag


def test_a_settled_boundary_is_agreed_once_without_this_rank_s_flag() -> None:
    flag = SigtermAgreement()
    assert flag.flag == 0.0
    flag.settle(True)  # another rank's flag, gathered by a batch-end exchange
    assert flag.agree(None, torch.device("cpu"))
    assert not flag.agree(None, torch.device("cpu")), "a settled agreement serves one boundary only"
    flag.handle(15)
    assert flag.flag == 1.0
    flag.settle(False)  # signalled after the exchange: the next boundary's exchange carries it
    assert not flag.agree(None, torch.device("cpu"))
    assert flag.agree(None, torch.device("cpu"))
