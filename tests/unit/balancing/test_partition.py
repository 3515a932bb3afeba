import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynmo.balancing import (
    BalanceProblem,
    Hardware,
    LayerCost,
    Placement,
    partition,
    solve_partition,
)
from lightning_dynmo.balancing.feasibility import use_greedy
from lightning_dynmo.balancing.stage_model import StageModel

from .brute import assert_fits, assert_valid, brute_optimum, direct_loads, problem_of
from .strategies import layer, problems

SETTINGS = settings(max_examples=150, deadline=None)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


@SETTINGS
@given(problems(), st.sampled_from(["time", "params"]))
def test_partition_is_exactly_optimal(problem, by):
    costs, stages = problem
    result = solve_partition(BalanceProblem(costs, by=by), stages)
    assert_valid(result.placement, len(costs), stages)
    assert _close(result.bottleneck, brute_optimum(costs, stages, by))
    assert _close(result.bottleneck, max(direct_loads(costs, result.placement, by)))


@SETTINGS
@given(problems(), st.data())
def test_partition_with_memory_caps_is_optimal_or_says_why(problem, data):
    costs, stages = problem
    per_stage = data.draw(st.booleans())
    if per_stage:
        caps = data.draw(st.lists(st.integers(0, 60), min_size=stages, max_size=stages))
    else:
        caps = data.draw(st.integers(0, 60))
    expected = brute_optimum(costs, stages, caps=caps)
    if expected is None:
        with pytest.raises(ValueError, match=r"cannot be met .* overflows stage"):
            partition(BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=caps)), stages)
        return
    result = solve_partition(BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=caps)), stages)
    assert_valid(result.placement, len(costs), stages)
    assert_fits(costs, result.placement, caps)
    assert _close(result.bottleneck, expected)


@SETTINGS
@given(problems(), st.none() | layer, st.none() | layer, st.none() | st.integers(0, 80))
def test_partition_with_pinned_extras_is_optimal(problem, first, last, cap):
    costs, stages = problem
    expected = brute_optimum(costs, stages, caps=cap, first=first, last=last)
    if expected is None:
        with pytest.raises(ValueError, match="cannot be met"):
            partition(
                BalanceProblem(
                    costs,
                    hardware=Hardware(
                        first_stage_extra=first, last_stage_extra=last, memory_capacity_bytes=cap
                    ),
                ),
                stages,
            )
        return
    result = solve_partition(
        BalanceProblem(
            costs,
            hardware=Hardware(first_stage_extra=first, last_stage_extra=last, memory_capacity_bytes=cap),
        ),
        stages,
    )
    assert _close(result.bottleneck, expected)
    assert _close(result.bottleneck, max(direct_loads(costs, result.placement, "time", first, last)))


@SETTINGS
@given(problems(), st.data())
def test_partition_with_communication_time_is_optimal(problem, data):
    costs, stages = problem
    comm = data.draw(st.lists(st.floats(0.0, 5.0), min_size=len(costs), max_size=len(costs)))
    result = solve_partition(BalanceProblem(costs, hardware=Hardware(comm_time_s=comm)), stages)
    assert _close(result.bottleneck, brute_optimum(costs, stages, comm=comm))
    assert _close(result.bottleneck, max(direct_loads(costs, result.placement, comm=comm)))


def test_probe_paths_are_chosen_as_documented():
    costs = [LayerCost(fwd_time_s=1.0, memory_bytes=1)] * 6
    assert use_greedy(StageModel.build(BalanceProblem(costs), 3))
    assert use_greedy(
        StageModel.build(BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=[9, 4, 9])), 3)
    )  # one middle stage
    assert not use_greedy(
        StageModel.build(BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=[9, 4, 5, 9])), 4)
    )
    assert not use_greedy(StageModel.build(BalanceProblem(costs, hardware=Hardware(comm_time_s=0.5)), 3))


def test_scalar_communication_time_is_paid_by_every_sending_stage():
    costs = [LayerCost(fwd_time_s=1.0)] * 4
    result = solve_partition(BalanceProblem(costs, hardware=Hardware(comm_time_s=1.0)), 2)
    # 1|3 -> (1 + 1, 3) = 3; 2|2 -> (2 + 1, 2) = 3; 3|1 -> (3 + 1, 1) = 4: the optimum is 3.
    assert result.bottleneck == 3.0
    first, last = result.placement.sizes
    assert result.stage_loads == (first + 1.0, float(last))  # the sender pays, the last stage does not


