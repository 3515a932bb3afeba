"""The replay benchmark's quick mode runs real pipelines and reports what it must (no timing asserted)."""

from __future__ import annotations

import re

import pytest

from benchmarks._lib.trace_cases import TRACES, cost_trace, synthetic_trace
from benchmarks.replay import ReplayJob, fixed_placements, repack_line, select_traces
from benchmarks.replay import main as replay_main


@pytest.mark.parametrize("compute", ["dense", "linear"])
def test_quick_replay_reports_every_run_the_idle_shares_and_the_parts(tmp_path, compute):
    out = tmp_path / "replay.md"
    report = replay_main(["--quick", "--repack", "--block-compute", compute, "--out", str(out)])
    assert out.read_text() == report + "\n"
    assert f"`python -m benchmarks.replay --quick --repack --block-compute {compute} --out {out}`" in report
    assert f"blocks compute `{compute}` before their sleep" in report
    assert re.search(r"DynMo \+ re-pack: ended on [12] of 2 ranks", report)
    assert "### synthetic, 2 ranks (4 layers, cost curve: proportional" in report
    for run in ("static uniform", "static params", "best fixed", "DynMo"):
        assert re.search(rf"\| {run} \| [\d.]+ \| \d+% \| \d+% \| `0-\d", report), run
    assert re.search(r"Sleeps compensated: .* a block call costs \d+ us forward / \d+ us backward", report)
    assert re.search(
        r"\| synthetic \| 2 \| [\d.]+x \| \d+% \| \d+% -> \d+% \| (yes|NO) \|", report
    )  # summary
    assert "of the best fixed placement" in report and "slower than static beyond noise" in report
    assert re.search(
        r"its windows per round \(decided, skipped, seconds it reported\): \d+ / \d+ / [\d.]+ s", report
    )
    assert re.search(r"better static / DynMo per round: [\d.]+\)", report)  # one round in the quick run
    assert re.search(r"averaged over the run: min [\d.]+ / median [\d.]+ / max [\d.]+ ms", report)
    # DynMo's profiler measured the emulated head as the last-stage part (not lost among the blocks).
    last = re.search(r"last ([\d.]+) ms \(true ([\d.]+)\)", report)
    assert last is not None and float(last.group(1)) > 0.5 * float(last.group(2)) > 0


def test_best_fixed_is_the_partition_of_the_mean_costs_with_the_head():
    trace = cost_trace(synthetic_trace(4, 3))
    fixed = fixed_placements(trace, 2)
    assert fixed["static uniform"] == "0-1|2-3"
    assert fixed["best fixed"] == "0-2|3-3"  # the head (about 7 blocks) sits on the last stage
    job = ReplayJob(trace, ranks=2, steps=7, warmup=1, placement="uniform")
    assert job.replayed_rows() == [0, 0, 1, 1, 2, 2]  # steps 1-6 of 7 over 3 rows: row s x 3 // 7
    short = ReplayJob(trace, ranks=2, steps=2, warmup=0, placement="uniform")
    assert short.replayed_rows() == [0, 1]  # shorter than the trace: rows skipped evenly


def test_the_repack_line_says_ranks_released_and_throughput_kept():
    line = repack_line(
        8, {"stages": [4, 4, 5], "kept": [0.97, 1.0, 0.95], "placement": "0-9|10-19|20-29|30-30"}
    )
    assert "ended on 4, 4, 5 of 8 ranks" in line and "**97%**" in line
    assert "throughput per rank 1.94x" in line  # 0.97 x 8 / 4


def test_a_case_without_a_trace_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"no trace of the cases \['nope'\]"):
        replay_main(["--case", "nope", "--traces", str(tmp_path), "--out", str(tmp_path / "r.md")])


def test_every_case_is_replayed_then_the_dense_model_and_a_selection_keeps_only_its_cases():
    cases = [s.case for s in select_traces(TRACES, None)]
    assert cases[-1] == "dense" and len(cases) == len(set(cases)) >= 2
    picked = select_traces(TRACES, ["dense", "mod"])
    assert [s.case for s in picked] == ["mod", "dense"]
    dense = cost_trace(picked[1])
    assert dense.num_rows == 1 and dense.num_layers == picked[0].num_layers  # the same model, no dynamism
    assert len({c.time_s for c in dense.rows[0].layers}) == 1 and dense.rows[0].last.time_s > 0  # the head
