"""GainMeter: a rebalance's measured gain compares the steps right before it with the steps after it."""

from __future__ import annotations

import pytest

from lightning_dynmo.balancing.gain import GainMeter, MeasuredGain


def _meter() -> GainMeter:
    return GainMeter(warmup_steps=1, measure_steps=3, history=3)


def _after(meter: GainMeter, steps: list[float]) -> MeasuredGain | None:
    out = None
    for s in steps:
        out = meter.observe(s, "quiet")
    return out


def test_quiet_steps_before_the_window_are_the_reference() -> None:
    meter = _meter()
    for s in (1.0, 1.0, 1.0):
        meter.observe(s, "quiet")
    meter.window_opened()
    for phase, s in (("warmup", 5.0), ("profiled", 1.2), ("profiled", 1.2)):
        meter.observe(s, phase)  # type: ignore[arg-type]
    assert meter.rebalanced()
    assert _after(meter, [9.0, 0.8, 0.8]) is None  # warm-up + 2 of 3
    measured = meter.observe(0.8, "quiet")
    assert measured == MeasuredGain(1.0, 0.8)
    assert measured.gain == pytest.approx(0.2)
    assert not meter.measuring


def test_a_cost_change_drops_the_steps_before_it() -> None:
    # Early exit at step 3: steps cost 1.0 s before, 0.9 s after (unbalanced), 0.8 s once rebalanced.
    # Against the pre-change steps the rebalance would claim 20%; it gained 1 - 0.8 / 0.9 = 11%.
    meter = _meter()
    for _ in range(3):
        meter.observe(1.0, "quiet")
    meter.observe(1.0, "quiet")  # the step in which the event was published
    meter.cost_changed()
    meter.window_opened()
    meter.observe(3.0, "warmup")  # shape inference, metering: never a reference
    for _ in range(3):
        meter.observe(0.9, "profiled")
    assert meter.rebalanced()
    measured = _after(meter, [5.0, 0.8, 0.8, 0.8])
    assert measured == MeasuredGain(0.9, 0.8)
    assert measured.gain == pytest.approx(1 - 0.8 / 0.9)


def test_stale_steps_would_inflate_the_gain() -> None:
    # Negative control: the same sequence without cost_changed() measures against the old 1.0 s steps.
    meter = _meter()
    for _ in range(4):
        meter.observe(1.0, "quiet")
    meter.window_opened()
    meter.observe(3.0, "warmup")
    for _ in range(3):
        meter.observe(0.9, "profiled")
    meter.rebalanced()
    measured = _after(meter, [5.0, 0.8, 0.8, 0.8])
    assert measured is not None and measured.gain == pytest.approx(0.2)


def test_only_the_latest_window_counts_and_nothing_known_means_no_measurement() -> None:
    meter = _meter()
    meter.window_opened()
    meter.observe(2.0, "profiled")
    meter.window_opened()  # a window whose decision was not applied, then another
    meter.observe(1.0, "profiled")
    assert meter.rebalanced()
    assert _after(meter, [0.0, 0.5, 0.5, 0.5]) == MeasuredGain(1.0, 0.5)
    assert not meter.rebalanced()  # no step seen since: nothing to compare with
    assert _after(meter, [1.0] * 4) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1, "measure_steps": 1, "history": 1}, r"warmup_steps=-1 must be an integer >= 0"),
        ({"warmup_steps": 0, "measure_steps": 0, "history": 1}, r"measure_steps=0 must be an integer >= 1"),
        ({"warmup_steps": 0, "measure_steps": 1, "history": 0}, r"history=0 must be an integer >= 1"),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GainMeter(**kwargs)


def test_unknown_phase() -> None:
    with pytest.raises(ValueError, match=r"phase='hooked' must be one of"):
        _meter().observe(1.0, "hooked")  # type: ignore[arg-type]


def test_the_hook_free_step_is_the_median_of_quiet_steps_on_the_model_and_placement_as_they_are() -> None:
    meter = _meter()
    assert meter.quiet_step_s() is None  # nothing measured yet
    for s in (1.0, 3.0, 2.0, 2.0):
        meter.observe(s, "quiet")
    assert meter.quiet_step_s() == 2.0  # the last 3 hook-free steps (history=3): 3, 2, 2
    meter.cost_changed()  # an event: the steps before it describe another model
    assert meter.quiet_step_s() is None
    meter.window_opened()
    for phase, s in (("warmup", 5.0), ("profiled", 1.2), ("profiled", 1.4)):
        meter.observe(s, phase)  # type: ignore[arg-type]
    assert meter.quiet_step_s() is None  # a window's steps carry the profiler's hooks
    assert meter.rebalanced()
    for s in (9.0, 0.8, 0.8, 0.8):  # a followed rebalance: its warm-up and measured steps
        meter.observe(s, "quiet")
    assert not meter.measuring and meter.quiet_step_s() is None
    meter.observe(0.7, "quiet")
    assert meter.quiet_step_s() == 0.7
