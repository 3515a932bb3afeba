"""Paired per-round comparison: the held-out ideal, ratios within a round, and the sign-test verdicts."""

from __future__ import annotations

import statistics

import pytest

from benchmarks._lib import paired


def test_the_held_out_ideal_is_not_the_lucky_winner_of_its_own_round() -> None:
    # Two equal placements; "b" was lucky in round 0 only. In-sample, "b" is the best by median and round
    # 0 would compare with its lucky 80 ms; held out, round 0 is judged by the placement that was fastest
    # in the other rounds, "a", at its 100 ms.
    candidates = {"a": [100.0, 100.0, 100.0], "b": [80.0, 101.0, 99.0]}
    assert min(candidates, key=lambda p: statistics.median(candidates[p])) == "b"  # the winner's curse
    assert paired.held_out_best(candidates) == ["a", "b", "b"]
    statics = {"static uniform": candidates["a"]}
    c = paired.compare(statics, {"DynMo x": [100.0] * 3}, candidates, gap=0.05)
    assert c.ideal_ms == (100.0, 101.0, 99.0)
    assert not c.imbalanced
    # Negative control: chosen in-sample, the lucky round makes the equal split look 25% slower there.
    in_sample = paired.compare(statics, {"DynMo x": [100.0] * 3}, candidates, gap=0.05, held_out=False)
    assert in_sample.imbalance[0] == pytest.approx(1.25)


def test_one_round_has_nothing_to_hold_out() -> None:
    assert paired.held_out_best({"a": [3.0], "b": [2.0]}) == ["b"]


def test_ratios_are_paired_within_a_round() -> None:
    # The machine is twice as slow in round 1: ratios of medians would mix rounds, paired ratios do not.
    statics = {"static uniform": [100.0, 200.0, 100.0], "static params": [120.0, 240.0, 120.0]}
    dynmo = {"DynMo partition/time": [80.0, 160.0, 80.0]}
    candidates = {"0-3|4-7": [100.0, 200.0, 100.0], "0-4|5-7": [80.0, 160.0, 80.0]}
    c = paired.compare(statics, dynmo, candidates, gap=0.05)
    assert c.static == "static uniform"
    assert c.speedup["DynMo partition/time"] == (1.25, 1.25, 1.25)
    assert c.of_ideal["DynMo partition/time"] == (1.0, 1.0, 1.0)
    assert c.ideal == ("0-4|5-7",) * 3 and c.held_out
    assert c.imbalanced and c.meets_target()
    assert not c.slower_beyond_noise()


def test_an_imbalance_in_some_rounds_only_is_not_imbalanced() -> None:
    statics = {"static uniform": [100.0, 100.0, 100.0], "static params": [100.0, 100.0, 100.0]}
    candidates = {"0-3|4-7": [100.0, 100.0, 100.0], "0-4|5-7": [70.0, 120.0, 104.0]}
    dynmo = {"DynMo partition/time": [100.0, 100.0, 100.0]}
    c = paired.compare(statics, dynmo, candidates, gap=0.05)
    assert not c.imbalanced
    # Negative control: the same times with the other placement faster in every round are imbalanced.
    candidates["0-4|5-7"] = [70.0, 90.0, 80.0]
    assert paired.compare(statics, dynmo, candidates, gap=0.05).imbalanced


def test_a_gap_below_the_threshold_is_not_imbalanced() -> None:
    statics = {"static uniform": [100.0, 100.0]}
    candidates = {"0-4|5-7": [97.0, 97.0]}  # 3% faster in every round: under a 5% gap
    c = paired.compare(statics, {"DynMo x": [99.0, 99.0]}, candidates, gap=0.05)
    assert not c.imbalanced
    assert paired.compare(statics, {"DynMo x": [99.0, 99.0]}, candidates, gap=0.02).imbalanced


def test_slower_beyond_noise_needs_every_round_and_enough_rounds() -> None:
    statics = {"static uniform": [100.0] * 4}
    candidates = {"0-3|4-7": [100.0] * 4}
    slower = paired.compare(statics, {"DynMo x": [105.0] * 4}, candidates, gap=0.05)
    assert slower.slower_beyond_noise()
    once_faster = paired.compare(statics, {"DynMo x": [105.0, 105.0, 95.0, 105.0]}, candidates, gap=0.05)
    assert not once_faster.slower_beyond_noise()
    three_rounds = {k: v[:3] for k, v in statics.items()}
    few = paired.compare(three_rounds, {"DynMo x": [105.0] * 3}, {"0-3|4-7": [100.0] * 3}, gap=0.05)
    assert not few.slower_beyond_noise()


def test_the_best_variant_is_the_fastest_at_the_median_and_the_target_can_fail() -> None:
    statics = {"static uniform": [100.0, 100.0, 100.0]}
    candidates = {"a": [80.0, 80.0, 80.0]}
    dynmo = {"DynMo slow": [110.0, 100.0, 100.0], "DynMo fast": [95.0, 95.0, 96.0]}
    c = paired.compare(statics, dynmo, candidates, gap=0.05, held_out=False)
    assert c.best == "DynMo fast"
    assert c.median_speedup() == pytest.approx(100 / 95)
    assert not c.meets_target()  # 1.05x the static split but 84% of the ideal
    assert not c.held_out


def test_runs_with_different_round_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="same number"):
        paired.compare({"s": [1.0, 2.0]}, {"d": [1.0]}, {"c": [1.0, 2.0]}, gap=0.05)
    with pytest.raises(ValueError, match="at least one static run"):
        paired.compare({}, {"d": [1.0]}, {"c": [1.0]}, gap=0.05)
