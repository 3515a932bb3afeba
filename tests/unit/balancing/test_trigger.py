"""When to rebalance: periodic, event, every-step and automatic triggers, with an injected clock."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from lightning_dynmo.balancing.trigger import AutoConfig, RebalanceTrigger, TriggerConfig


class FakeClock:
    """A clock that only moves when told to (no sleeps in tests)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fired(trigger: RebalanceTrigger, steps: range) -> list[int]:
    return [s for s in steps if trigger.check(s) is not None]


def test_every_n_steps_fires_on_multiples():
    trigger = RebalanceTrigger(TriggerConfig(every_n_steps=3, on_events=False))
    assert _fired(trigger, range(10)) == [3, 6, 9]
    assert trigger.check(12) == "period"


def test_event_fires_once_at_the_next_check():
    trigger = RebalanceTrigger(TriggerConfig())
    assert trigger.check(0) is None
    trigger.notify_event()
    trigger.notify_event()  # two events before a check still make one rebalance
    assert trigger.check(1) == "event"
    assert trigger.check(2) is None


def test_events_ignored_when_disabled():
    trigger = RebalanceTrigger(TriggerConfig(on_events=False))
    trigger.notify_event()
    assert trigger.check(1) is None


def test_every_step_fires_every_step():
    trigger = RebalanceTrigger(TriggerConfig(every_step=True, on_events=False))
    assert _fired(trigger, range(5)) == [0, 1, 2, 3, 4]


AUTO_SETTINGS = AutoConfig(
    threshold=0.2, patience_steps=5, horizon_steps=100, cooldown_steps=20, rebalance_cost_prior_s=1.0
)
AUTO = TriggerConfig(on_events=False, auto=AUTO_SETTINGS)


def _noisy(rng: random.Random, loads: list[float], noise: float) -> list[float]:
    return [x * (1 + rng.uniform(-noise, noise)) for x in loads]


def test_auto_does_not_fire_on_noise():
    rng = random.Random(0)
    trigger = RebalanceTrigger(AUTO)
    fired = []
    for step in range(500):
        trigger.observe(_noisy(rng, [0.5, 0.5, 0.5, 0.5], noise=0.08))  # up to ~0.3 imbalance on single steps
        if trigger.check(step):
            fired.append(step)
    assert fired == []


def test_auto_ignores_a_short_burst():
    trigger = RebalanceTrigger(AUTO)
    for step in range(20):
        burst = 10 <= step < 14  # 4 imbalanced steps, patience is 5
        trigger.observe([1.0, 0.5] if burst else [0.5, 0.5])
        assert trigger.check(step) is None


def test_auto_fires_after_patience_on_a_real_change():
    rng = random.Random(1)
    trigger = RebalanceTrigger(AUTO)
    fired = []
    for step in range(60):
        loads = [1.0, 0.5, 0.5, 0.5] if step >= 30 else [0.5, 0.5, 0.5, 0.5]  # stage 0 got twice as slow
        trigger.observe(_noisy(rng, loads, noise=0.05))
        if trigger.check(step):
            fired.append(step)
            trigger.record_rebalance(step)
    assert fired[0] == 30 + AUTO_SETTINGS.patience_steps - 1
    # the imbalance persists (nothing was really rebalanced): the next firing waits for the cooldown
    assert all(b - a >= AUTO_SETTINGS.cooldown_steps for a, b in itertools.pairwise(fired))
    assert len(fired) >= 2


def test_auto_holds_when_the_gain_does_not_pay_for_the_rebalance():
    # Imbalance 0.23 > 0.2, but the saving (0.062 - 0.053) s per step x 100 steps = 0.9 s < 1 s prior cost.
    trigger = RebalanceTrigger(AUTO)
    for step in range(30):
        trigger.observe([0.062, 0.05, 0.05, 0.05])
        assert trigger.check(step) is None
    # The same imbalance over a longer horizon pays.
    longer = RebalanceTrigger(
        dataclasses.replace(AUTO, auto=dataclasses.replace(AUTO_SETTINGS, horizon_steps=1000))
    )
    for _ in range(5):
        longer.observe([0.062, 0.05, 0.05, 0.05])
    assert longer.check(4) == "auto"


def test_cooldown_holds_after_a_rebalance():
    trigger = RebalanceTrigger(AUTO)
    trigger.record_rebalance(step=10)
    fired = []
    for step in range(11, 60):
        trigger.observe([1.0, 0.5])
        if trigger.check(step):
            fired.append(step)
            break
    assert fired == [10 + AUTO_SETTINGS.cooldown_steps]


