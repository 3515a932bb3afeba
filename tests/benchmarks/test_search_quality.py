"""The search-quality comparison: its quick mode writes every row, and its ratio can read below 1.

With few placements DynMo's decision on a row is the exact optimum of that row's predicted step, so the
head-aware split (partitioned on row 0) can never be predicted faster on it: every ratio is at least 1,
and row 0's is exactly 1. The negative control replaces the decision by one that keeps the uniform split:
the split then reads faster on some row, so the comparison can fail.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

import benchmarks.search_quality as search_quality
from benchmarks._lib.trace_cases import synthetic_trace
from benchmarks.paper_replay import paper_trace
from benchmarks.paper_setup import paper_costs
from benchmarks.projection import Shape


def test_quick_search_quality_writes_every_row(tmp_path):
    out = tmp_path / "search_quality.md"
    report = search_quality.main(["--quick", "--out", str(out)])
    assert out.read_text() == report + "\n"
    assert "Command: `python -m benchmarks.search_quality --quick --out" in report
    assert "**projected**" in report
    assert "### synthetic, 2 x ZBVZeroBubble (4 stages, 4 mb)" in report
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| [\d.]+ \| exact search", report, flags=re.M)
    assert [int(r) for r, _ in rows] == [0, 1, 2]
    assert re.search(r"rows where the split is predicted faster than DynMo's own decision: 0 of 3", report)


def test_an_exact_decision_is_never_beaten_by_the_split_and_a_kept_uniform_is(monkeypatch):
    trace = paper_trace(synthetic_trace(4, 3), 8, paper_costs(True), 1.0, split=True)
    shape = Shape(2, "ZBVZeroBubble", 4)
    rows = search_quality.compare(trace, shape, budget=16)
    assert rows[0].ratio == pytest.approx(1.0, rel=1e-12)
    assert all(r.ratio >= 1 - 1e-12 for r in rows)

    decide = search_quality.decide

    def keeps_uniform(problem, current, *args, **kwargs):
        return dataclasses.replace(decide(problem, current, *args, **kwargs), proposed=current)

    with monkeypatch.context() as patch:
        patch.setattr(search_quality, "decide", keeps_uniform)
        kept = search_quality.compare(trace, shape, budget=16)
    assert min(r.ratio for r in kept) < 1 - 1e-6
