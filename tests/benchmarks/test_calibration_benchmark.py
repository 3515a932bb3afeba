"""The calibration benchmark's quick mode keeps running and reports what it must (no timing asserted)."""

from benchmarks.calibration import candidates, main


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
    assert "| placement | predicted (ms) | measured (ms) | error |" in report
    assert report.count("| `0-") == 3
    assert "Median |error|" in report and "Predicted best `" in report
    assert out.read_text().startswith(report.split("\n")[0])
