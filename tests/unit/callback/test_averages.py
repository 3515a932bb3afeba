"""StepAverages: the callback's running means, fed in batches, equal the mean of every value added."""

from __future__ import annotations

import pytest

from lightning_dynmo.callback.averages import StepAverages


@pytest.mark.parametrize("flush_every", [1, 3, 256])
def test_means_equal_the_plain_mean_whatever_the_flush(flush_every: int) -> None:
    averages = StepAverages(("a", "b"), flush_every=flush_every)
    values = [(0.5, 2.0), (1.5, 4.0), (4.0, 0.0), (2.0, 6.0)]
    for a, b in values[:2]:
        averages.update({"a": a, "b": b})
    assert averages.compute() == pytest.approx({"a": 1.0, "b": 3.0})
    for a, b in values[2:]:
        averages.update({"a": a, "b": b})
    assert averages.compute() == pytest.approx({"a": 2.0, "b": 3.0})  # every value, not the last batch


def test_refuses_missing_or_unknown_names_and_a_bad_flush() -> None:
    averages = StepAverages(("a", "b"))
    with pytest.raises(KeyError, match=r"expected values for \['a', 'b'\], got \['a'\]"):
        averages.update({"a": 1.0})
    with pytest.raises(ValueError, match="flush_every=0 must be an integer >= 1"):
        StepAverages(("a",), flush_every=0)
