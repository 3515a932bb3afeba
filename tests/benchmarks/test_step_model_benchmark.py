"""The step-model benchmark's quick mode keeps running and reports what it must (no timing asserted)."""

import pytest

from benchmarks.step_model import Options, job_for, main, per_op_overhead, predicted_ms


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
    # A near-zero-sleep step of 1 s, less its blocks' own compute, spread over the actions' chain: it adds
    # to every prediction, as the blocks' compute and each rank's sleep overshoot do.
    block_ms = (0.5, 1.0)
    per_op = per_op_overhead(job, 1.0, block_ms)
    assert 0 < per_op < 1.0
    bare = predicted_ms(job, job.candidates[0], 0.0)
    assert (
        bare
        < predicted_ms(job, job.candidates[0], per_op)
        < predicted_ms(job, job.candidates[0], per_op, None, block_ms)
    )
    assert predicted_ms(job, job.candidates[0], 0.0, [1.1] * 4) == pytest.approx(1.1 * bare)
