"""The problem object: validated once, passed whole; old call shapes fail naming the new place."""

import inspect

import pytest

import lightning_dynmo.balancing as balancing
from lightning_dynmo.balancing import BalanceProblem, Hardware, LayerCost, Placement, partition, repack
from lightning_dynmo.balancing.microbatches import choose_microbatches
from lightning_dynmo.balancing.policy import BalanceConfig, decide, predict

COSTS = [LayerCost(fwd_time_s=1.0, memory_bytes=1)] * 4
PROBLEM = BalanceProblem(COSTS)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: partition(PROBLEM, 2, first_stage_extra=LayerCost()),
            r"first_stage_extra moved to Hardware\(first_stage_extra=\.\.\.\) in BalanceProblem",
        ),
        (lambda: partition(PROBLEM, 2, by="params"), r"by moved to BalanceProblem\(by=\.\.\.\)"),
        (
            lambda: repack(PROBLEM, "0-1|2-3", stage_slowdown=[1.0, 2.0]),
            r"stage_slowdown moved to Hardware\(worker_slowdown=\.\.\.\) in BalanceProblem",
        ),
        (
            lambda: decide(
                PROBLEM, Placement.from_string("0-1|2-3"), BalanceConfig(), 2, "1F1B", min_saving=1.0
            ),
            r"min_saving moved to BalanceConfig\(min_saving=\.\.\.\)",
        ),
        (
            lambda: predict(PROBLEM, Placement.from_string("0-1|2-3"), 2, "1F1B", hardware=Hardware()),
            r"hardware moved to BalanceProblem\(hardware=\.\.\.\)",
        ),
        (lambda: partition(COSTS, 2), r"partition\(\) takes a BalanceProblem first, got list"),
        (
            lambda: choose_microbatches(
                COSTS, Placement.from_string("0-3"), current=1, candidates=[1], schedule="1F1B"
            ),
            r"choose_microbatches\(\) takes a BalanceProblem first",
        ),
    ],
)
def test_old_call_shapes_name_the_new_place(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_the_problem_is_validated_when_built():
    with pytest.raises(ValueError, match=r"costs is empty"):
        BalanceProblem([])
    with pytest.raises(ValueError, match=r"by='flops' is not a cost view"):
        BalanceProblem(COSTS, "flops")
    with pytest.raises(ValueError, match=r"hardware=3 is not a Hardware"):
        BalanceProblem(COSTS, hardware=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"last_stage_extra=1.0 must be a LayerCost"):
        Hardware(last_stage_extra=1.0)  # type: ignore[arg-type]


def test_decide_refuses_a_problem_in_another_view_than_its_config():
    with pytest.raises(ValueError, match=r"problem.by='params' but config.cost='time'"):
        decide(BalanceProblem(COSTS, "params"), Placement.from_string("0-1|2-3"), BalanceConfig(), 2, "1F1B")


def test_the_helpers_give_per_stage_caps_links_and_slowdowns():
    problem = BalanceProblem(
        COSTS, hardware=Hardware(worker_slowdown=[1.0, 2.0], comm_time_s=0.5, memory_capacity_bytes=[3, 4])
    )
    assert problem.caps(2) == (3.0, 4.0)
    assert problem.links(2) == [[0.5] * 4]
    assert problem.stage_slowdown(2) == (1.0, 2.0)
    assert problem.with_hardware(comm_time_s=None).links(2) is None
    assert problem.hardware.per_stage(2, [1, 0]).worker_slowdown == [2.0, 1.0]


def test_every_public_callable_takes_at_most_eight_parameters():
    for name in balancing.__all__:
        member = getattr(balancing, name)
        if inspect.isfunction(member):
            assert len(inspect.signature(member).parameters) <= 8, name
    for member in (decide, predict, choose_microbatches):
        assert len(inspect.signature(member).parameters) <= 8, member.__name__
