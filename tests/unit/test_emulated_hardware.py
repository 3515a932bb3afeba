"""The emulated speed probe reads the emulated slowdown through late wake-ups (a fake clock)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_dynmo.demos import hardware


def _late_clock(oversleeps_s: list[float]) -> tuple[SimpleNamespace, list[float]]:
    """A ``time`` module whose ``sleep(s)`` advances the clock by ``s`` plus the next oversleep."""
    now, asked = [0.0], []

    def sleep(seconds: float) -> None:
        asked.append(seconds)
        now[0] += seconds + oversleeps_s[len(asked) - 1]

    return SimpleNamespace(sleep=sleep, perf_counter=lambda: now[0]), asked


@pytest.mark.parametrize("slowdown", [1.0, 3.0])
def test_the_probe_keeps_its_shortest_sleep(monkeypatch: pytest.MonkeyPatch, slowdown: float) -> None:
    clock, asked = _late_clock([0.012, 0.001, 0.030])
    monkeypatch.setattr(hardware, "time", clock)
    monkeypatch.setattr(hardware, "_SLOWDOWN", slowdown)
    seconds = hardware.emulated_speed_probe(torch.device("cpu"), torch.float64)
    expected = hardware.PROBE_MS * slowdown / 1e3
    assert asked == [expected] * hardware.PROBE_REPEATS
    assert seconds == pytest.approx(expected + 0.001)  # the least late of the three; the first read +0.012


def test_a_slowdown_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"factor=0 must be > 0"):
        hardware.set_emulated_slowdown(0)
