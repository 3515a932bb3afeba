"""CostMeter's smoothed costs: bias-corrected, aged by the steps between windows, fresh after an event;
and the margin of standard deviations the decision plans with.

The gather over the pipeline is replaced by the window's own costs (one process), so what is tested is
the meter's averaging of what it gathered.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_dynmo.balancing import LayerCost, Placement
from lightning_dynmo.callback import ProfilingConfig
from lightning_dynmo.callback import measure as measure_module
from lightning_dynmo.callback.measure import CostMeter


def _window(fwd_s: float) -> Any:
    """A profiled window whose two layers each took ``fwd_s`` forward (backward twice)."""
    layers = [LayerCost(fwd_time_s=fwd_s, bwd_time_s=2 * fwd_s, num_params=3) for _ in range(2)]
    return SimpleNamespace(layer_costs=lambda inflight: layers, part_costs=lambda inflight: {})


def _meter(monkeypatch: pytest.MonkeyPatch, margin: float) -> tuple[CostMeter, Any]:
    def gathered(local: list[LayerCost], *args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(layers=list(local), first=None, last=None)

    monkeypatch.setattr(measure_module, "gather_costs", gathered)
    profiling = ProfilingConfig(cost_smoothing=0.5, cost_margin=margin, measure_comm=False)
    profiling = profiling.resolved(every_step=True)
    view = SimpleNamespace(
        placement=Placement.from_string("0-0|1-1"),
        schedule_name="1F1B",
        num_stages=2,
        num_microbatches=2,
        pipeline_group=None,
        root_device=torch.device("cpu"),
        pipeline_size=2,
    )
    return CostMeter(profiling, {}), view


@pytest.fixture
def meter(monkeypatch: pytest.MonkeyPatch) -> tuple[CostMeter, Any]:
    """A meter planning on the average alone (``cost_margin=0``): its averaging, unobscured."""
    return _meter(monkeypatch, margin=0.0)


def _measure(meter: CostMeter, view: Any, fwd_s: float, step: int, reason: str = "every_step") -> float:
    costs, _ = meter.measure(view, _window(fwd_s), reason, torch.float32, step)
    assert costs[0].num_params == 3  # sizes are the window's
    return costs[0].fwd_time_s


def test_the_first_window_weighs_no_more_than_the_next(meter: tuple[CostMeter, Any]) -> None:
    m, view = meter
    assert _measure(m, view, 4.0, step=0) == 4.0
    # w = 0.5: weights 0.5 and 0.25 normalised -> 1/3 and 2/3 (the uncorrected average: 1/2 and 1/2).
    assert _measure(m, view, 1.0, step=1) == pytest.approx(4.0 / 3 + 2.0 / 3)


def test_skipped_steps_age_the_history(meter: tuple[CostMeter, Any]) -> None:
    m, view = meter
    _measure(m, view, 4.0, step=0)
    # Three skipped windows: the first sample weighs 0.5 ** 4 * 0.5 against the new one's 0.5.
    share = 0.5**5 / (0.5**5 + 0.5)
    assert _measure(m, view, 1.0, step=4) == pytest.approx(4.0 * share + 1.0 * (1 - share))


def test_an_event_window_starts_fresh(meter: tuple[CostMeter, Any]) -> None:
    m, view = meter
    _measure(m, view, 4.0, step=0)
    _measure(m, view, 4.0, step=1)
    assert _measure(m, view, 1.0, step=2, reason="event") == 1.0
    assert _measure(m, view, 4.0, step=3) == pytest.approx(1.0 / 3 + 8.0 / 3)  # the event's window first


def test_the_plan_adds_the_margin_of_standard_deviations_and_the_average_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m, view = _meter(monkeypatch, margin=1.0)
    assert _measure(m, view, 4.0, step=0) == 4.0  # one window: no spread
    # Weights 1/3 and 2/3: mean 2, mean of squares 16/3 + 2/3 = 6, variance 2.
    costs, _ = m.measure(view, _window(1.0), "every_step", torch.float32, 1)
    assert costs[0].fwd_time_s == pytest.approx(2.0 + 2**0.5)
    assert costs[0].bwd_time_s == pytest.approx(4.0 + 2 * 2**0.5)  # backward: twice the forward's
    assert m.last_costs is not None and m.last_costs[0].fwd_time_s == pytest.approx(2.0)
    # An event restarts both averages: the plan is the fresh measurement again.
    assert _measure(m, view, 1.0, step=2, reason="event") == 1.0
