"""The step-model benchmark's quick mode keeps running and reports what it must (no timing asserted)."""

import pytest

from benchmarks.step_model import (
    Options,
    job_for,
    main,
    per_op_overhead,
    predicted_ms,
    stage_compute_ms,
    stage_sizes,
)


def test_quick_step_model_benchmark_writes_predicted_against_measured(tmp_path):
    out = tmp_path / "report.md"
    report = main(["--quick", "--out", str(out)])
    assert out.read_text() == report + "\n"
    assert f"`python -m benchmarks.step_model --quick --out {out}`" in report
    assert "### 2 ranks, 1F1B (2 stages, 4 layers, 4 micro-batches)" in report
    assert (
        "| placement | predicted from the asked sleeps, no overhead (ms) | predicted (ms) | measured (ms) "
        "| error |" in report
    )
    assert report.count("| `0-") == 3  # uniform, min-max (also the model's best here), skewed
    assert "Predicted best `" in report and "median |error|" in report


def test_candidates_and_overhead_follow_the_schedule():
    job = job_for("ZBVZeroBubble", 4, Options())
    assert job.num_stages == 8 and len(job.fwd_ms) == 16 and job.microbatches == 8
    assert job.candidates[0] == "0-1|2-3|4-5|6-7|8-9|10-11|12-13|14-15"  # uniform first
    assert len(set(job.candidates)) == len(job.candidates) >= 3
    # The cost per action is the one at which the model reproduces the calibration's measured step (its
    # sleeps as they took, its blocks' own compute); it adds to every prediction, as those do.
    block_ms, overshoot = {2: (0.5, 1.0, 0.4), 1: (0.5, 1.0, 0.4), 9: (0.6, 1.5, 0.9)}, [1.01] * 4
    bare = predicted_ms(job, job.candidates[0], 0.0)
    calibration_s = 1.2 * bare / 1e3
    per_op = per_op_overhead(job, calibration_s, overshoot, block_ms)
    assert 0 < per_op < calibration_s
    fitted = predicted_ms(job, job.candidates[0], per_op, overshoot, block_ms)
    assert fitted == pytest.approx(1e3 * calibration_s, rel=1e-6)
    assert bare < predicted_ms(job, job.candidates[0], per_op) < fitted
    assert predicted_ms(job, job.candidates[0], 0.0, [1.1] * 4) == pytest.approx(1.1 * bare)
    # A calibration already slower in the model than measured leaves nothing per action.
    assert per_op_overhead(job, 0.5 * bare / 1e3, overshoot, block_ms) == 0.0


def test_a_stage_is_timed_as_its_schedule_runs_its_backward():
    zbv, one_f_one_b = job_for("ZBVZeroBubble", 2, Options()), job_for("1F1B", 2, Options())
    assert 1 in stage_sizes(zbv) and 2 in stage_sizes(zbv)  # the uniform split and the skewed one's
    fwd, bwd, wgrad = stage_compute_ms(zbv, 2, repeats=3)
    assert fwd > 0 and bwd > wgrad > 0  # torch's weight-gradient pass, apart from the input gradient's
    fwd, bwd, wgrad = stage_compute_ms(one_f_one_b, 2, repeats=3)
    assert fwd > 0 and bwd > 0 and wgrad == 0.0  # one backward pass: no weight-gradient action
