"""TraceReplay sets each owned block's and part's emulated cost from the trace; DemoGPT's parts can sleep."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from lightning_dynmo.balancing import LayerCost
from lightning_dynmo.balancing.trace import CostCurve, CostTrace, StatisticTrace
from lightning_dynmo.demos import DemoConfig, DemoGPT, TraceReplay


def _trace() -> CostTrace:
    stats = StatisticTrace("mod", "share", "fraction", (0, 1), ((1.0, 0.5, 1.0), (0.25, 1.0, 1.0)))
    head = LayerCost(fwd_time_s=0.04, bwd_time_s=0.08)
    return CostTrace.build(stats, CostCurve.proportional(0.008, 0.016), last=head)


def test_replay_sets_owned_blocks_by_global_index_and_the_parts_per_microbatch():
    model = DemoGPT(num_layers=3)
    del model.layers["0"]  # another rank owns block 0: it is set there
    replay = TraceReplay(_trace(), num_microbatches=4, steps_per_row=2)
    replay.on_train_batch_start(SimpleNamespace(global_step=1), model, None, 0)  # row 0
    assert (model.layers["1"].cost.fwd_ms, model.layers["1"].cost.bwd_ms) == pytest.approx((1.0, 2.0))
    assert (model.last_cost.fwd_ms, model.last_cost.bwd_ms) == pytest.approx((10.0, 20.0))
    assert (model.first_cost.fwd_ms, model.first_cost.bwd_ms) == (0.0, 0.0)
    replay.on_train_batch_start(SimpleNamespace(global_step=9), model, None, 0)  # past the end: row 1
    assert model.layers["1"].cost.fwd_ms == pytest.approx(2.0)
    assert [replay.row(s) for s in range(6)] == [0, 0, 1, 1, 1, 1]


def test_replay_refuses_a_trace_of_another_model():
    model = DemoGPT(num_layers=4)
    with pytest.raises(ValueError, match=r"the trace has 3 layers but this rank holds layers \[3\]"):
        TraceReplay(_trace(), 2).on_train_batch_start(SimpleNamespace(global_step=0), model, None, 0)
    with pytest.raises(ValueError, match=r"num_microbatches=0\) must be an integer >= 1"):
        TraceReplay(_trace(), 0)


def test_demo_parts_sleep_only_when_asked():
    idx = torch.randint(0, 64, (2, 16))
    plain = DemoGPT()
    assert (plain.first_cost.fwd_ms, plain.last_cost.fwd_ms) == (0.0, 0.0)
    slow = DemoGPT(first_sleep_ms=30.0, last_sleep_ms=30.0)
    start = time.perf_counter()
    logits = slow(idx)
    assert time.perf_counter() - start >= 0.06  # both parts slept
    torch.testing.assert_close(logits, plain(idx))  # and computed the same
    with pytest.raises(ValueError, match="emulated costs must be >= 0 milliseconds"):
        DemoConfig(last_sleep_ms=-1.0)
