import pytest
from hypothesis import given, settings

from lightning_dynmo.balancing import LayerCost, LayerMove, Placement, by_parameters, plan_moves, uniform

from .brute import assert_valid, brute_optimum, direct_loads
from .strategies import problems


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (10, 3, "0-3|4-6|7-9"),
        (8, 4, "0-1|2-3|4-5|6-7"),
        (5, 1, "0-4"),
        (5, 5, "0-0|1-1|2-2|3-3|4-4"),
        (7, 3, "0-2|3-4|5-6"),
    ],
)
def test_uniform_is_megatron_split(layers, stages, expected):
    assert str(uniform(layers, stages)) == expected


@pytest.mark.parametrize(
    ("layers", "stages", "match"),
    [
        (0, 1, r"num_layers=0 must be an integer >= 1"),
        (3, 4, r"num_stages=4 exceeds the number of layers \(3\)"),
        (3, 0, r"num_stages=0 must be >= 1"),
    ],
)
def test_uniform_rejects_bad_sizes(layers, stages, match):
    with pytest.raises(ValueError, match=match):
        uniform(layers, stages)


@settings(max_examples=80, deadline=None)
@given(problems())
def test_by_parameters_is_the_exact_parameter_optimum(problem):
    costs, stages = problem
    placement = by_parameters(costs, stages)
    assert_valid(placement, len(costs), stages)
    assert max(direct_loads(costs, placement, "params")) == brute_optimum(costs, stages, "params")


def test_by_parameters_ignores_time():
    costs = [
        LayerCost(fwd_time_s=10.0, num_params=1),
        LayerCost(num_params=1),
        LayerCost(num_params=1),
        LayerCost(num_params=1),
    ]
    assert str(by_parameters(costs, 2)) == "0-1|2-3"


def test_plan_moves_lists_changed_owners_in_layer_order():
    old = Placement.from_string("0-3|4-6|7-9")
    new = Placement.from_string("0-2|3-7|8-9")
    assert plan_moves(old, new) == (LayerMove(3, 0, 1), LayerMove(7, 2, 1))
    assert plan_moves(old, old) == ()


def test_plan_moves_across_stage_counts():
    moves = plan_moves(Placement.from_string("0-1|2-3|4-5"), Placement.from_string("0-2|3-5"))
    # Layer 3 stays on stage 1, so it does not move.
    assert moves == (LayerMove(2, 1, 0), LayerMove(4, 2, 1), LayerMove(5, 2, 1))


def test_plan_moves_rejects_mismatched_placements():
    with pytest.raises(ValueError, match=r"old=0-3 covers 4 layers but new=0-4 covers 5"):
        plan_moves(Placement.from_string("0-3"), Placement.from_string("0-4"))
    with pytest.raises(ValueError, match=r"new='0-3' is not a Placement"):
        plan_moves(Placement.from_string("0-3"), "0-3")  # type: ignore[arg-type]
