"""migrate_units on real gloo groups: bitwise state preservation, identical training, bad input.

Every training test compares a run with migrations against the same run without them; the negative
control shows that the comparison catches a migration that loses the optimizer state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.pipeline.migration.transport import UnitMove, migrate_units
from tests.distributed import toy_model as tm
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
Stages = Sequence[Sequence[str]]


def _layers(*idx: int) -> list[str]:
    return [f"layers.{i}" for i in idx]


def _merge(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in per_rank:
        assert not set(merged) & set(part), "a unit is owned by two ranks"
        merged.update(part)
    return merged


# ----------------------------------------------------------------------------------------------------
# Workers (module level so the forked ranks find them)
# ----------------------------------------------------------------------------------------------------


def _train_with_migrations(
    rank: int,
    world_size: int,
    num_layers: int,
    stages: Stages,
    plan: Sequence[tuple[int, Stages]],
    steps: int,
    drop_received_state: bool,
) -> dict[str, Any]:
    """Pipeline training for ``steps`` steps; at step ``s`` of ``plan`` migrate to its stages."""
    torch.set_default_dtype(torch.float64)
    owners = tm.owners_from_stages(stages)
    units = tm.local_units(stages, rank, num_layers)
    optimizer = tm.make_optimizer(units)
    schedule = tm.make_schedule(units, stage_index=rank, num_stages=world_size)
    pending = dict(plan)
    losses, checks, reports = [], [], []
    for step, batch in enumerate(tm.batches(steps)):
        if step in pending:
            new_owners = tm.owners_from_stages(pending[step])
            before = tm.snapshot(units, [optimizer])
            moves = tm.moves_between(owners, new_owners)
            received, report = migrate_units(moves, units, [optimizer], device=CPU)
            if drop_received_state:  # the negative control: a migration that loses optimizer state
                for p in (p for m in received.values() for p in m.parameters()):
                    optimizer.state.pop(p, None)
            units = {n: m for n, m in {**units, **received}.items() if new_owners[n] == rank}
            owners = new_owners
            checks.append((before, tm.snapshot(units, [optimizer])))
            reports.append(report)
            schedule = tm.make_schedule(units, stage_index=rank, num_stages=world_size)
        losses.append(tm.pipeline_step(schedule, optimizer, batch))
    return {"losses": losses, "final": tm.snapshot(units, [optimizer]), "checks": checks, "reports": reports}


def _run(tmp_path: Any, world_size: int, num_layers: int, stages: Stages, plan: Any, steps: int, drop=False):
    results = run_distributed(
        _train_with_migrations,
        world_size,
        tmp_path,
        args=(num_layers, stages, plan, steps, drop),
    )
    return results


def _assert_checks_hold(results: Sequence[dict[str, Any]]) -> None:
    """Before/after snapshots of every migration, gathered over all ranks, are bitwise equal."""
    num_migrations = len(results[0]["checks"])
    assert num_migrations > 0
    for i in range(num_migrations):
        before = _merge([r["checks"][i][0] for r in results])
        after = _merge([r["checks"][i][1] for r in results])
        tm.assert_same(before, after)


def _max_param_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    keys = [k for k in a if k.startswith("param:")]
    assert keys and sorted(keys) == sorted(k for k in b if k.startswith("param:"))
    return max(float((a[k] - b[k]).abs().max()) for k in keys)


# ----------------------------------------------------------------------------------------------------
# Training equivalence (2 ranks)
# ----------------------------------------------------------------------------------------------------

STAGES_2 = [["embed", *_layers(0, 1)], [*_layers(2, 3), "head"]]
# One layer forward, then several back.
PLAN_2 = [
    (2, [["embed", "layers.0"], [*_layers(1, 2, 3), "head"]]),
    (4, [["embed", *_layers(0, 1, 2)], ["layers.3", "head"]]),
]


def test_migration_is_bitwise_and_training_continues_identically(tmp_path):
    moved = _run(tmp_path, 2, 4, STAGES_2, PLAN_2, steps=6)
    static = _run(tmp_path, 2, 4, STAGES_2, [], steps=6)

    _assert_checks_hold(moved)
    # Every moved layer brought its Adam moments and step; the last stage reports the loss.
    assert any(k.startswith("opt0:layers.1.") and k.endswith(":exp_avg_sq") for k in moved[1]["checks"][0][1])
    assert moved[1]["losses"] == static[1]["losses"]
    tm.assert_same(_merge([r["final"] for r in moved]), _merge([r["final"] for r in static]))
    assert moved[0]["reports"][0].bytes_sent > 0 and moved[1]["reports"][0].bytes_received > 0


def test_negative_control_lost_optimizer_state_is_detected(tmp_path):
    lossy = _run(tmp_path, 2, 4, STAGES_2, PLAN_2[:1], steps=5, drop=True)
    static = _run(tmp_path, 2, 4, STAGES_2, [], steps=5)

    with pytest.raises(AssertionError):
        _assert_checks_hold(lossy)
    assert lossy[1]["losses"][:2] == static[1]["losses"][:2]
    assert lossy[1]["losses"][2:] != static[1]["losses"][2:]
    assert _max_param_diff(_merge([r["final"] for r in lossy]), _merge([r["final"] for r in static])) > 1e-4


# ----------------------------------------------------------------------------------------------------
# 4 ranks: both directions and several layers at once; non-neighbour swap; re-pack onto fewer ranks
# ----------------------------------------------------------------------------------------------------

STAGES_4 = [["embed", *_layers(0, 1)], _layers(2, 3), _layers(4, 5), [*_layers(6, 7), "head"]]
# layers.1 goes 0 -> 1 while layers.4 and layers.5 go 2 -> 1 and layers.6 goes 3 -> 2.
PLAN_4 = [(2, [["embed", "layers.0"], _layers(1, 2, 3, 4, 5), ["layers.6"], ["layers.7", "head"]])]


def test_four_ranks_both_directions_several_at_once(tmp_path):
    moved = _run(tmp_path, 4, 8, STAGES_4, PLAN_4, steps=4)
    static = _run(tmp_path, 4, 8, STAGES_4, [], steps=4)

    _assert_checks_hold(moved)
    assert moved[1]["reports"][0].bytes_received > moved[1]["reports"][0].bytes_sent == 0
    assert moved[3]["losses"] == static[3]["losses"]
    tm.assert_same(_merge([r["final"] for r in moved]), _merge([r["final"] for r in static]))


def _swap_and_repack(rank: int, world_size: int) -> dict[str, Any]:
    """Non-neighbour swap (0 <-> 3), then re-pack everything onto ranks 0 and 1 and train there."""
    torch.set_default_dtype(torch.float64)
    units = tm.local_units(STAGES_4, rank, 8)
    optimizer = tm.make_optimizer(units)
    schedule = tm.make_schedule(units, stage_index=rank, num_stages=world_size)
    data = tm.batches(4)
    for batch in data[:2]:
        tm.pipeline_step(schedule, optimizer, batch)
    snaps = [tm.snapshot(units, [optimizer])]

    swap = [UnitMove("layers.0", 0, 3), UnitMove("head", 3, 0)]
    received, _ = migrate_units(swap, units, [optimizer], device=CPU)
    units = {
        n: m for n, m in {**units, **received}.items() if n not in {"layers.0", "head"} or rank in (3, 0)
    }
    units = {
        n: m
        for n, m in units.items()
        if not (n == "layers.0" and rank == 0) and not (n == "head" and rank == 3)
    }
    snaps.append(tm.snapshot(units, [optimizer]))

    packed_stages = [["embed", *_layers(0, 1, 2)], [*_layers(3, 4, 5, 6, 7), "head"]]
    new_owners = tm.owners_from_stages(packed_stages)
    current = {n: r for r, part in enumerate([*STAGES_4]) for n in part}
    current.update({"layers.0": 3, "head": 0})
    repack = tm.moves_between(current, new_owners)
    received, _ = migrate_units(repack, units, [optimizer], device=CPU)
    units = {n: m for n, m in {**units, **received}.items() if new_owners.get(n) == rank}
    snaps.append(tm.snapshot(units, [optimizer]))
    if rank >= 2:  # released: owns nothing, holds no optimizer state
        return {"snaps": snaps, "losses": [], "final": {}, "empty": not units and not optimizer.state}
    sub = dist.new_group([0, 1], use_local_synchronization=True)
    schedule = tm.make_schedule(units, stage_index=rank, num_stages=2, group=sub)
    losses = [tm.pipeline_step(schedule, optimizer, batch) for batch in data[2:]]
    return {"snaps": snaps, "losses": losses, "final": tm.snapshot(units, [optimizer]), "empty": False}


def test_non_neighbour_swap_and_repack_onto_fewer_ranks(tmp_path):
    results = run_distributed(_swap_and_repack, 4, tmp_path)
    static = _run(tmp_path, 4, 8, STAGES_4, [], steps=4)

    for i in range(1, 3):
        tm.assert_same(_merge([r["snaps"][0] for r in results]), _merge([r["snaps"][i] for r in results]))
    assert results[2]["empty"] and results[3]["empty"]
    assert results[1]["losses"] == static[3]["losses"][2:]
    tm.assert_same(_merge([r["final"] for r in results]), _merge([r["final"] for r in static]))


# ----------------------------------------------------------------------------------------------------
# Degenerate cases and bad input
# ----------------------------------------------------------------------------------------------------


def _bystander(rank: int, world_size: int) -> tuple[int, int, float]:
    """Rank 2 takes part in no move; an empty move list does nothing at all."""
    torch.set_default_dtype(torch.float64)
    units = {f"layers.{rank}": tm.Block()}
    optimizer = tm.make_optimizer(units)
    empty, report = migrate_units([], units, [optimizer], device=CPU)
    assert empty == {} and report.bytes_sent == report.bytes_received == 0
    received, report = migrate_units([UnitMove("layers.0", 0, 1)], units, [optimizer], device=CPU)
    return (
        len(received),
        report.bytes_sent + report.bytes_received,
        sum(len(g["params"]) for g in optimizer.param_groups),
    )


def test_empty_moves_and_uninvolved_rank(tmp_path):
    results = run_distributed(_bystander, 3, tmp_path)
    assert [r[0] for r in results] == [0, 1, 0]
    assert results[2][1] == 0 and results[0][1] > 0
    params_per_block = 6  # ln(2) + fc1(2) + fc2(2); the frozen gain is in no optimizer
    assert [r[2] for r in results] == [0, 2 * params_per_block, params_per_block]


class _Unpicklable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.lin.callback = lambda: None  # a lambda cannot be pickled


PEER_FAILED = r"rank\(s\) \[0\] rejected the moves"


def _bad_input(
    rank: int, world_size: int, case: str, error: type[Exception], match: str, peer_match: str
) -> str:
    """Every rank must fail (none may be left waiting): rank 0 with ``error``, the peer as told."""
    units: dict[str, nn.Module] = {f"layers.{rank}": nn.Linear(2, 2)}
    moves = {
        "not_owned": [UnitMove("layers.5", 0, 1)],
        "duplicate": [UnitMove("layers.0", 0, 1), UnitMove("layers.0", 0, 1)],
        "same_rank": [UnitMove("layers.0", 0, 0)],
        "outside_group": [UnitMove("layers.0", 0, 7)],
        "different_lists": [UnitMove("layers.0", 0, 1)] if rank == 0 else [UnitMove("layers.1", 1, 0)],
        "not_a_move": [("layers.0", 0, 1)],
        "unpicklable": [UnitMove("layers.0", 0, 1)],
    }[case]
    if case == "unpicklable" and rank == 0:
        units["layers.0"] = _Unpicklable()
    expected = (error, match) if rank == 0 or peer_match == "same" else (RuntimeError, peer_match)
    with pytest.raises(expected[0], match=expected[1] if expected[1] != "same" else match):
        migrate_units(moves, units, [], device=CPU)
    return "raised"


@pytest.mark.parametrize(
    ("case", "error", "match", "peer_match"),
    [
        (
            "not_owned",
            ValueError,
            r"rank 0 must send unit 'layers.5' but local_units does not hold it",
            PEER_FAILED,
        ),
        ("duplicate", ValueError, r"unit 'layers.0' appears more than once in moves", "same"),
        ("same_rank", ValueError, r"has src == dst \(0\): a unit that stays needs no move", "same"),
        ("outside_group", ValueError, r"dst rank 7 is not in the process group \(ranks \[0, 1\]\)", "same"),
        ("different_lists", ValueError, r"different move lists on different ranks", "same"),
        ("not_a_move", TypeError, r"moves\[0\] must be a UnitMove, got tuple", "same"),
        (
            "unpicklable",
            TypeError,
            r"Cannot migrate unit 'layers.0': attribute 'lin.callback' holds an unpicklable function",
            PEER_FAILED,
        ),
    ],
)
def test_bad_input_fails_on_every_rank(tmp_path, case, error, match, peer_match):
    assert run_distributed(_bad_input, 2, tmp_path, args=(case, error, match, peer_match)) == ["raised"] * 2


def _subgroup_move(rank: int, world_size: int) -> Any:
    """A group of global ranks [1, 2]: moves name GLOBAL ranks; rank 0 is outside the group."""
    sub = dist.new_group([1, 2])  # every rank calls it; rank 0 gets the non-member marker
    move = [UnitMove("layers.0", 1, 2)]
    if rank == 0:
        with pytest.raises(ValueError, match=r"this rank \(0\) is not in the process group \(ranks \[\]\)"):
            migrate_units(move, {}, [], device=CPU, group=sub)
        return "raised"
    torch.manual_seed(0)
    block = nn.Linear(2, 2)
    units = {"layers.0": block} if rank == 1 else {}
    received, _ = migrate_units(move, units, [], device=CPU, group=sub)
    return {name: m.weight.clone() for name, m in received.items()}


def test_subgroup_moves_use_global_ranks(tmp_path):
    results = run_distributed(_subgroup_move, 3, tmp_path)
    torch.manual_seed(0)
    assert results[0] == "raised" and results[1] == {}
    assert torch.equal(results[2]["layers.0"], nn.Linear(2, 2).weight.detach())


# ----------------------------------------------------------------------------------------------------
# 4 ranks, two data-parallel replicas of a 2-stage pipeline: both replicas' copies move in one call
# ----------------------------------------------------------------------------------------------------


def _replicas_in_one_plan(rank: int, world_size: int) -> dict[str, Any]:
    """Replica 0 is ranks (0, 1), replica 1 ranks (2, 3); each moves its own ``layers.1`` 0->1 / 2->3."""
    torch.set_default_dtype(torch.float64)
    position = rank % 2
    stages = [["embed", *_layers(0, 1)], [*_layers(2, 3), "head"]]
    units = tm.local_units(stages, position, 4)
    optimizer = tm.make_optimizer(units)
    for p in optimizer.param_groups[0]["params"]:  # distinct state per replica: a mix-up would show
        p.grad = torch.full_like(p, 1.0 + rank // 2)
    optimizer.step()
    before = tm.snapshot(units, [optimizer])
    moves = [UnitMove("layers.1", 0, 1), UnitMove("layers.1", 2, 3)]
    counted: list[str] = []
    real = {name: getattr(dist, name) for name in ("all_gather", "all_reduce")}

    def counting(name: str) -> Any:
        return lambda *args, **kwargs: (counted.append(name), real[name](*args, **kwargs))[1]

    for name in real:
        setattr(dist, name, counting(name))
    try:
        received, _ = migrate_units(moves, units, [optimizer], device=CPU)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    units = {n: m for n, m in {**units, **received}.items() if n != "layers.1" or position == 1}
    return {"before": before, "after": tm.snapshot(units, [optimizer]), "collectives": counted}


def test_data_parallel_replicas_move_their_copies_in_one_call(tmp_path):
    results = run_distributed(_replicas_in_one_plan, 4, tmp_path)
    for replica in (0, 1):
        ranks = (2 * replica, 2 * replica + 1)
        before = _merge([results[r]["before"] for r in ranks])
        after = _merge([results[r]["after"] for r in ranks])
        tm.assert_same(before, after)  # each replica's own copy arrived, bitwise, with its own state
    # Negative control: the replicas' states differ, so a copy that crossed replicas would have shown.
    assert _max_param_diff(results[0]["before"], results[2]["before"]) > 0
    # Two agreements (before and after the transfer), one small all-reduce each, whatever the group size.
    assert all(r["collectives"] == ["all_reduce", "all_reduce"] for r in results)


def _same_unit_twice_to_one_rank(rank: int, world_size: int) -> str:
    units: dict[str, nn.Module] = {"layers.0": nn.Linear(2, 2)} if rank in (0, 1) else {}
    with pytest.raises(ValueError, match=r"unit 'layers.0' appears more than once in moves from or to"):
        migrate_units([UnitMove("layers.0", 0, 2), UnitMove("layers.0", 1, 2)], units, [], device=CPU)
    return "raised"


def test_two_copies_of_a_unit_to_one_rank_are_refused(tmp_path):
    assert run_distributed(_same_unit_twice_to_one_rank, 3, tmp_path) == ["raised"] * 3
