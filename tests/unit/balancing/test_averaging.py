"""The bias-corrected moving average's weights: the first sample weighs no more than the rest."""

from __future__ import annotations

import random

import pytest

from lightning_dynmo.balancing.averaging import HistoryWeight


def _average(weight: float, samples: list[tuple[int, float]], corrected: bool = True) -> float:
    """The recursion ``a = h a + (1 - h) x`` over ``(step, x)`` samples, ``h`` from HistoryWeight (or a
    fixed ``weight``, the average started from its first sample)."""
    history, average = HistoryWeight(weight), None
    for step, x in samples:
        h = history.next(step)
        if not corrected:
            h = 0.0 if average is None else weight
        average = x if average is None else h * average + (1.0 - h) * x
    assert average is not None
    return average


def _explicit(weight: float, samples: list[tuple[int, float]]) -> float:
    """The same average written out: sample ``i`` weighs ``(1 - w) w ** (t - t_i)``, normalised."""
    newest = samples[-1][0]
    weights = [(1.0 - weight) * weight ** (newest - step) for step, _ in samples]
    return sum(w * x for w, (_, x) in zip(weights, samples, strict=True)) / sum(weights)


@pytest.mark.parametrize("weight", [0.0, 0.5, 0.8, 0.95])
def test_the_recursion_is_the_normalised_weighted_mean_over_steps(weight: float) -> None:
    rng = random.Random(1)
    step, samples = 0, []
    for _ in range(30):
        step += rng.choice([1, 1, 2, 5])  # some steps skipped, as skipped windows leave them
        samples.append((step, rng.uniform(0.5, 2.0)))
        assert _average(weight, samples) == pytest.approx(_explicit(weight, samples), rel=1e-12)


def test_the_first_sample_keeps_its_share_not_w_to_the_n() -> None:
    first_then_zeros = [(0, 1.0), *((s, 0.0) for s in range(1, 5))]  # its share of the average
    assert _average(0.8, first_then_zeros) == pytest.approx(0.2 * 0.8**4 / (1 - 0.8**5))  # 12%
    # Negative control: the plain recursion started from the first sample keeps 0.8 ** 4 = 41% of it.
    assert _average(0.8, first_then_zeros, corrected=False) == pytest.approx(0.8**4)
    h = HistoryWeight(0.8)
    assert [round(h.next(), 6) for _ in range(3)] == [0.0, round(0.8 / 1.8, 6), round(0.8 * 0.36 / 0.488, 6)]


def test_skipped_steps_age_the_history() -> None:
    consecutive, gap = HistoryWeight(0.5), HistoryWeight(0.5)
    consecutive.next(0), gap.next(0)
    assert consecutive.next(1) == pytest.approx(1 / 3)
    assert gap.next(4) == pytest.approx(0.5**4 * 0.5 / (0.5**4 * 0.5 + 0.5))  # 1/17: the history aged 4 steps


def test_restart_and_bad_input() -> None:
    h = HistoryWeight(0.8)
    h.next(3), h.next(4)
    h.restart()
    assert h.next(10) == 0.0  # after a restart the next sample is the whole average
    with pytest.raises(ValueError, match="step=10 must come after the last sample's step 10"):
        h.next(10)
    for bad in (1.0, -0.1, True):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
            HistoryWeight(bad)  # type: ignore[arg-type]
