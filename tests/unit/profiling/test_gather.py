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
