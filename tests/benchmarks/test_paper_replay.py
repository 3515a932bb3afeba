"""The paper-setup replay's quick mode runs real ZBV pipelines whose blocks sleep part of their backward in
the weight pass, and reports every run, every round and both verdicts (no timing asserted)."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest

from benchmarks._lib.trace_cases import synthetic_trace
from benchmarks.paper_replay import (
    BACKGROUND,
    CONTROL,
    between_events,
    main,
    recipe,
    split_backward,
    under_replayed_costs,
)
from benchmarks.paper_setup import cost_trace, mapped, paper_costs
from benchmarks.projection import Shape
from benchmarks.replay import DYNMO, ReplayJob, profile_against_replayed
from lightning_dynmo.balancing.hardware import Hardware


def test_quick_paper_replay_reports_every_run_every_round_and_the_verdicts(tmp_path):
    out = tmp_path / "paper_replay.md"
    report = main(["--quick", "--sleep-feedback", "--out", str(out)])
    assert out.read_text() == report + "\n"
    assert "every sleep asks for less by its process's wake-up delay" in report
    assert re.search(r"Sleeps lasted x\d\.\d{3} what they asked for", report)
    assert re.search(r"The ranks kept \d+\.\d\d of this machine's \d+ cores busy", report)
    assert "half of a block backward sleeps in its weight pass" in report
    assert "### synthetic, 2 x ZBVZeroBubble (4 stages, 4 mb) (8 layers)" in report
    runs = ("uniform", "params", "head-aware static", "search's best fixed", CONTROL, "DynMo", BACKGROUND)
    for run in runs:
        assert re.search(rf"\| {re.escape(run)} \| [\d.]+ \| [\d.]+ \| \d+% \| \d+% \| `0-\d", report), run
    for variant in ("DynMo", BACKGROUND):
        assert re.search(rf"head-aware static / {variant}: \*\*[\d.]+x\*\* \(per round [\d.]+\)", report)
    assert re.search(r"Best fixed in hindsight \(measured, held out per round\): [a-z' -]+\.", report)
    # Quick mode: 2 untimed steps, then 2 phases of 2 steps.
    windows = r"over the job's 6 steps\): \d+ / \d+ / [\d.]+ s\. Between its events .*: head-aware static / "
    assert len(re.findall(windows, report)) == 2
    between = r"Between its events [^:]*: head-aware static / [A-Za-z, ]+ [\d.]+x \(per round [\d.]+\)\."
    assert len(re.findall(between, report)) == 2
    simulated = (
        r"on the replayed costs \(step model, no job\): head-aware static / [A-Za-z, ]+ [\d.]+x \(per round"
    )
    assert len(re.findall(simulated, report)) == 2
    # The control: the split with a callback that measures and never moves, against the split and DynMo.
    control = re.escape(CONTROL)
    assert re.search(rf"head-aware static / {control} \*\*[\d.]+x\*\* \(per round [\d.]+\)", report)
    assert len(re.findall(rf"{control} / [A-Za-z, ]+ [\d.]+x \(per round [\d.]+\)", report)) == 2
    ran = dict(re.findall(r"^\| ([^|]+) \| [\d.]+ \| .* `([\d|-]+)` \|$", report, re.MULTILINE))
    assert ran[CONTROL] == ran["head-aware static"]  # the same split, never moved
    for variant in ("DynMo", BACKGROUND):  # the summary
        assert re.search(
            rf"\| synthetic \| 2 x ZBVZeroBubble .* \| {variant} \| .* \| (yes|NO) \| (yes|NO) \| [\d.]+x \| "
            r"[\d.]+x \|",
            report,
        )


def test_the_weight_pass_is_half_a_blocks_backward_and_none_of_a_parts():
    trace = split_backward(cost_trace(mapped(synthetic_trace(4, 3), 8, 3), paper_costs(quick=True)))
    row = trace.rows[0]
    assert all(c.bwd_weight_time_s == 0.5 * c.bwd_time_s > 0 for c in row.layers)
    assert 0 < row.last.bwd_weight_time_s < 1e-6 * row.last.bwd_time_s


def test_each_case_is_replayed_as_its_recipe_runs_it():
    # MoE and MoD: rows are steps, spread over the run, DynMo decides every step.
    assert recipe("moe", 4, 5) == {"dynmo": DYNMO}
    # Phased cases: held rows, announced by the event their callback publishes; DynMo acts on events.
    pruning = recipe("pruning", 4, 5)
    assert (pruning["announce"], pruning["hold"], pruning["phases"]) == ("pruned", 5, 4)
    assert "every_step" not in pruning["dynmo"] and pruning["dynmo"]["profiling"].steps == 1
    assert recipe("freezing", 3, 6)["announce"] == "frozen"
    assert recipe("dense", 3, 6)["announce"] == "custom"


def test_between_events_leaves_out_each_decisions_step_and_the_step_it_took_effect_at():
    # Timed steps are global 3-8; decisions took effect at 5 (decided at the end of 4) and at 9 (decided
    # at 8, the last timed step): steps 4, 5 and 8 are left out.
    run = {"step_s": [1.0, 5.0, 3.0, 1.0, 1.0, 4.0], "decided": [5, 9]}
    other = {"step_s": [2.0, 9.0, 9.0, 1.0, 3.0, 9.0]}  # compared on the same steps: 2, 1 and 3
    assert between_events(run, other, warmup=3) == 2.0
    assert between_events({"step_s": [2.0, 4.0], "decided": [1, 2]}, {"step_s": [3.0, 3.0]}, 0) == 1.0
    assert between_events({"step_s": [2.0, 4.0], "decided": []}, {"step_s": [6.0, 6.0]}, warmup=0) == 2.0


def _job(hold: int | None = 2) -> tuple[ReplayJob, Shape]:
    trace = split_backward(cost_trace(mapped(synthetic_trace(4, 3), 8, 3), paper_costs(quick=True)))
    job = ReplayJob(trace, 2, 6, 2, "uniform", schedule="ZBVZeroBubble", num_microbatches=4, hold=hold)
    return job, Shape(2, "ZBVZeroBubble", 4)


def test_under_replayed_costs_follows_dynmos_placement_step_by_step():
    job, shape = _job()
    even, lopsided = "0-1|2-3|4-5|6-7", "0-4|5-5|6-6|7-7"  # rank 0 runs stages 0 and 3 (and the head)
    assert under_replayed_costs(job, shape, {"placements": []}, even, even) == 1.0
    moved_untimed = under_replayed_costs(job, shape, {"placements": [(1, lopsided)]}, even, even)
    moved_halfway = under_replayed_costs(job, shape, {"placements": [(4, lopsided)]}, even, even)
    assert moved_untimed < moved_halfway < 1.0  # a move before the timed steps counts for all of them
    # Negative control: a move recorded after the last step never ran.
    assert under_replayed_costs(job, shape, {"placements": [(6, lopsided)]}, even, even) == 1.0
    # And the other way round: the lopsided static split over DynMo's even one.
    assert under_replayed_costs(job, shape, {"placements": [(1, even)]}, lopsided, lopsided) > 1.0


def _callback(job: ReplayJob, decided_at: int, scale: float, head_scale: float) -> SimpleNamespace:
    row = job.true_trace().rows[job.trace_replay().row(decided_at - 1)]
    costs = [
        dataclasses.replace(c, fwd_time_s=scale * c.fwd_time_s, bwd_time_s=2 * scale * c.bwd_time_s)
        for c in row.layers
    ]
    head = dataclasses.replace(
        row.last, fwd_time_s=head_scale * row.last.fwd_time_s, bwd_time_s=head_scale * row.last.bwd_time_s
    )
    return SimpleNamespace(
        last_costs=costs,
        last_hardware=Hardware(last_stage_extra=head),
        rebalances=[SimpleNamespace(step=decided_at)],
        profiling=SimpleNamespace(steps=1),
    )


def test_profile_against_replayed_divides_the_profile_by_the_row_it_was_taken_on():
    job, _ = _job()
    got = profile_against_replayed(job, _callback(job, decided_at=5, scale=1.2, head_scale=1.1))
    assert got == pytest.approx({"fwd": 1.2, "bwd": 2.4, "last": 1.1})
    # Against another row than the profiled one the ratios would differ: the rows differ in cost.
    rows = job.true_trace().rows
    assert rows[job.trace_replay().row(4)] != rows[job.trace_replay().row(2)]
    # No figure where the trace changes every step, or the window straddled two rows, or no decision.
    assert profile_against_replayed(_job(hold=None)[0], _callback(job, 5, 1.2, 1.1)) is None
    two_steps = _callback(job, decided_at=5, scale=1.2, head_scale=1.1)
    two_steps.profiling.steps = 3
    assert profile_against_replayed(job, two_steps) is None
    two_steps.rebalances = []
    assert profile_against_replayed(job, two_steps) is None
