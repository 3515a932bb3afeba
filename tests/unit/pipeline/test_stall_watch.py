"""The stall watch posts the call a rank is stuck in (so a peer timing out elsewhere names it), takes the
record back when the call ends well, leaves it when the call fails; the control group's timeout is the
shorter of the two knobs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_dynmo.pipeline.faults.failure_board import FailureBoard, FailureRecord
from lightning_dynmo.pipeline.faults.guard import CommContext, CommunicationError, communication_guard
from lightning_dynmo.pipeline.faults.stall_watch import StallWatch
from lightning_dynmo.pipeline.placement.groups import DEFAULT_CONTROL_TIMEOUT, control_timeout_of


@pytest.fixture
def board() -> FailureBoard:
    return FailureBoard(dist.HashStore())


@pytest.fixture
def watch(board: FailureBoard) -> Iterator[StallWatch]:
    watch = StallWatch(board, rank=1, after_s=0.2)
    yield watch
    watch.close()


def _until(condition: object, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_a_stalled_call_is_posted_and_taken_back_when_it_ends_well(
    board: FailureBoard, watch: StallWatch
) -> None:
    with watch.watching("a schedule step", "1"):
        assert _until(lambda: 1 in board.wait_for([1], grace_s=0.0)), "the stall was never posted"
        record = board.wait_for([1], grace_s=0.0)[1]
        assert record.describe() == "rank 1 (stage 1) was waiting in a schedule step"
    assert board.wait_for([1], grace_s=0.0) == {}  # a slow call, not a stuck one: no record stays


def test_a_quick_call_posts_nothing(board: FailureBoard, watch: StallWatch) -> None:
    with watch.watching("a schedule step", "1"):
        pass
    time.sleep(0.5)
    assert board.wait_for([1], grace_s=0.0) == {}


def test_a_failed_call_leaves_its_record_for_the_peers(board: FailureBoard, watch: StallWatch) -> None:
    with pytest.raises(RuntimeError, match="Timed out"), watch.watching("a schedule step", "1"):
        assert _until(lambda: 1 in board.wait_for([1], grace_s=0.0))
        raise RuntimeError("Timed out waiting 300ms for recv operation to complete")
    assert board.wait_for([1], grace_s=0.0)[1].what == "a schedule step"


def test_a_peer_timing_out_in_an_agreement_names_the_call_the_stalled_rank_is_in(
    board: FailureBoard, watch: StallWatch
) -> None:
    # rank 1 sits in a schedule step (its watch posts it); rank 0's control agreement times out.
    stalled = CommContext(1, (1,), {0: "stage 0 on global rank 0"}, timedelta(minutes=30), board, watch=watch)
    agreement = CommContext(
        0,
        (0,),
        {1: "stage 1 on global rank 1"},
        timedelta(seconds=0.3),
        board,
        timeout_name="DynMo's control timeout",
    )
    with communication_guard("a schedule step", stalled):
        assert _until(lambda: 1 in board.wait_for([1], grace_s=0.0))
        with (
            pytest.raises(
                CommunicationError,
                match=r"^DynMo: rank 0 \(stage 0\) failed in apply_placement while rank 1 \(stage 1\) was "
                r"waiting in a schedule step\..* until DynMo's control timeout of 0.3 s",
            ),
            communication_guard("apply_placement", agreement),
        ):
            raise RuntimeError("Timed out waiting 300ms for recv operation to complete")


def test_the_watch_refuses_a_threshold_that_is_not_positive(board: FailureBoard) -> None:
    with pytest.raises(ValueError, match=r"after_s=0 must be > 0"):
        StallWatch(board, rank=0, after_s=0)


def test_the_watch_posts_well_before_the_timeout_a_peer_waits() -> None:
    board = FailureBoard(None)
    short = StallWatch.for_timeout(board, 0, timedelta(seconds=4))
    default = StallWatch.for_timeout(board, 0, DEFAULT_CONTROL_TIMEOUT)
    try:
        assert short._after_s == 1.0 and default._after_s == 10.0
    finally:
        short.close()
        default.close()


@pytest.mark.parametrize(
    ("timeout", "control", "expected"),
    [
        (timedelta(minutes=30), DEFAULT_CONTROL_TIMEOUT, DEFAULT_CONTROL_TIMEOUT),
        (timedelta(seconds=4), DEFAULT_CONTROL_TIMEOUT, timedelta(seconds=4)),  # never longer than timeout
        (timedelta(minutes=30), None, timedelta(minutes=30)),  # opted out: the process groups' timeout
        (None, timedelta(seconds=5), timedelta(seconds=5)),
    ],
)
def test_the_control_timeout_is_the_shorter_of_the_two(
    timeout: timedelta | None, control: timedelta | None, expected: timedelta
) -> None:
    assert control_timeout_of(timeout, control) == expected


def test_the_default_control_timeout_is_minutes_not_the_process_groups_half_hour() -> None:
    assert timedelta(seconds=30) <= DEFAULT_CONTROL_TIMEOUT <= timedelta(minutes=3)


def test_while_stalled_the_watch_keeps_what_its_peers_posted(board: FailureBoard) -> None:
    # For a store that dies with rank 0 (Lightning's launcher): what rank 0 posted is kept before it goes.
    watch = StallWatch(board, rank=1, after_s=0.2, peers=[0])
    try:
        assert watch.seen() == (None, {})
        board.post(FailureRecord(0, "0", "apply_placement", "waiting", "no reply for 1 s"))
        assert watch.seen() == (None, {})  # not stalled: nothing is read
        with watch.watching("a schedule step", "1"):
            assert _until(lambda: 0 in watch.seen()[1]), "the peer's record was never read"
        first, records = watch.seen()
        assert first is None and records[0].describe() == "rank 0 (stage 0) was waiting in apply_placement"
    finally:
        watch.close()