def test_cooldown_does_not_hold_back_explicit_triggers():
    trigger = RebalanceTrigger(TriggerConfig(auto=AutoConfig(), every_n_steps=4))
    trigger.record_rebalance(step=3)
    assert trigger.check(4) == "period"
    trigger.notify_event()
    assert trigger.check(5) == "event"


def test_rebalance_cost_is_learned_with_the_clock():
    clock = FakeClock()
    trigger = RebalanceTrigger(AUTO, clock=clock)
    assert trigger.rebalance_cost_s == AUTO_SETTINGS.rebalance_cost_prior_s
    with trigger.measure_cost():
        clock.now += 2.0  # decision
    with trigger.measure_cost():
        clock.now += 1.0  # migration
    first = trigger.record_rebalance(step=5, extra_cost_s=0.5)  # profiler overhead
    assert first.cost_s == pytest.approx(3.5)
    with trigger.measure_cost():
        clock.now += 0.5
    trigger.record_rebalance(step=40)
    assert trigger.rebalance_cost_s == pytest.approx(2.0)
    assert [r.step for r in trigger.history] == [5, 40]


def test_a_costly_history_raises_the_bar():
    clock = FakeClock()
    trigger = RebalanceTrigger(AUTO, clock=clock)
    with trigger.measure_cost():
        clock.now += 1000.0
    trigger.record_rebalance(step=0)
    for step in range(100, 120):
        trigger.observe([1.0, 0.5])  # saves ~0.25 s x 100 steps = 25 s < 1000 s
        assert trigger.check(step) is None


def test_state_dict_round_trip():
    trigger = RebalanceTrigger(AUTO)
    trigger.record_rebalance(step=7, extra_cost_s=0.25)
    trigger.notify_event()
    restored = RebalanceTrigger(AUTO)
    restored.load_state_dict(trigger.state_dict())
    assert restored.history == trigger.history
    assert restored.check(100) is None  # on_events is off in AUTO, so no event was pending


def test_an_event_during_a_rebalance_triggers_another():
    trigger = RebalanceTrigger(TriggerConfig())
    trigger.notify_event()
    assert trigger.check(1) == "event"
    trigger.notify_event()  # arrives while the first rebalance is profiling
    trigger.record_rebalance(3)
    assert trigger.check(4) == "event"


def test_state_dict_keeps_a_pending_event():
    trigger = RebalanceTrigger(TriggerConfig())
    trigger.notify_event()
    restored = RebalanceTrigger(TriggerConfig())
    restored.load_state_dict(trigger.state_dict())
    assert restored.check(1) == "event"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, r"every_n_steps=0 must be an integer >= 1; use None to disable"),
        ({"every_n_steps": 2.5}, r"every_n_steps=2.5 must be an integer >= 1"),
        ({"every_step": True, "every_n_steps": 5}, r"every_step=True and every_n_steps=5 contradict"),
        ({"every_step": True, "auto": AutoConfig()}, r"every_step=True and auto=True contradict"),
        ({"auto": True}, r"auto=True must be an AutoConfig \(its settings\) or None"),
    ],
)
def test_bad_trigger_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TriggerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 0.0}, r"threshold=0.0 must be a finite number > 0"),
        ({"patience_steps": 0}, r"patience_steps=0 must be an integer >= 1"),
        ({"horizon_steps": 0}, r"horizon_steps=0 must be an integer >= 1"),
        ({"cooldown_steps": -1}, r"cooldown_steps=-1 must be an integer >= 0"),
        (
            {"rebalance_cost_prior_s": float("nan")},
            r"rebalance_cost_prior_s=nan must be a finite number >= 0",
        ),
    ],
)
def test_bad_auto_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoConfig(**kwargs)


def test_bad_observations_and_steps_are_rejected():
    trigger = RebalanceTrigger(AUTO)
    with pytest.raises(ValueError, match=r"stage_busy_s=\[\] must be one finite number >= 0 per stage"):
        trigger.observe([])
    with pytest.raises(ValueError, match=r"stage_busy_s=\[1.0, -1.0\]"):
        trigger.observe([1.0, -1.0])
    with pytest.raises(ValueError, match=r"step=-1 must be an integer >= 0"):
        trigger.check(-1)
    with pytest.raises(ValueError, match=r"extra_cost_s=-1.0 must be a finite number >= 0"):
        trigger.record_rebalance(3, extra_cost_s=-1.0)
