import pytest

from lightning_dynmo.balancing import LayerCost, Placement


def test_round_trip_and_queries():
    p = Placement.from_string("0-3|4-6|7-9")
    assert str(p) == "0-3|4-6|7-9"
    assert p == Placement.from_sizes([4, 3, 3]) == Placement((0, 4, 7, 10))
    assert (p.num_stages, p.num_layers, p.sizes) == (3, 10, (4, 3, 3))
    assert list(p.layers_of(1)) == [4, 5, 6]
    assert [p.stage_of(i) for i in range(10)] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert p.layer_to_stage() == (0, 0, 0, 0, 1, 1, 1, 2, 2, 2)
    assert repr(p) == "Placement('0-3|4-6|7-9')"


def test_single_layer_stage_forms():
    assert str(Placement.from_string("0-4|5")) == "0-4|5-5"
    assert Placement.from_string(" 0-4 | 5-5 ") == Placement.from_sizes([5, 1])


def test_stage_loads_by_time_and_params():
    costs = [LayerCost(fwd_time_s=1.0, bwd_time_s=2.0, num_params=10 * (i + 1)) for i in range(4)]
    p = Placement.from_sizes([1, 3])
    assert p.stage_loads(costs, by="time") == (3.0, 9.0)
    assert p.stage_loads(costs, by="params") == (10.0, 90.0)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0-3|5-9", "gap before layer 4"),
        ("0-3|3-9", "overlap at layer 3"),
        ("1-3|4-9", "starts at layer 1"),
        ("0-3|6-4", "reversed stage"),
        ("0-3||4-9", "not an inclusive layer range"),
        ("0-3|a-9", "not an inclusive layer range"),
        ("0-1-2", "not an inclusive layer range"),
        ("", "not a placement string"),
    ],
)
def test_malformed_strings_are_rejected(text, match):
    with pytest.raises(ValueError, match=match):
        Placement.from_string(text)


def test_string_must_cover_model():
    with pytest.raises(ValueError, match="covers 6 layers but the model has 8"):
        Placement.from_string("0-2|3-5", num_layers=8)


@pytest.mark.parametrize(
    ("bounds", "match"),
    [((0,), "at least one stage"), ((1, 4), "must start at layer 0"), ((0, 4, 4), "stage 1 is empty")],
)
def test_bad_boundaries(bounds, match):
    with pytest.raises(ValueError, match=match):
        Placement(bounds)


@pytest.mark.parametrize(
    ("sizes", "match"), [([], "sizes is empty"), ([3, 0], "integer number of layers >= 1")]
)
def test_bad_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        Placement.from_sizes(sizes)


def test_query_bounds():
    p = Placement.from_sizes([2, 2])
    with pytest.raises(ValueError, match="layer=4 is outside"):
        p.stage_of(4)
    with pytest.raises(ValueError, match="stage=2 is outside"):
        p.layers_of(2)
    with pytest.raises(ValueError, match="costs has 3 records"):
        p.stage_loads([LayerCost()] * 3)
    with pytest.raises(ValueError, match="by='flops' is not a cost view"):
        p.stage_loads([LayerCost()] * 4, by="flops")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fwd_time_s": -1.0}, r"fwd_time_s must be a finite number >= 0, got -1.0"),
        ({"bwd_time_s": float("nan")}, r"bwd_time_s must be a finite number >= 0, got nan"),
        ({"memory_bytes": float("inf")}, r"memory_bytes must be a finite number >= 0"),
        ({"num_params": "7"}, r"num_params must be a number"),
    ],
)
def test_layer_cost_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerCost(**kwargs)
