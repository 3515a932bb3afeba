"""Bad command-line options of the head-cost and callback-cost benchmarks fail before any job starts."""

from __future__ import annotations

import pytest

from benchmarks import callback_cost, head_cost


def test_head_cost_rejects_a_vocabulary_below_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        head_cost.main(["--vocab", "3072", "1"])
    assert "every vocabulary size must be at least 2" in capsys.readouterr().err


def test_callback_cost_needs_steps_measured_after_the_skipped_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        callback_cost.main(["--steps", "4", "--skip", "3"])
    assert "skip at least 1 step and measure at least 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        callback_cost.main(["--steps", "8", "--skip", "0"])
    assert "skip at least 1 step and measure at least 2" in capsys.readouterr().err
