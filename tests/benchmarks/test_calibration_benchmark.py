"""The calibration benchmark's quick mode keeps running and reports what it must (no timing asserted)."""

import re

from benchmarks.calibration import candidates, choice_lines, main, parts_line, repeat_line


def test_candidates_are_every_2_stage_split_or_the_uniform_split_and_its_one_move_neighbours():
    assert candidates("1F1B", 4) == ["0-0|1-3", "0-1|2-3", "0-2|3-3"]
    zbv = candidates("ZBVZeroBubble", 8)
    assert zbv[0] == "0-1|2-3|4-5|6-7" and len(zbv) == 7 == len(set(zbv))  # 3 boundaries x 2 moves + 1
    assert "0-0|1-3|4-5|6-7" in zbv and "0-1|2-3|4-6|7-7" in zbv


def test_quick_calibration_writes_predicted_against_measured(tmp_path):
    out = tmp_path / "report.md"
    report = main(["--quick", "--model", "gpt", "--schedule", "1F1B", "--out", str(out)])
    assert "python -m benchmarks.calibration --quick --model gpt --schedule 1F1B" in report
    assert "### gpt, 1F1B (1 rounds, medians of steps 2+)" in report
    assert "| placement | predicted (ms) | measured (ms) | error | measured, rounds' range |" in report
    assert len(re.findall(r"^\| `0-", report, flags=re.M)) == 3  # one row per placement
    assert "Median |error|" in report and "Predicted best `" in report
    assert re.search(r"Repeat control: .* median [\d.]+ ms against [\d.]+ \([+-][\d.]+%\)", report)
    assert re.search(r"as profiled: head \+ loss = [\d.]+ blocks \(per round [\d.]+-[\d.]+\)", report)
    assert re.search(r"\| 1 \| `0-\d\|\d-3` \| [\d.]+ \| [+-][\d.]+% \| [+-][\d.]+% \| [\d.]+ \|", report)
    assert re.search(r"Choice within 5% of the measured best in [01] of 1 measured round", report)
    assert out.read_text().startswith(report.split("\n")[0])


def test_the_choice_is_judged_against_the_held_out_best_and_a_choice_not_measured_is_said():
    measured = {"0-3|4-7": [100.0, 102.0, 98.0], "0-4|5-7": [90.0, 91.0, 92.0], "0-5|6-7": [95.0, 96.0, 97.0]}
    profiles = [
        {"choice": "0-4|5-7", "predicted_gain": 0.08, "per_op_s": 2e-4},  # measured 10%: within 5 points
        {"choice": "0-5|6-7", "predicted_gain": 0.16},  # measured 5.9%: 10 points off, 5.5% slower than best
        {"choice": "0-6|7-7", "predicted_gain": 0.20},  # never run fixed
    ]
    lines = "\n".join(choice_lines(profiles, measured, "0-3|4-7"))
    assert "| 1 | `0-4|5-7` | 0.200 | +8.0% | +10.0% | 1.000 |" in lines
    assert "| 2 | `0-5|6-7` | 0.000 | +16.0% | +5.9% | 1.055 |" in lines
    assert "| 3 | `0-6|7-7` | 0.000 | +20.0% | not measured | - |" in lines
    assert "in 1 of 2 measured round(s); predicted gain within 5 points of the measured in 1 of 2" in lines
    # Medians of the judged rounds: predicted 12.0%, measured 7.9%: within 5 points (each round alone not).
    assert "Median over those rounds: predicted gain +12.0%, measured +7.9% (within 5 points)." in lines
    # From the placements' medians (100, 91, 96): the two judged choices gain 9% and 4%, median 6.5%.
    assert "one job against one): median +6.5% against the predicted +12.0% (NOT within" in lines
    off = "\n".join(choice_lines([{**profiles[1], "predicted_gain": 0.30}], measured, "0-3|4-7"))
    assert "predicted gain +30.0%, measured +5.0% (NOT within 5 points)." in off


def test_the_repeat_control_says_how_far_two_measurements_of_one_placement_disagree():
    line = repeat_line([100.0, 110.0, 90.0], [105.0, 100.0, 88.0])
    # Medians 100 and 100; per round 5.0%, 9.1%, 2.2%.
    assert "median 100.0 ms against 100.0 (+0.0%)" in line
    assert "differ by 5.0% (median), 9.1% (worst)" in line
    assert "(-10.0%)" in repeat_line([100.0], [90.0])


def test_the_parts_line_says_the_head_and_the_embedding_in_median_blocks():
    from lightning_dynmo.balancing import Hardware, LayerCost

    costs = [LayerCost(fwd_time_s=1.0, bwd_time_s=2.0)] * 3 + [LayerCost(fwd_time_s=2.0, bwd_time_s=4.0)]
    hardware = Hardware(
        first_stage_extra=LayerCost(fwd_time_s=0.5, bwd_time_s=1.0),
        last_stage_extra=LayerCost(fwd_time_s=4.0, bwd_time_s=8.0),
    )
    line = parts_line([{"costs": costs, "hardware": hardware}])
    assert "head + loss = 4.00 blocks (per round 4.00-4.00), embedding = 0.50 blocks" in line  # block 3 s
    assert "run whole" not in line  # nothing measured whole: no ratio to report
    # Two rounds under a split-backward schedule: alike blocks (10 parameters) measured whole (bwd/fwd 1.5)
    # and split (2.0 and 2.5, their weight-gradient halves timed): 0.75 and 0.6.
    alike = [LayerCost(fwd_time_s=2.0, bwd_time_s=3.0, bwd_weight_time_s=3.0, num_params=10)]

    def split(bwd: float) -> LayerCost:
        return LayerCost(fwd_time_s=1.0, bwd_time_s=bwd, bwd_weight_time_s=bwd / 2, num_params=10)

    rounds = [{"costs": [*alike, split(b)], "hardware": hardware} for b in (2.0, 2.5)]
    assert "costs 0.68x its split one (per round 0.60-0.75)" in parts_line(rounds)
