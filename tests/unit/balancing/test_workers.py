"""partition_workers: several stages per worker, the heaviest worker (not stage) minimised."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynmo.balancing import BalanceProblem, Hardware, LayerCost, Placement, partition
from lightning_dynmo.balancing.workers import (
    _changes,
    _even,
    _Model,
    _Search,
    _worker_caps,
    partition_workers,
    worker_loads,
)

from .brute import all_placements, assert_valid, direct_loads, problem_of

SETTINGS = settings(max_examples=150, deadline=None)
LAYOUTS = {"loop": [0, 1, 0, 1], "v": [0, 1, 1, 0], "loop3": [0, 1, 2, 0, 1, 2]}


def _costs(weights, memory=None):
    memory = memory or [0] * len(weights)
    return [LayerCost(fwd_time_s=float(w), memory_bytes=m) for w, m in zip(weights, memory, strict=True)]


def _heaviest_worker(costs, placement, workers, by="time"):
    per_worker: dict[int, float] = {}
    for stage, load in enumerate(direct_loads(costs, placement, by)):
        per_worker[workers[stage]] = per_worker.get(workers[stage], 0.0) + load
    return max(per_worker.values())


def _brute(costs, workers, cap=math.inf):
    fits = [
        p
        for p in all_placements(len(costs), len(workers))
        if all(
            sum(costs[i].memory_bytes for s, w in enumerate(workers) if w == worker for i in p.layers_of(s))
            <= cap
            for worker in set(workers)
        )
    ]
    return min((_heaviest_worker(costs, p, workers) for p in fits), default=None)


@st.composite
def worker_problems(draw):
    workers = draw(st.sampled_from(list(LAYOUTS.values())))
    n = draw(st.integers(len(workers), 10))
    weights = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    return _costs(weights), workers


@SETTINGS
@given(worker_problems(), st.data())
def test_never_worse_than_its_starting_points(problem, data):
    costs, workers = problem
    current = data.draw(st.sampled_from(list(all_placements(len(costs), len(workers)))))
    result = partition_workers(BalanceProblem(costs), workers, current=current)
    assert_valid(result.placement, len(costs), len(workers))
    assert result.bottleneck == pytest.approx(_heaviest_worker(costs, result.placement, workers))
    assert (
        result.bottleneck
        <= _heaviest_worker(costs, partition(BalanceProblem(costs), len(workers)), workers) + 1e-9
    )
    assert result.bottleneck <= _heaviest_worker(costs, current, workers) + 1e-9
    assert result.bottleneck >= _brute(costs, workers) - 1e-9


def test_finds_the_optimum_where_the_per_stage_optimum_leaves_a_worker_idle():
    costs, workers = _costs([3, 1, 4, 6, 1, 6, 6, 5]), LAYOUTS["loop"]
    per_stage = partition(BalanceProblem(costs), 4)
    assert _heaviest_worker(costs, per_stage, workers) == 22  # stages 3|11|7|11: worker 1 gets 22 of 32
    result = partition_workers(BalanceProblem(costs), workers)
    assert result.bottleneck == 16 == _brute(costs, workers)
    assert dict(result.worker_loads) == {0: 16.0, 1: 16.0}


def test_reaches_the_brute_force_optimum_on_most_small_problems():
    # A local search: this guards its quality (seeded, so the figure is reproducible, not a timing).
    rng = random.Random(0)
    gaps = []
    for trial in range(120):
        workers = list(LAYOUTS.values())[trial % 3]
        n = rng.randint(len(workers), 10)
        costs = _costs([rng.choice([rng.random(), 10 * rng.random()]) for _ in range(n)])
        gaps.append(partition_workers(BalanceProblem(costs), workers).bottleneck / _brute(costs, workers))
    assert sum(g < 1 + 1e-9 for g in gaps) >= 0.9 * len(gaps)
    assert max(gaps) < 1.10


@SETTINGS
@given(worker_problems(), st.integers(5, 60))
def test_memory_caps_hold_per_worker_or_the_error_says_by_how_much(problem, cap):
    costs, workers = problem
    costs = [LayerCost(fwd_time_s=c.fwd_time_s, memory_bytes=int(c.fwd_time_s)) for c in costs]
    best = _brute(costs, workers, cap)
    try:
        result = partition_workers(
            BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=cap)), workers
        )
    except ValueError as err:
        assert "no placement found that fits memory" in str(err)
        return  # a local search may miss a fitting placement; it never returns one that does not fit
    assert best is not None
    assert all(m <= cap for m in result.worker_memory_bytes.values())


def test_per_worker_capacity_as_mapping_or_sequence():
    costs = _costs([1, 1, 1, 1, 1, 1], memory=[10] * 6)
    for caps in ({0: 20, 1: 40}, [20, 40]):
        result = partition_workers(
            BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=caps)), LAYOUTS["loop"]
        )
        assert result.worker_memory_bytes[0] <= 20 and result.worker_memory_bytes[1] <= 40
    with pytest.raises(ValueError, match=r"needs 10 bytes more than worker 0 has"):
        partition_workers(
            BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=[20, 30])), LAYOUTS["loop"]
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage_workers": []}, r"len\(stage_workers\)=0 must be >= 1"),
        ({"stage_workers": [0, 1, 0, 1, 0]}, r"len\(stage_workers\)=5 exceeds the number of layers \(4\)"),
        ({"stage_workers": [0, -1]}, r"stage_workers=\[0, -1\] holds \[-1\]; worker ids are integers >= 0"),
        ({"by": "flops"}, r"by='flops' is not a cost view"),
        ({"memory_capacity_bytes": [5]}, r"memory_capacity_bytes has 1 entries but worker ids go up to 1"),
        ({"memory_capacity_bytes": {0: 5}}, r"no entry for workers \[1\]"),
        ({"memory_capacity_bytes": 0}, r"must be > 0 for every worker"),
        ({"current": Placement.from_string("0-1|2-3")}, r"current=0-1\|2-3 has 2 stages and 4 layers"),
    ],
)
def test_bad_input_is_rejected(kwargs, match):
    args = {"costs": _costs([1, 2, 3, 4]), "stage_workers": [0, 1, 0, 1], **kwargs}
    with pytest.raises(ValueError, match=match):
        problem, rest = problem_of(**args)
        partition_workers(problem, **rest)


def test_worker_loads_sum_the_stages_of_each_worker():
    costs = _costs([1, 2, 3, 4])
    assert worker_loads(BalanceProblem(costs), Placement.from_string("0-0|1-1|2-2|3-3"), [0, 1, 1, 0]) == {
        0: 5.0,
        1: 5.0,
    }


def test_capacity_of_the_wrong_kind_and_stage_count_mismatch_are_rejected():
    with pytest.raises(ValueError, match=r"must be None, a number of bytes, or one number per worker"):
        partition_workers(
            BalanceProblem(_costs([1, 2, 3, 4]), hardware=Hardware(memory_capacity_bytes="lots")),
            [0, 1, 0, 1],
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stage_workers has 2 entries for 4 stages"):
        worker_loads(BalanceProblem(_costs([1, 2, 3, 4])), Placement.from_string("0-0|1-1|2-2|3-3"), [0, 1])


# -- heterogeneous workers and links, pinned extras ---------------------------------------------------


def _direct_worker_loads(costs, placement, workers, first, last, comm, slowdown):
    """Per worker: its stages' loads summed directly (the stage model of brute.direct_loads)."""
    per_stage = direct_loads(
        costs, placement, "time", first, last, comm, [slowdown[w] for w in workers] if slowdown else None
    )
    loads: dict[int, float] = {}
    for stage, load in enumerate(per_stage):
        loads[workers[stage]] = loads.get(workers[stage], 0.0) + load
    return loads


