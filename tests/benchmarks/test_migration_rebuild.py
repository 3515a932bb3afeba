"""The migration-rebuild benchmark's quick mode runs both ways in real pipelines and reports every round
(no timing asserted)."""

from __future__ import annotations

import re

from benchmarks.migration_rebuild import main, migration_steps


def test_quick_migration_rebuild_reports_both_ways_every_round(tmp_path):
    out = tmp_path / "migration_rebuild.md"
    report = main(["--quick", "--out", str(out)])
    assert out.read_text() == report + "\n"
    assert re.search(r"^\| 1 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d+, \d+ \|", report, flags=re.M)
    assert re.search(r"Metadata pass / recorded boundaries, the runs' steps: median \*\*[\d.]+x\*\*", report)
    for way in ("recorded boundaries", "metadata pass"):
        assert re.search(rf"- {way}: (a migration step is [+-]\d+ ms|no move was applied)", report)


def test_migration_steps_are_the_timed_steps_a_move_was_applied_at():
    run = {"moves": [2, 4, 6], "step_s": [1.0, 2.0, 3.0, 4.0, 5.0]}  # global steps 3..7 are timed
    assert migration_steps(run, warmup=3) == ([2.0, 4.0], [1.0, 3.0, 5.0])
