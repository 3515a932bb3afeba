"""Statistic traces, cost curves and the per-step cost trace (pure, worked examples)."""

from __future__ import annotations

import pytest

from lightning_dynmo.balancing import LayerCost, partition
from lightning_dynmo.balancing.trace import PROPORTIONAL, CostCurve, CostTrace, StatisticTrace


def _trace() -> StatisticTrace:
    # Three layers, two recorded steps: layer 1 is light at step 0, layer 2 at step 5.
    return StatisticTrace("mod", "processed share", "fraction", (0, 5), ((1.0, 0.2, 1.0), (1.0, 1.0, 0.4)))


def test_reads_the_trace_file_format():
    record = {
        "case": "sparse_attention",
        "statistic": "active tiles",
        "unit": "fraction",
        "model": "SmolLM2",
        "command": "python -m benchmarks.trained",
        "rows": [{"step": 0, "values": [0.5, 0.25], "extra": {}}, {"step": 1, "values": [0.4, 0.3]}],
    }
    trace = StatisticTrace.from_record(record)
    assert (trace.num_layers, trace.num_rows, trace.steps) == (2, 2, (0, 1))
    assert trace.values[1] == (0.4, 0.3)
    assert trace.source == "SmolLM2; python -m benchmarks.trained"
    assert trace.layer_means() == pytest.approx([0.45, 0.275])
    with pytest.raises(ValueError, match=r"lacks \['rows'\]"):
        StatisticTrace.from_record({"case": "x", "statistic": "s", "unit": "u"})


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ((), "has no rows"),
        (((1.0, 2.0), (1.0,)), r"rows have \[1, 2\] layers"),
        (((1.0, -0.5),), r"layer 1=-0.5 must be a finite number >= 0"),
    ],
)
def test_bad_statistics_are_refused(values, match):
    with pytest.raises(ValueError, match=match):
        StatisticTrace("c", "s", "u", tuple(range(len(values))), values)


def test_proportional_curve_scales_the_dense_time_and_says_so():
    curve = CostCurve.proportional(2.0, 4.0)
    assert curve.label == PROPORTIONAL and curve.is_proportional
    assert curve.at(0.25) == pytest.approx((0.5, 1.0))
    assert curve.at(1.5) == pytest.approx((3.0, 6.0))  # above the dense statistic it stays proportional


def test_table_curve_interpolates_and_clamps_at_zero():
    curve = CostCurve(((0.5, 1.0, 2.0), (1.0, 3.0, 2.0)), "measured table")
    assert not curve.is_proportional
    assert curve.at(0.75) == pytest.approx((2.0, 2.0))
    assert curve.at(0.0) == pytest.approx((0.0, 2.0))  # extended segment: -1.0 s forward clamps to 0
    assert CostCurve(((1.0, 5.0, 6.0),), "constant").at(9.0) == (5.0, 6.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        CostCurve(((1.0, 1.0, 1.0), (1.0, 2.0, 2.0)), "t")


def test_cost_trace_costs_layers_and_parts_and_averages_over_steps():
    head = LayerCost(fwd_time_s=1.0, bwd_time_s=2.0)
    trace = CostTrace.build(_trace(), CostCurve.proportional(1.0, 2.0), last=head, num_params=[10, 10, 20])
    assert trace.curve_label == PROPORTIONAL and trace.num_layers == 3 and trace.num_rows == 2
    assert trace.rows[0].layers[1].time_s == pytest.approx(0.6)
    assert trace.rows[0].last == head and trace.rows[0].first == LayerCost()
    assert [c.num_params for c in trace.rows[1].layers] == [10, 10, 20]
    mean = trace.mean_costs()
    assert [c.time_s for c in mean.layers] == pytest.approx([3.0, 1.8, 2.1])
    assert mean.total_s == pytest.approx(3.0 + 1.8 + 2.1 + 3.0)
    assert trace.mean_costs(range(1, 2)).layers[2].time_s == pytest.approx(1.2)
    with pytest.raises(ValueError, match="holds no row"):
        trace.mean_costs(range(5, 7))
    # The head is pinned to the last stage: with it the partition moves layers off that stage.
    assert str(partition(mean.problem(), 2)) == "0-1|2-2"
    assert trace.scaled(2.0).mean_costs().total_s == pytest.approx(2 * mean.total_s)


def test_no_dynamism_keeps_the_shape():
    dense = _trace().uniform(1.0)
    assert dense.num_rows == 2 and set(dense.values[0]) == {1.0} and dense.case == "mod (no dynamism)"


def test_scaling_and_averaging_keep_the_weight_pass_and_the_update():
    import dataclasses

    base = CostTrace.build(_trace(), CostCurve.proportional(1.0, 2.0))

    def timed(c: LayerCost) -> LayerCost:
        return dataclasses.replace(c, bwd_weight_time_s=0.5 * c.bwd_time_s, update_time_s=0.25)

    trace = dataclasses.replace(
        base,
        rows=tuple(dataclasses.replace(r, layers=tuple(timed(c) for c in r.layers)) for r in base.rows),
    )
    layer = trace.scaled(3.0).rows[0].layers[1]
    assert (layer.bwd_weight_time_s, layer.update_time_s) == pytest.approx((0.6, 0.75))  # 0.5 x 0.4 x 3
    mean = trace.mean_costs().layers[2]
    assert mean.bwd_weight_time_s == pytest.approx(0.5 * mean.bwd_time_s) and mean.update_time_s == 0.25
    # Control: the trace built without them has none to keep.
    assert base.scaled(3.0).mean_costs().layers[1].bwd_weight_time_s == 0.0
