"""How far DynMo trusts its step model: misses raise the bar, then stop it; a delivered move resets."""

from __future__ import annotations

import pytest

from lightning_dynmo.balancing.trust import PredictionTrust, TrustConfig


def test_a_move_misses_when_it_delivers_less_than_half_its_prediction() -> None:
    trust = PredictionTrust()
    assert trust.observe(0.10, 0.05) is None and trust.misses_in_a_row == 0  # half delivered: a hit
    assert trust.observe(0.10, 0.049) is None and trust.misses_in_a_row == 1
    assert trust.required_gain(0.02) == 0.02  # one miss does not widen yet


def test_delivered_is_what_observe_counts_as_a_hit() -> None:
    trust = PredictionTrust(TrustConfig(delivered_share=0.8))
    assert trust.delivered(0.10, 0.081) and trust.delivered(0.10, 0.30)
    # Negative controls: below the share, and a move that promised no gain (a re-pack), are not delivered.
    assert not trust.delivered(0.10, 0.079)
    assert not trust.delivered(0.0, 0.05) and not trust.delivered(-0.02, 0.05)
    assert trust.observe(0.10, 0.079) is None and trust.misses_in_a_row == 1


def test_misses_in_a_row_widen_the_margin_then_stop_and_a_hit_resets() -> None:
    trust = PredictionTrust(TrustConfig(misses_to_widen=2, misses_to_stop=4))
    trust.observe(0.10, 0.0)
    line = trust.observe(0.20, 0.04)
    assert line is not None and "2 moves in a row missed" in line and "13.0% above min_gain" in line
    assert trust.required_gain(0.02) == pytest.approx(0.02 + (0.10 + 0.16) / 2)
    assert trust.observe(0.10, 0.08) is None  # delivered: trusted again
    assert trust.misses_in_a_row == 0 and trust.required_gain(0.02) == 0.02
    for _ in range(3):
        assert not trust.stopped
        trust.observe(0.10, -0.02)
    assert trust.observe(0.10, -0.02) == (
        "DynMo stops moving layers: 4 moves in a row measured less than 50% of their predicted gain (last: "
        "predicted +10.0%, measured -2.0%); the placement stays as it is."
    )
    assert trust.stopped


def test_a_repack_promising_no_gain_is_not_judged() -> None:
    trust = PredictionTrust(TrustConfig(misses_to_stop=1))
    assert trust.observe(-0.03, -0.08) is None and not trust.stopped


def test_switched_off_rules_never_widen_or_stop() -> None:
    trust = PredictionTrust(TrustConfig(misses_to_widen=None, misses_to_stop=None))
    for _ in range(10):
        assert trust.observe(0.10, 0.0) is None
    assert not trust.stopped and trust.required_gain(0.02) == 0.02


def test_the_state_round_trips() -> None:
    trust = PredictionTrust()
    for _ in range(3):
        trust.observe(0.10, 0.0)
    again = PredictionTrust()
    again.load_state_dict(trust.state_dict())
    assert again.stopped and again.misses_in_a_row == 3 and again.required_gain(0.0) == pytest.approx(0.10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"delivered_share": 0.0}, r"delivered_share=0.0 must be a finite number > 0"),
        ({"delivered_share": 1.5}, r"delivered_share=1.5 must be at most 1"),
        ({"misses_to_widen": 0}, r"misses_to_widen=0 must be an integer >= 1; use None to switch it off"),
        ({"misses_to_stop": 2.5}, r"misses_to_stop=2.5 must be an integer >= 1"),
    ],
)
def test_bad_rules_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrustConfig(**kwargs)  # type: ignore[arg-type]