def test_known_counterexample_to_deepspeed_dp_is_solved_exactly():
    # partition_balanced (DeepSpeed, current) returns sums [20, 4, 3, 5] here; the optimum is 19.
    costs = [LayerCost(fwd_time_s=w) for w in [1, 19, 4, 3, 5, 0]]
    assert solve_partition(BalanceProblem(costs), 4).bottleneck == 19.0


def test_memory_error_reports_overflow_and_stage():
    costs = [LayerCost(fwd_time_s=1.0, memory_bytes=10)] * 4
    with pytest.raises(ValueError, match=r"overflows stage \d by 10 bytes \(needs 30, has 20\)"):
        partition(
            BalanceProblem(
                costs,
                hardware=Hardware(
                    first_stage_extra=LayerCost(memory_bytes=10), memory_capacity_bytes=[20, 20]
                ),
            ),
            2,
        )


def test_all_zero_costs_give_a_valid_placement():
    result = solve_partition(BalanceProblem([LayerCost()] * 5), 3)
    assert_valid(result.placement, 5, 3)
    assert result.bottleneck == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_stages": 0}, r"num_stages=0 must be >= 1"),
        ({"num_stages": 5}, r"num_stages=5 exceeds the number of layers \(4\)"),
        ({"num_stages": 2.0}, r"num_stages=2.0 must be an integer"),
        ({"by": "flops"}, r"by='flops' is not a cost view"),
        ({"memory_capacity_bytes": -1}, r"memory_capacity_bytes=-1 must be a number >= 0"),
        ({"memory_capacity_bytes": math.nan}, r"memory_capacity_bytes=nan must be a number >= 0"),
        ({"memory_capacity_bytes": [1, 2, 3]}, r"memory_capacity_bytes has 3 entries but there are 2 stages"),
        ({"memory_capacity_bytes": 5}, r"memory_capacity_bytes=5 cannot be met with 2 stages"),
        ({"first_stage_extra": 3.0}, r"first_stage_extra=3.0 must be a LayerCost"),
        ({"comm_time_s": [1.0]}, r"comm_time_s has 1 entries but there are 4 layers"),
        ({"comm_time_s": -1.0}, r"comm_time_s contains -1.0"),
        ({"comm_time_s": 1.0, "by": "params"}, r"comm_time_s=1.0 is given with by='params'"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(kwargs, match):
    costs = [LayerCost(fwd_time_s=1.0, memory_bytes=10)] * 4
    args = {"num_stages": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        problem, rest = problem_of(costs, **args)
        partition(problem, **rest)


@pytest.mark.parametrize(
    ("costs", "match"),
    [
        ([], r"costs is empty"),
        ([1.0, 2.0], r"costs\[0\] is a float, not a LayerCost"),
    ],
)
def test_bad_costs_are_rejected(costs, match):
    with pytest.raises(ValueError, match=match):
        partition(BalanceProblem(costs), 1)


@pytest.mark.parametrize("field", ["fwd_time_s", "bwd_time_s", "memory_bytes"])
@pytest.mark.parametrize("value", [-1.0, math.nan])
def test_negative_or_nan_costs_are_rejected(field, value):
    with pytest.raises(ValueError, match=rf"LayerCost.{field} must be a finite number >= 0, got {value}"):
        LayerCost(**{field: value})


def test_partition_returns_a_placement_and_is_deterministic():
    placement = partition(BalanceProblem([LayerCost(fwd_time_s=1.0)] * 4), 2)
    assert isinstance(placement, Placement)
    assert str(placement) == "0-1|2-3"  # the only optimum
    costs = [LayerCost(fwd_time_s=w) for w in [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]]
    assert partition(BalanceProblem(costs), 3) == partition(BalanceProblem(list(costs)), 3)


# -- heterogeneous workers and links -----------------------------------------------------------------

slowdowns = st.one_of(st.sampled_from([1.0, 0.5, 2.0, 3.0]), st.floats(0.25, 4.0))


@SETTINGS
@given(problems(), st.data())
def test_partition_with_slow_workers_and_links_is_exactly_optimal(problem, data):
    costs, stages = problem
    slowdown = data.draw(st.lists(slowdowns, min_size=stages, max_size=stages))
    links = data.draw(
        st.lists(
            st.lists(st.floats(0.0, 5.0), min_size=len(costs), max_size=len(costs)),
            min_size=stages - 1,
            max_size=stages - 1,
        )
    )
    comm = links if stages > 1 and data.draw(st.booleans()) else None
    first, last = data.draw(st.none() | layer), data.draw(st.none() | layer)
    cap = data.draw(st.none() | st.integers(0, 80))
    kwargs = dict(first=first, last=last, comm=comm, slowdown=slowdown)
    expected = brute_optimum(costs, stages, caps=cap, **kwargs)
    args = dict(
        memory_capacity_bytes=cap,
        first_stage_extra=first,
        last_stage_extra=last,
        comm_time_s=comm,
        worker_slowdown=slowdown,
    )
    problem = BalanceProblem(costs, hardware=Hardware(**args))
    if expected is None:
        with pytest.raises(ValueError, match="cannot be met"):
            partition(problem, stages)
        return
    result = solve_partition(problem, stages)
    assert_valid(result.placement, len(costs), stages)
    assert _close(result.bottleneck, expected)
    assert _close(result.bottleneck, max(direct_loads(costs, result.placement, "time", **kwargs)))


def test_a_slow_worker_gets_fewer_layers_in_proportion():
    costs = [LayerCost(fwd_time_s=1.0)] * 9
    assert partition(BalanceProblem(costs), 2).sizes == (5, 4) or partition(
        BalanceProblem(costs), 2
    ).sizes == (4, 5)
    # Stage 1 twice as slow: 6 layers on stage 0 and 3 on stage 1 cost 6 each.
    assert partition(BalanceProblem(costs, hardware=Hardware(worker_slowdown=[1.0, 2.0])), 2).sizes == (6, 3)
    assert partition(BalanceProblem(costs, hardware=Hardware(worker_slowdown=[2.0, 1.0])), 2).sizes == (3, 6)


def test_a_slow_link_moves_work_off_its_sender():
    costs = [LayerCost(fwd_time_s=1.0)] * 8
    # Links of a 3-stage pipeline: 0 -> 1 costs 2 s per send, 1 -> 2 is free.
    result = solve_partition(BalanceProblem(costs, hardware=Hardware(comm_time_s=[[2.0] * 8, [0.0] * 8])), 3)
    assert result.bottleneck == 4.0  # 2 | 3 | 3 -> (2 + 2, 3, 3): stage 0 sends over the slow link
    assert result.placement.sizes[0] == 2


def test_slow_workers_scale_the_pinned_extras_too():
    costs = [LayerCost(fwd_time_s=1.0)] * 6
    head = LayerCost(fwd_time_s=2.0)
    # Last stage twice as slow and holding a head of 2: 4 layers | 2 layers + head -> 4 | 2 * 4 = 8;
    # 5 | 1 + head -> 5 | 6: the optimum.
    result = solve_partition(
        BalanceProblem(costs, hardware=Hardware(last_stage_extra=head, worker_slowdown=[1.0, 2.0])), 2
    )
    assert result.placement.sizes == (5, 1)
    assert result.stage_loads == (5.0, 6.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"worker_slowdown": [1.0]}, r"worker_slowdown has 1 entries but there are 2 stages"),
        ({"worker_slowdown": [1.0, 0.0]}, r"worker_slowdown\[1\]=0.0 must be a finite number > 0"),
        ({"worker_slowdown": [1.0, math.inf]}, r"worker_slowdown\[1\]=inf must be a finite number > 0"),
        ({"worker_slowdown": 2.0}, r"worker_slowdown=2.0 must be None, or one factor per worker"),
        ({"comm_time_s": [[1.0] * 4, [1.0] * 4]}, r"comm_time_s has 2 rows but 2 stages have 1 links"),
        ({"comm_time_s": [[1.0] * 3]}, r"comm_time_s\[0\] has 3 entries but there are 4 layers"),
        ({"comm_time_s": [[1.0, -1.0, 0.0, 0.0]]}, r"comm_time_s\[0\] contains -1.0"),
    ],
)
def test_bad_heterogeneity_input_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        partition(problem_of([LayerCost(fwd_time_s=1.0)] * 4, **kwargs)[0], 2)


def test_greedy_probe_is_kept_for_reference_workers_only():
    costs = [LayerCost(fwd_time_s=1.0)] * 6
    assert use_greedy(
        StageModel.build(BalanceProblem(costs, hardware=Hardware(worker_slowdown=[1.0, 1.0, 1.0])), 3)
    )
    assert not use_greedy(
        StageModel.build(BalanceProblem(costs, hardware=Hardware(worker_slowdown=[1.0, 2.0, 1.0])), 3)
    )
