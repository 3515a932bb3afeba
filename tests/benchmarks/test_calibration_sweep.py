"""The in-job calibration: the sweep visits every placement as planned; quick mode reports (no timing)."""

import re
import statistics
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.calibration_sweep import PlacementSweep, Sweep, choice_lines, main, pooled_steps


class _Strategy:
    def __init__(self) -> None:
        self.applied: list[tuple[int, str]] = []
        self.batch = -1

    def apply_placement(self, placement: str) -> None:
        self.applied.append((self.batch, placement))


def _drive(sweep: PlacementSweep, decided_at: int, batches: int) -> tuple[Any, _Strategy]:
    strategy = _Strategy()
    trainer = SimpleNamespace(callbacks=["timer", sweep.dynmo, sweep], strategy=strategy, should_stop=False)
    for b in range(batches):
        if b == decided_at:
            sweep.dynmo.rebalances.append(SimpleNamespace(new="0-2|3-3"))
        strategy.batch = b
        sweep.on_train_batch_end(trainer, None, None, None, b)  # type: ignore[arg-type]
        if trainer.should_stop:
            break
    return trainer, strategy


def test_the_sweep_visits_each_placement_per_cycle_and_no_timed_step_carries_a_move():
    dynmo = SimpleNamespace(rebalances=[])
    sweep = PlacementSweep(dynmo, ("0-0|1-3", "0-1|2-3"), Sweep(cycles=2, settle=2, measure=3))  # type: ignore[arg-type]
    trainer, strategy = _drive(sweep, decided_at=5, batches=100)
    assert sweep.done and trainer.should_stop
    assert dynmo not in trainer.callbacks  # detached at its decision: the visits run without its hooks
    # The callback's choice joins the candidates; every cycle visits all three, the second one rotated.
    assert [p for _, p in strategy.applied] == [
        "0-0|1-3",
        "0-1|2-3",
        "0-2|3-3",
        "0-1|2-3",
        "0-2|3-3",
        "0-0|1-3",
    ]
    moves = [b for b, _ in strategy.applied]
    assert moves == [5, 10, 15, 20, 25, 30]  # every settle + measure steps after the first
    assert [p for p, _ in sweep.visits] == [p for _, p in strategy.applied]
    for (_, timed), move in zip(sweep.visits, moves, strict=True):
        assert timed == [move + 2, move + 3, move + 4]  # the move's step and the next one are not timed
        assert not set(timed) & set(moves)  # a step's interval ends at the next batch start: no migration
    assert trainer.should_stop and len(sweep.visits) == 6


def test_a_sweep_that_never_saw_a_decision_is_not_done():
    sweep = PlacementSweep(SimpleNamespace(rebalances=[]), ("0-0|1-3",), Sweep())  # type: ignore[arg-type]
    trainer, strategy = _drive(sweep, decided_at=10**6, batches=20)
    assert not sweep.done and not strategy.applied and not trainer.should_stop
    with pytest.raises(RuntimeError, match=r"did not finish its visits in 20 steps \(0 run, 0 left\)"):
        sweep.check_done(20)


@pytest.mark.parametrize("schedule", ["1F1B"])
def test_quick_sweep_writes_both_fits_against_the_visits(tmp_path, schedule):
    out = tmp_path / "report.md"
    report = main(["--quick", "--model", "gpt", "--schedule", schedule, "--out", str(out)])
    assert f"python -m benchmarks.calibration_sweep --quick --model gpt --schedule {schedule}" in report
    assert "### gpt, 1F1B (1 jobs x 1 visits per placement, 1 timed steps a visit after 1)" in report
    rows = re.findall(
        r"^\| `(0-\d\|\d-3)` \| [\d.]+ \| [\d.]+ \| [+-][\d.]+% \| [\d.]+ \| ([+-][\d.]+%) \|", report, re.M
    )
    assert [p for p, _ in rows] == ["0-0|1-3", "0-1|2-3", "0-2|3-3"]  # every split, the uniform one included
    assert dict(rows)["0-1|2-3"] == "+0.0%"  # the reference: its ratio to itself is 1
    assert re.search(
        r"Predicted ratios to the uniform split: median \|error\| [\d.]+%, worst [\d.]+% \(the 2 other",
        report,
    )
    assert re.search(r"\| 1 \| `0-\d\|\d-3` \| [+-][\d.]+% \| [+-][\d.]+% \| [\d.]+ \|", report)
    assert out.read_text().startswith(report.split("\n")[0])


def _job(choice: str, predicted_gain: float, visits: dict[str, list[float]]) -> dict[str, Any]:
    return {"choice": choice, "predicted_gain": predicted_gain, "visits_ms": visits}


def test_the_choice_is_judged_in_its_job_and_against_every_jobs_medians():
    runs = [
        # Job 1 chose the split every job measures fastest, and predicted its gain well.
        _job("0-2|3-3", 0.20, {"0-1|2-3": [100.0], "0-2|3-3": [80.0], "0-0|1-3": [120.0]}),
        # Job 2 chose a split its own visits put 10% off its fastest (noise): over all jobs it is 4% off.
        _job("0-0|1-3", 0.10, {"0-1|2-3": [100.0], "0-2|3-3": [75.0], "0-0|1-3": [82.5]}),
    ]
    pooled = {"0-1|2-3": 100.0, "0-2|3-3": 80.0, "0-0|1-3": 83.2}
    text = "\n".join(choice_lines(runs, "0-1|2-3", pooled))
    assert "| 1 | `0-2|3-3` | +20.0% | +20.0% | 1.000 | +20.0% | 1.000 |" in text
    assert "| 2 | `0-0|1-3` | +10.0% | +17.5% | 1.100 | +16.8% | 1.040 |" in text
    # Job 2 misses both bounds in its own job. Over all jobs its choice is within 5% of the best, but its
    # predicted gain is still 6.8 points off: the pooled reading can fail too.
    summary = text.split("\n")[-1]
    assert summary == (
        "In its own job: choice within 5% of the job's measured best in 1 of 2 jobs; predicted gain within 5 "
        "points of the measured in 1 of 2. Against every job's visits: choice within 5% of the measured best "
        "in 2 of 2; predicted gain within 5 points in 1 of 2."
    )


def test_pooled_steps_rank_placements_by_their_ratio_to_each_jobs_uniform_split():
    jobs = [
        {"0-1|2-3": 100.0, "0-2|3-3": 80.0, "0-0|1-3": 82.0},  # a fast job, the only one that chose 0-0|1-3
        {"0-1|2-3": 130.0, "0-2|3-3": 104.0},
        {"0-1|2-3": 130.0, "0-2|3-3": 104.0},
    ]
    pooled = pooled_steps(jobs, "0-1|2-3")
    assert pooled == pytest.approx({"0-1|2-3": 130.0, "0-2|3-3": 104.0, "0-0|1-3": 106.6})
    assert min(pooled, key=pooled.__getitem__) == "0-2|3-3"
    # Negative control: raw medians over the jobs that ran each would crown the fast job's choice.
    raw = {p: statistics.median(job[p] for job in jobs if p in job) for p in pooled}
    assert min(raw, key=raw.__getitem__) == "0-0|1-3"
