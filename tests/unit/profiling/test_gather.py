"""gather_layer_costs validates coverage; the multi-rank all-gather is in tests/distributed/profiling."""

from __future__ import annotations

import pytest

from lightning_dynmo.balancing import LayerCost
from lightning_dynmo.profiling import gather_layer_costs
from lightning_dynmo.profiling.gather import _merge


def _cost(t: float) -> LayerCost:
    return LayerCost(fwd_time_s=t, bwd_time_s=2 * t, num_params=10)


def test_single_process_returns_layer_order():
    costs = gather_layer_costs({1: _cost(0.2), 0: _cost(0.1)}, num_layers=2)
    assert costs == [_cost(0.1), _cost(0.2)]


def test_parts_from_ranks_are_merged_in_layer_order():
    assert _merge([{0: _cost(1), 1: _cost(2)}, {2: _cost(3)}], 3) == [_cost(1), _cost(2), _cost(3)]


def test_missing_layer_is_named():
    with pytest.raises(ValueError, match=r"no rank of the pipeline group reported layers \[1, 2\]"):
        gather_layer_costs({0: _cost(0.1)}, num_layers=3)


def test_layer_out_of_range_is_named():
    with pytest.raises(ValueError, match=r"local has layer 5, outside 0..2"):
        gather_layer_costs({5: _cost(0.1)}, num_layers=3)


def test_layer_owned_twice_is_named():
    with pytest.raises(ValueError, match=r"layer 1 was profiled by two ranks \(the second is group rank 1\)"):
        _merge([{0: _cost(1), 1: _cost(2)}, {1: _cost(3)}], 2)
