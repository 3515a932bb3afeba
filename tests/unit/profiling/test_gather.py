"""gather_layer_costs validates coverage; the multi-rank all-reduce is in tests/distributed/profiling."""

from __future__ import annotations

import pytest
import torch

from lightning_dynmo.balancing import LayerCost
from lightning_dynmo.profiling import gather_layer_costs
from lightning_dynmo.profiling.gather import _records


def _cost(t: float) -> LayerCost:
    return LayerCost(
        fwd_time_s=t, bwd_time_s=2 * t, num_params=10, memory_bytes=2**40 + 1, activation_bytes=7
    )


def test_single_process_returns_layer_order_exactly():
    costs = gather_layer_costs({1: _cost(0.2), 0: _cost(0.1)}, num_layers=2)
    assert costs == [_cost(0.1), _cost(0.2)]  # integers survive the float64 table exactly
    assert isinstance(costs[0].memory_bytes, int)


def test_missing_layer_is_named():
    with pytest.raises(ValueError, match=r"no rank of the pipeline group reported layers \[1, 2\]"):
        gather_layer_costs({0: _cost(0.1)}, num_layers=3)


def test_layer_out_of_range_is_named():
    with pytest.raises(ValueError, match=r"local has layer 5, outside 0..2"):
        gather_layer_costs({5: _cost(0.1)}, num_layers=3)


def test_layer_owned_twice_is_named():
    table = torch.zeros(2, 6, dtype=torch.float64)
    table[:, -1] = torch.tensor([1.0, 2.0])  # what the all-reduce gives when two ranks sent layer 1
    with pytest.raises(ValueError, match=r"layers \[1\] were profiled by more than one rank"):
        _records(table)


def test_parts_travel_with_the_layers():
    from lightning_dynmo.profiling.gather import gather_costs

    gathered = gather_costs({0: _cost(0.1), 1: _cost(0.2)}, 2, local_parts={"last": _cost(0.7)})
    assert gathered.layers == [_cost(0.1), _cost(0.2)]
    assert gathered.first is None  # no rank ran first-stage parts
    assert gathered.last == _cost(0.7)


def test_a_bad_part_name_or_a_part_owned_twice_is_named():
    from lightning_dynmo.profiling.gather import _part, gather_costs

    with pytest.raises(
        ValueError, match=r"local_parts has \['head'\]; the parts are named \('first', 'last'\)"
    ):
        gather_costs({0: _cost(0.1)}, 1, local_parts={"head": _cost(0.7)})
    row = torch.zeros(6, dtype=torch.float64)
    row[-1] = 2.0
    with pytest.raises(ValueError, match=r"the last parts were profiled by 2 ranks"):
        _part(row, "last")
