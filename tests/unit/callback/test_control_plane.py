"""The callback's O(1)-collective exchanges: per-position busy times, event exchange, bounded history."""

from __future__ import annotations

import pytest
import torch

from lightning_dynmo.callback.control_plane import (
    MAX_HISTORY,
    EventInbox,
    PositionIndex,
    busy_per_position,
    exchange_events,
    keep_recent,
    pack_events,
)
from lightning_dynmo.events import DynamismEvent


def _loop_means(busy: list[float], positions: list[int], size: int) -> list[float]:
    sums, counts = [0.0] * size, [0] * size
    for p, b in zip(positions, busy, strict=True):
        sums[p] += b
        counts[p] += 1
    return [s / c for s, c in zip(sums, counts, strict=True) if c]


def test_busy_per_position_equals_the_loop_over_ranks() -> None:
    gen = torch.Generator().manual_seed(0)
    busy = torch.rand(24, generator=gen, dtype=torch.float64)
    positions = torch.arange(24) % 6  # 4 replicas of a 6-stage pipeline
    got = busy_per_position(busy, positions, 6)
    assert got == pytest.approx(_loop_means(busy.tolist(), positions.tolist(), 6), abs=1e-15)
    # Negative control: a wrong rank -> position map gives other means.
    assert got != pytest.approx(_loop_means(busy.tolist(), (torch.arange(24) // 4).tolist(), 6))


def test_busy_per_position_leaves_out_positions_no_rank_holds() -> None:
    assert busy_per_position(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), 2) == [2.0]


def test_busy_per_position_refuses_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match=r"busy has shape \(3,\) but positions has \(2,\)"):
        busy_per_position(torch.ones(3), torch.tensor([0, 1]), 2)


def test_position_index_is_rebuilt_only_when_the_ranks_change() -> None:
    calls: list[int] = []

    def pipeline_rank_of(rank: int) -> int:
        calls.append(rank)
        return rank % 2

    index = PositionIndex(pipeline_rank_of)
    assert index.of((0, 1, 2, 3)).tolist() == [0, 1, 0, 1]
    assert index.of((0, 1, 2, 3)).tolist() == [0, 1, 0, 1]
    assert calls == [0, 1, 2, 3], "the same ranks must not be mapped again"
    assert index.of((0, 1)).tolist() == [0, 1]
    assert calls == [0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize(
    ("ranks", "rank_of", "size"),
    [
        ((0, 1, 2), lambda r: r, 3),  # one rank per position, in order: no reduction
        ((0, 1, 2), lambda r: 2 - r, 3),  # reversed: the means must follow the positions
        ((0, 1, 2, 3), lambda r: r % 2, 2),  # replicas
        ((0, 1), lambda r: r, 3),  # a position no rank holds
    ],
)
def test_position_index_means_equal_the_loop_over_ranks(
    ranks: tuple[int, ...], rank_of: object, size: int
) -> None:
    busy = torch.tensor([0.1, 0.4, 0.2, 0.7][: len(ranks)], dtype=torch.float64)
    positions = [rank_of(r) for r in ranks]  # type: ignore[operator]
    got = PositionIndex(rank_of).means(busy, ranks, size)  # type: ignore[arg-type]
    assert got == pytest.approx(_loop_means(busy.tolist(), positions, size), abs=1e-15)


def test_exchange_events_without_a_group_keeps_distinct_events_in_order() -> None:
    a = {"kind": "pruned", "layers": [1], "step": 3, "detail": ""}
    b = {"kind": "frozen", "layers": [], "step": 3, "detail": "x"}
    payload = pack_events([a, b, dict(a)])
    assert exchange_events(payload, [len(payload)], [0], None) == [a, b]
    assert pack_events([]) == b"" and exchange_events(b"", [0], [0], None) == []


def test_exchange_events_refuses_sizes_that_do_not_match_the_ranks() -> None:
    with pytest.raises(ValueError, match=r"sizes has 1 entries for 2 active ranks"):
        exchange_events(b"", [0], [0, 1], None)


def test_the_inbox_says_whether_an_event_came_while_the_stages_computed() -> None:
    inbox, computing = EventInbox(), [False]
    inbox.add(DynamismEvent("frozen", (0,)))
    assert inbox.mid_step  # before training starts nothing says when the stages compute
    assert inbox.take()[1] and inbox.events == [] and not inbox.mid_step
    inbox.computing = lambda: computing[0]
    inbox.add(DynamismEvent("pruned", (1,)))  # a batch-start hook: the stages have not run yet
    packed, mid_step = inbox.take()
    assert not mid_step
    assert exchange_events(packed, [len(packed)], [0], None) == [DynamismEvent("pruned", (1,)).to_dict()]
    inbox.add(DynamismEvent("pruned", (2,)))
    computing[0] = True
    inbox.add(DynamismEvent("routing", (3,)))  # at the optimizer step: one mid-step event marks them all
    assert inbox.take()[1]
    assert inbox.take() == (b"", False)


def test_keep_recent_drops_the_oldest() -> None:
    records = list(range(10))
    assert keep_recent(records, 4) == 6
    assert records == [6, 7, 8, 9]
    assert keep_recent(records, 4) == 0
    assert MAX_HISTORY >= 100


@pytest.mark.parametrize("limit", [0, -1, 2.5])
def test_keep_recent_refuses_a_bad_limit(limit: object) -> None:
    with pytest.raises(ValueError, match=r"limit=.* must be an integer >= 1"):
        keep_recent([1, 2], limit)  # type: ignore[arg-type]


def test_callback_history_is_capped_when_a_checkpoint_is_loaded() -> None:
    from lightning_dynmo.callback.dynmo_callback import DynMoCallback
    from lightning_dynmo.events import DynamismEvent

    state = DynMoCallback().state_dict()
    del state["dropped_history"]  # a checkpoint written before the cap
    state["events"] = [DynamismEvent("custom", step=i).to_dict() for i in range(MAX_HISTORY + 5)]
    kept = {"reason": "event", "old": "0-1", "new": "0-1", "why": "", "predicted_gain": 0.0}
    kept |= {"profiling_s": 0.0, "decision_s": 0.0, "migration_s": 0.0}
    state["rebalances"] = [{"step": i, "applied": False, **kept} for i in range(MAX_HISTORY + 2)]
    callback = DynMoCallback()
    callback.load_state_dict(state)
    assert len(callback.events) == MAX_HISTORY and callback.events[0].step == 5
    assert len(callback.rebalances) == MAX_HISTORY and callback.rebalances[0].step == 2
    assert callback.state_dict()["dropped_history"] == {"events": 5, "rebalances": 2}
