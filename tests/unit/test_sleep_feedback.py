"""SLEEPS' feedback: a sleep asks for less by the wake-up delay its process's last sleeps had (fake clock)."""

from __future__ import annotations

import pytest

from lightning_dynmo.demos import cost
from lightning_dynmo.demos.cost import SleepAccount


class _LateClock:
    """time.sleep and time.perf_counter of a machine on which every sleep wakes ``late_s`` late."""

    def __init__(self, late_s: float) -> None:
        self.now, self.late_s, self.asked = 0.0, late_s, []

    def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        self.now += seconds + self.late_s

    def perf_counter(self) -> float:
        return self.now


def _slept(account: SleepAccount, clock: _LateClock, monkeypatch, calls: int, seconds: float) -> None:
    monkeypatch.setattr(cost.time, "sleep", clock.sleep)
    monkeypatch.setattr(cost.time, "perf_counter", clock.perf_counter)
    for _ in range(calls):
        account.sleep(seconds)


def test_with_feedback_the_sleeps_last_what_they_ask_after_the_delay_is_learnt(monkeypatch):
    clock = _LateClock(late_s=0.0005)
    account = SleepAccount(feedback=True)
    _slept(account, clock, monkeypatch, calls=400, seconds=0.002)
    assert account.wakeup_s == pytest.approx(0.0005, rel=1e-3)
    assert clock.asked[-1] == pytest.approx(0.0015, rel=1e-3)  # asks the delay less
    assert account.requested_s == pytest.approx(400 * 0.002)
    # Over the run, slept / requested: the learning's first sleeps late, the rest on time.
    assert 1.0 < account.overshoot < 1.02


def test_without_feedback_every_sleep_is_late_by_the_delay(monkeypatch):  # the negative control
    clock = _LateClock(late_s=0.0005)
    account = SleepAccount()
    _slept(account, clock, monkeypatch, calls=400, seconds=0.002)
    assert account.overshoot == pytest.approx(1.25)
    assert set(clock.asked) == {0.002} and account.wakeup_s == 0.0


def test_a_delay_longer_than_the_sleep_asks_for_nothing_and_a_stall_is_forgotten(monkeypatch):
    account = SleepAccount(feedback=True, wakeup_s=0.05)  # one long stall just went into the estimate
    clock = _LateClock(late_s=0.0002)
    _slept(account, clock, monkeypatch, calls=300, seconds=0.001)
    assert clock.asked[0] == 0.0  # never a negative sleep
    assert account.wakeup_s == pytest.approx(0.0002, rel=1e-2)  # a sleep of 0 updates the estimate too
    assert clock.asked[-1] == pytest.approx(0.0008, rel=1e-2)
