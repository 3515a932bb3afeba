"""TraceReplay sets each owned block's and part's emulated cost from the trace; DemoGPT's parts can sleep."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from lightning_dynmo.balancing import LayerCost
from lightning_dynmo.balancing.trace import CostCurve, CostTrace, StatisticTrace
from lightning_dynmo.demos import CallOverhead, DemoConfig, DemoGPT, TraceReplay, measure_call_overhead
from lightning_dynmo.demos import replay as replay_module
from lightning_dynmo.events import DynamismEvent, default_bus


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
    spread = TraceReplay(_trace(), num_microbatches=4, spread_over=3)  # 2 rows over 3 steps
    assert [spread.row(s) for s in range(4)] == [0, 0, 1, 1]


def test_replay_sleeps_the_trace_less_each_calls_overhead_and_states_what_it_really_runs():
    overhead = CallOverhead(
        block=LayerCost(fwd_time_s=0.0005, bwd_time_s=0.0005), part=LayerCost(fwd_time_s=0.0001)
    )
    model = DemoGPT(num_layers=3)
    replay = TraceReplay(_trace(), num_microbatches=4, overhead=overhead)
    replay.on_train_batch_start(SimpleNamespace(global_step=1), model, None, 0)  # row 1: block 0 at 0.25
    # Block 1 (dense): 8 ms / 4 = 2 ms forward, 4 ms backward per call, less 0.5 ms each.
    assert (model.layers["1"].cost.fwd_ms, model.layers["1"].cost.bwd_ms) == pytest.approx((1.5, 3.5))
    # Block 0 costs 0.5 ms forward per call, no more than its overhead: it sleeps nothing there.
    assert (model.layers["0"].cost.fwd_ms, model.layers["0"].cost.bwd_ms) == pytest.approx((0.0, 0.5))
    assert (model.last_cost.fwd_ms, model.last_cost.bwd_ms) == pytest.approx((9.9, 20.0))
    # What the pipeline then runs: every call at least its overhead (4 micro-batches a step).
    runs = overhead.replayed(_trace(), num_microbatches=4)
    assert runs.rows[1].layers[0].fwd_time_s == pytest.approx(0.002)  # 0.25 x 8 ms, already >= 4 x 0.5 ms
    assert runs.rows[1].layers[0].bwd_time_s == pytest.approx(0.004)
    assert runs.rows[0].first.fwd_time_s == pytest.approx(0.0004)  # free in the trace, 4 x 0.1 ms here
    assert runs.rows[0].layers[1].fwd_time_s == pytest.approx(_trace().rows[0].layers[1].fwd_time_s)


class _SteppedClock:
    """``time.perf_counter`` for ``_timed_calls``: every forward lasts ``fwd_s`` and every backward
    ``bwd_s`` (its reads come in threes: the call's start, the forward's end, the backward's end)."""

    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        self.steps, self.reads, self.now = (1.0, fwd_s, bwd_s), 0, 0.0

    def perf_counter(self) -> float:
        self.now += self.steps[self.reads % 3]
        self.reads += 1
        return self.now


def test_call_overhead_is_what_a_call_takes_beyond_its_sleep_and_leaves_the_model_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The calls run for real (blocks and parts sleep 2 ms forward, 4 ms backward); the clock they are
    # timed with says 2.5 ms and 4.7 ms, so what is beyond the sleeps is 0.5 ms and 0.7 ms, exactly.
    # (A timing of the real clock would measure this machine's load, not the arithmetic.)
    torch.manual_seed(0)
    model = DemoGPT(num_layers=2)
    clock = _SteppedClock(0.0025, 0.0047)
    monkeypatch.setattr(replay_module, "time", clock)
    overhead = measure_call_overhead(model, microbatch_size=1, seq_len=8, repeats=5, sleep_ms=2.0)
    for cost in (overhead.block, overhead.part):
        assert (cost.fwd_time_s, cost.bwd_time_s) == pytest.approx((0.0005, 0.0007))
    assert clock.reads == 2 * 3 * (3 + 5)  # block and part, each 3 warm-up and 5 timed calls
    assert (model.layers["0"].cost.fwd_ms, model.last_cost.fwd_ms) == (0.0, 0.0)
    assert "a block call costs" in overhead.describe()
    # Negative control: a call shorter than its sleep reads 0, never a negative overhead.
    monkeypatch.setattr(replay_module, "time", _SteppedClock(0.001, 0.003))
    short = measure_call_overhead(model, microbatch_size=1, seq_len=8, repeats=5, sleep_ms=2.0)
    assert (short.block.fwd_time_s, short.block.bwd_time_s) == (0.0, 0.0)


def test_a_held_trace_leads_with_its_first_row_and_announces_each_new_cost_as_an_event():
    # Rows 0 and 1 differ; a third row equal to row 1 changes nothing and is not announced.
    trace = _trace()
    trace = dataclasses.replace(trace, rows=(*trace.rows, trace.rows[1]))
    seen: list[DynamismEvent] = []
    unsubscribe = default_bus().subscribe(seen.append)  # where the dynamism callbacks publish
    replay = TraceReplay(trace, num_microbatches=4, steps_per_row=2, lead_steps=3, announce="pruned")
    assert [replay.row(s) for s in range(10)] == [0, 0, 0, 0, 0, 1, 1, 2, 2, 2]
    model = DemoGPT(num_layers=3)
    quiet = TraceReplay(trace, num_microbatches=4, steps_per_row=2, lead_steps=3)
    try:
        for step in range(10):
            replay.on_train_batch_start(SimpleNamespace(global_step=step), model, None, 0)
        assert [(e.kind, e.step) for e in seen] == [("pruned", 0), ("pruned", 5)]
        # Negative control: without ``announce`` nothing is published.
        for step in range(10):
            quiet.on_train_batch_start(SimpleNamespace(global_step=step), model, None, 0)
        assert len(seen) == 2
    finally:
        unsubscribe()
    with pytest.raises(ValueError, match=r"lead_steps=-1\) must be an integer >= 0"):
        TraceReplay(trace, 2, lead_steps=-1)
    with pytest.raises(ValueError, match=r"a lead goes with steps_per_row"):
        TraceReplay(trace, 2, spread_over=4, lead_steps=1)
    with pytest.raises(ValueError, match=r"announce='pruning'\) must be None or one of"):
        TraceReplay(trace, 2, announce="pruning")


def test_replay_refuses_a_trace_of_another_model():
    model = DemoGPT(num_layers=4)
    with pytest.raises(ValueError, match=r"the trace has 3 layers but this rank holds layers \[3\]"):
        TraceReplay(_trace(), 2).on_train_batch_start(SimpleNamespace(global_step=0), model, None, 0)
    with pytest.raises(ValueError, match=r"num_microbatches=0\) must be an integer >= 1"):
        TraceReplay(_trace(), 0)
    with pytest.raises(ValueError, match=r"spread_over=0\) must be an integer >= 1"):
        TraceReplay(_trace(), 2, spread_over=0)


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


def test_a_split_cost_sleeps_its_weight_part_only_where_the_weight_gradient_is_computed():
    from lightning_dynmo.demos import EmulatedCost

    cost = EmulatedCost(0.0, 0.0, split_backward=True)
    cost.wgrad_ms = 40.0
    x = torch.randn(3, requires_grad=True)
    y = cost(x)
    assert torch.equal(y, x)
    start = time.perf_counter()
    (gx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)  # an input-gradient pass: no sleep
    input_pass = time.perf_counter() - start
    start = time.perf_counter()
    (ga,) = torch.autograd.grad(y.sum(), cost.anchor)  # the weight pass: the sleep
    weight_pass = time.perf_counter() - start
    assert torch.equal(gx, torch.ones(3)) and float(ga) == 0.0  # training unchanged
    assert weight_pass >= 0.04 and input_pass < 0.04
    # Negative control: without an anchor the weight part has nowhere to sleep and is refused.
    plain = EmulatedCost(0.0, 0.0)
    plain.wgrad_ms = 1.0
    with pytest.raises(ValueError, match="split_backward=True"):
        plain(x)


def test_replay_splits_a_records_backward_between_the_passes_of_a_split_block():
    model = DemoGPT(num_layers=3, split_backward=True)
    stats = StatisticTrace("moe", "load", "ratio", (0,), ((1.0, 1.0, 1.0),))
    trace = CostTrace.build(stats, CostCurve.proportional(0.008, 0.016))
    row = trace.rows[0]
    layers = tuple(dataclasses.replace(c, bwd_weight_time_s=0.004) for c in row.layers)
    split = dataclasses.replace(trace, rows=(dataclasses.replace(row, layers=layers),))
    TraceReplay(split, num_microbatches=4).on_train_batch_start(
        SimpleNamespace(global_step=0), model, None, 0
    )
    cost = model.layers["1"].cost
    assert (cost.fwd_ms, cost.bwd_ms, cost.wgrad_ms) == pytest.approx((2.0, 3.0, 1.0))
    assert model.last_cost.anchor is None  # the parts sleep their whole backward in the input pass
    plain = DemoGPT(num_layers=3)  # a block without an anchor sleeps the whole backward
    TraceReplay(split, num_microbatches=4).on_train_batch_start(
        SimpleNamespace(global_step=0), plain, None, 0
    )
    assert (plain.layers["1"].cost.bwd_ms, plain.layers["1"].cost.wgrad_ms) == pytest.approx((4.0, 0.0))


def test_a_row_without_a_weight_pass_stops_the_weight_sleep_of_the_row_before():
    # Freezing and early exit: a layer's weight time falls to 0 from one row to the next. The block must
    # sleep none in its weight pass then, not what the row before asked (the replay once kept it).
    model = DemoGPT(num_layers=3, split_backward=True)
    stats = StatisticTrace("freezing", "trainable", "fraction", (0, 1), ((1.0, 1.0, 1.0), (1.0, 0.0, 1.0)))
    trace = CostTrace.build(stats, CostCurve.proportional(0.008, 0.016))
    rows = tuple(
        dataclasses.replace(
            r, layers=tuple(dataclasses.replace(c, bwd_weight_time_s=c.bwd_time_s / 2) for c in r.layers)
        )
        for r in trace.rows
    )
    assert rows[0].layers[1].bwd_weight_time_s > 0 and rows[1].layers[1].bwd_weight_time_s == 0
    replay = TraceReplay(dataclasses.replace(trace, rows=rows), num_microbatches=4)
    replay.on_train_batch_start(SimpleNamespace(global_step=0), model, None, 0)
    cost = model.layers["1"].cost
    assert cost.wgrad_ms == pytest.approx(2.0)  # row 0: half of 16 ms over 4 micro-batches
    replay.on_train_batch_start(SimpleNamespace(global_step=1), model, None, 1)
    assert (cost.bwd_ms, cost.wgrad_ms) == (0.0, 0.0)
    assert model.layers["0"].cost.wgrad_ms == pytest.approx(2.0)  # a layer still trained keeps its own