@st.composite
def heterogeneous_worker_problems(draw):
    costs, workers = draw(worker_problems())
    num_workers = max(workers) + 1
    slowdown = draw(
        st.lists(st.sampled_from([1.0, 0.5, 2.0, 3.0]), min_size=num_workers, max_size=num_workers)
    )
    first = draw(st.none() | st.builds(LayerCost, fwd_time_s=st.integers(0, 30).map(float)))
    last = draw(st.none() | st.builds(LayerCost, fwd_time_s=st.integers(0, 30).map(float)))
    comm = None
    if draw(st.booleans()):
        row = st.lists(st.integers(0, 5).map(float), min_size=len(costs), max_size=len(costs))
        comm = draw(st.lists(row, min_size=len(workers) - 1, max_size=len(workers) - 1))
    return costs, workers, first, last, comm, slowdown


@SETTINGS
@given(heterogeneous_worker_problems(), st.data())
def test_slow_workers_links_and_extras_are_counted_and_never_worse_than_the_starts(problem, data):
    costs, workers, first, last, comm, slowdown = problem
    hardware = Hardware(
        first_stage_extra=first, last_stage_extra=last, comm_time_s=comm, worker_slowdown=slowdown
    )
    current = data.draw(st.sampled_from(list(all_placements(len(costs), len(workers)))))
    result = partition_workers(BalanceProblem(costs, hardware=hardware), workers, current=current)

    def heaviest(placement):
        return max(_direct_worker_loads(costs, placement, workers, first, last, comm, slowdown).values())

    assert result.bottleneck == pytest.approx(heaviest(result.placement))
    assert dict(result.worker_loads) == pytest.approx(
        _direct_worker_loads(costs, result.placement, workers, first, last, comm, slowdown)
    )
    assert worker_loads(
        BalanceProblem(
            costs,
            by="time",
            hardware=Hardware(
                first_stage_extra=first, last_stage_extra=last, worker_slowdown=slowdown, comm_time_s=comm
            ),
        ),
        result.placement,
        workers,
    ) == pytest.approx(dict(result.worker_loads))
    assert result.bottleneck <= heaviest(current) + 1e-9
    assert result.bottleneck >= min(heaviest(p) for p in all_placements(len(costs), len(workers))) - 1e-9


