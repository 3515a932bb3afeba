"""The control plane's exchanges on real gloo ranks: one collective each, results as the loops gave."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_dynmo.callback.control_plane import exchange_events, exchange_rows, pack_events
from lightning_dynmo.pipeline.placement.groups import check_same_on_all_ranks
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed


def _exchanges(rank: int, world_size: int) -> dict[str, Any]:
    calls: list[str] = []
    names = ("all_gather_object", "all_gather", "all_reduce", "broadcast_object_list", "gather", "broadcast")
    real = {name: getattr(dist, name) for name in names}

    def counting(name: str) -> Any:
        return lambda *args, **kwargs: (calls.append(name), real[name](*args, **kwargs))[1]

    for name in real:
        setattr(dist, name, counting(name))
    try:
        shared = {"kind": "pruned", "layers": [0], "step": 1, "detail": ""}  # every rank saw this one
        own = {"kind": "custom", "layers": [rank], "step": 1, "detail": f"rank {rank}"}
        payload = pack_events([shared, own] if rank != 1 else [])
        sizes = exchange_rows(torch.tensor([float(len(payload))]), list(range(world_size)), None)
        calls[:] = []  # the callback's per-step rows carry the sizes: not counted here
        lengths = [int(n) for n in sizes[:, 0].tolist()]
        events = exchange_events(payload, lengths, list(range(world_size)), None)
        event_calls, calls[:] = list(calls), []
        check_same_on_all_ranks("0-1|2-3", list(range(world_size)), None, "same")
        same_calls, calls[:] = list(calls), []
        error = ""
        try:
            check_same_on_all_ranks("0-1|2-3" if rank else "0-2|3-3", list(range(world_size)), None, "placed")
        except ValueError as err:
            error = str(err)
        return {"events": events, "event_calls": event_calls, "same_calls": same_calls, "error": error}
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def test_events_and_agreements_take_one_collective_each(tmp_path: Any) -> None:
    results = run_distributed(_exchanges, 3, tmp_path)
    shared = {"kind": "pruned", "layers": [0], "step": 1, "detail": ""}
    expected = [
        shared,
        {"kind": "custom", "layers": [0], "step": 1, "detail": "rank 0"},
        {"kind": "custom", "layers": [2], "step": 1, "detail": "rank 2"},
    ]
    for res in results:
        assert res["events"] == expected, "every rank keeps every distinct event, in rank order"
        assert res["event_calls"] == ["gather", "broadcast"], "one row exchange, no object all-gather"
        assert res["same_calls"] == ["all_reduce"], "equal values: one digest all-reduce, nothing gathered"
        # Negative control: differing values are caught, and every rank names each rank's value.
        assert (
            "placed on different ranks (rank 0: '0-2|3-3', rank 1: '0-1|2-3', rank 2: '0-1|2-3')"
            in (res["error"])
        )


def _rows(rank: int, world_size: int) -> dict[str, Any]:
    calls: list[str] = []
    names = ("all_gather", "gather", "broadcast")
    real = {name: getattr(dist, name) for name in names}
    for name in real:
        setattr(dist, name, lambda *a, _n=name, **k: (calls.append(_n), real[_n](*a, **k))[1])
    try:
        mine = torch.tensor([float(rank), 10.0 * rank, -1.0], dtype=torch.float64)
        world = exchange_rows(mine, list(range(world_size)), None)
        world_calls, calls[:] = list(calls), []
        active = [1, 2]  # a subgroup whose first rank is global rank 1
        group = dist.new_group(active)
        part = exchange_rows(mine, active, group).tolist() if rank in active else None
        return {"world": world.tolist(), "world_calls": world_calls, "part": part}
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def test_cpu_rows_are_gathered_on_the_first_rank_and_broadcast_in_rank_order(tmp_path: Any) -> None:
    results = run_distributed(_rows, 3, tmp_path)
    expected = [[float(r), 10.0 * r, -1.0] for r in range(3)]
    for rank, res in enumerate(results):
        assert res["world"] == expected
        assert res["world_calls"] == ["gather", "broadcast"], "a star, not gloo's ring all-gather"
        assert res["part"] == (expected[1:] if rank else None), "the subgroup's rows, its first rank the root"
