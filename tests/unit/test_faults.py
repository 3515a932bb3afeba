"""Fault guard: communication failures are re-raised naming the peers; other errors pass unchanged."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline.faults import (
    CommContext,
    communication_guard,
    describe_peers,
    is_communication_failure,
)
from lightning_dynmo.pipeline.layout import RankGrid

CONTEXT = CommContext(
    rank=0, stages=(0,), peers={1: "stage 1 on global rank 1"}, timeout=timedelta(seconds=7)
)


def test_a_lost_peer_is_reraised_naming_stage_peer_timeout_and_cause() -> None:
    cause = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5000")
    with (
        pytest.raises(RuntimeError, match=r"rank 0 \(stage 0\) lost contact .* during step 3") as info,
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