def test_a_slow_worker_and_a_heavy_head_get_less_work():
    costs = _costs([1] * 8)
    plain = partition_workers(BalanceProblem(costs), LAYOUTS["loop"])
    assert plain.bottleneck == 4.0
    slow = partition_workers(
        BalanceProblem(costs, hardware=Hardware(worker_slowdown=[1.0, 3.0])), LAYOUTS["loop"]
    )
    assert dict(slow.worker_loads) == {0: 6.0, 1: 6.0}  # worker 1 keeps 2 layers, 3 times slower
    head = partition_workers(
        BalanceProblem(costs, hardware=Hardware(last_stage_extra=LayerCost(fwd_time_s=4.0))), LAYOUTS["v"]
    )
    assert dict(head.worker_loads) == {0: 6.0, 1: 6.0}  # V: the head is on worker 0 with stage 0


@pytest.mark.parametrize(
    ("slowdown", "match"),
    [
        ([1.0], r"worker_slowdown has 1 entries but worker ids go up to 1"),
        ({0: 1.0}, r"worker_slowdown has no entry for workers \[1\]"),
        ([1.0, -2.0], r"worker_slowdown\[1\]=-2.0 must be a finite number > 0"),
        (2.0, r"worker_slowdown=2.0 must be None, or one factor per worker"),
    ],
)
def test_bad_worker_slowdown_is_rejected(slowdown, match):
    with pytest.raises(ValueError, match=match):
        partition_workers(
            BalanceProblem(_costs([1, 2, 3, 4]), hardware=Hardware(worker_slowdown=slowdown)), [0, 1, 0, 1]
        )


def test_a_cap_nothing_reaches_searches_as_no_cap_and_a_binding_cap_moves_the_result():
    # Without a finite cap the descent leaves memory out of its moves; a cap that no placement reaches
    # scores every move with it and must take the same path to the same placement.
    draw = random.Random(5)
    workers = [min(s, 11 - s) for s in range(12)]  # a V: 6 workers, two stages each
    costs = [LayerCost(fwd_time_s=draw.uniform(0.2, 3.0), memory_bytes=10) for _ in range(40)]
    free = partition_workers(BalanceProblem(costs), workers)
    unreached = partition_workers(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=10**9)), workers
    )
    assert unreached == free
    # Negative control: a cap the free placement breaks gives another placement (the check can fail).
    cap = max(free.worker_memory_bytes.values()) - 10
    binding = partition_workers(BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=cap)), workers)
    assert binding.placement != free.placement
    assert max(binding.worker_memory_bytes.values()) <= cap


def _scored(search, b, capped):
    """``_Search._scored_moves`` from ``b``, each move as its changes and its totals copied when yielded."""
    loads, memory = search.model.totals(b)
    out = []
    for move, new_loads, new_memory in search._scored_moves(b, loads, memory if capped else None):
        out.append((_changes(b, move), new_loads[:], None if new_memory is None else new_memory[:]))
    return out


@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_descent_scores_every_move_in_order_with_its_recomputed_totals(layout, capped):
    """The descent's moves are _moves' moves in _moves' order, each with the totals _Model.totals gives
    the boundaries after it: chains, scored from running sums, included."""
    draw, workers = random.Random(11), LAYOUTS[layout]
    for _ in range(4):
        n = draw.randint(len(workers) + 3, 14)
        costs = _costs([draw.uniform(0.1, 5.0) for _ in range(n)], [draw.randint(1, 9) for _ in range(n)])
        cap = 30 if capped else None
        model = _Model.build(BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=cap)), workers)
        search = _Search(model, _worker_caps(cap, workers))
        b = list(_even(n, len(workers)))
        scored = _scored(search, b, capped)
        assert [move for move, _, _ in scored] == _Search._moves(b)
        assert any(len(move) > 2 for move, _, _ in scored)  # chains were scored
        for move, loads, memory in scored:
            after = list(b)
            for i, y in move:
                after[i] = y
            want_loads, want_memory = model.totals(after)
            assert loads == pytest.approx(want_loads, rel=1e-12, abs=1e-12)
            assert memory == (pytest.approx(want_memory, abs=1e-9) if capped else None)


def test_a_chain_scored_without_its_middle_boundaries_gives_other_totals():
    """The negative control of the test above: the totals of a chain's end boundaries alone differ from
    the chain's, so the comparison there can fail."""
    costs = _costs([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    workers = LAYOUTS["loop3"]
    model = _Model.build(BalanceProblem(costs), workers)
    search = _Search(model, _worker_caps(None, workers))
    b = list(_even(8, len(workers)))
    chains = [(move, loads) for move, loads, _ in _scored(search, b, False) if len(move) > 2]
    differs = 0
    for move, loads in chains:
        ends_only = list(b)
        for i, y in (move[0], move[-1]):
            ends_only[i] = y
        differs += model.totals(ends_only)[0] != pytest.approx(loads, rel=1e-12, abs=1e-12)
    assert chains and differs > 0
