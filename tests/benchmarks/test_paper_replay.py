"""The paper-setup replay's quick mode runs real ZBV pipelines whose blocks sleep part of their backward in
the weight pass, and reports every run, every round and both verdicts (no timing asserted)."""

from __future__ import annotations

import re

from benchmarks._lib.trace_cases import synthetic_trace
from benchmarks.paper_replay import BACKGROUND, between_events, main, recipe, split_backward
from benchmarks.paper_setup import cost_trace, mapped, paper_costs
from benchmarks.replay import DYNMO


def test_quick_paper_replay_reports_every_run_every_round_and_the_verdicts(tmp_path):
    out = tmp_path / "paper_replay.md"
    report = main(["--quick", "--out", str(out)])
    assert out.read_text() == report + "\n"
    assert "half of a block backward sleeps in its weight pass" in report
    assert "### synthetic, 2 x ZBVZeroBubble (4 stages, 4 mb) (8 layers)" in report
    runs = ("uniform", "params", "head-aware static", "search's best fixed", "DynMo", BACKGROUND)
    for run in runs:
        assert re.search(rf"\| {run} \| [\d.]+ \| [\d.]+ \| \d+% \| \d+% \| `0-\d", report), run
    for variant in ("DynMo", BACKGROUND):
        assert re.search(rf"head-aware static / {variant}: \*\*[\d.]+x\*\* \(per round [\d.]+\)", report)
    assert re.search(r"Best fixed in hindsight \(measured, held out per round\): [a-z' -]+\.", report)
    # Quick mode: 2 untimed steps, then 2 phases of 2 steps.
    windows = r"over the job's 6 steps\): \d+ / \d+ / [\d.]+ s\. Between its events .*: head-aware static / "
    assert len(re.findall(windows, report)) == 2
    assert len(re.findall(r"head-aware static / [A-Za-z, ]+ [\d.]+x \(per round [\d.]+\)\.", report)) == 2
    for variant in ("DynMo", BACKGROUND):  # the summary
        assert re.search(
            rf"\| synthetic \| 2 x ZBVZeroBubble .* \| {variant} \| .* \| (yes|NO) \| (yes|NO) \|", report
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
