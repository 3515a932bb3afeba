"""benchmarks/control_plane.py: the quick run writes both tables; its growth fit picks the right model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.control_plane import fit, main, project


@pytest.mark.distributed
@pytest.mark.slow
def test_quick_run_writes_the_tables_with_collective_counts_flat_in_ranks(tmp_path: Path) -> None:
    out = tmp_path / "control-plane.md"
    main(["--quick", "--out", str(out)])
    text = out.read_text()
    assert "python -m benchmarks.control_plane --quick" in text and "`uptime`" in text
    for label in ("step, no event", "step, with event", "decision (gather + decide + broadcast)"):
        assert f"| {label} |" in text
    # The call counts: the same at 2 and 4 ranks with #13's exchanges, one broadcast per rank before;
    # the SIGTERM agreement rides the per-step exchange (no all-reduce of its own), a gather and a
    # broadcast on gloo; the ring all-gather it replaced, beside it.
    assert "| step, no event | 1 broadcast, 1 gather | 1 broadcast, 1 gather |" in text
    assert "| step, no event, ring all-gather (before 2026-11-27) | 1 all_gather | 1 all_gather |" in text
    event = "2 broadcast, 2 gather"  # the events' bytes: one more gather and broadcast, sized by the rows
    assert f"| step, with event | {event} | {event} |" in text
    ring = "1 all_gather, 1 all_gather_object"
    assert f"| step, with event, ring all-gathers (before 2026-11-27) | {ring} | {ring} |" in text
    decision = "1 all_reduce, 1 broadcast_object_list"
    assert f"| decision (gather + decide + broadcast) | {decision} | {decision} |" in text
    assert "2 broadcast_object_list | 1 all_gather, 1 all_reduce, 4 broadcast_object_list |" in text
    plan = "2 all_reduce, 3 batch_isend_irecv"
    assert f"| migration, 1 layer per replica, one plan | {plan} | {plan} |" in text
    assert (
        f"pre-#13 loop over replicas (today's agreements) | {plan} | 4 all_reduce, 3 batch_isend_irecv |"
        in text
    )


def test_fit_recovers_a_linear_growth_and_projects_it() -> None:
    ranks = [2, 4, 8, 16]
    model, a, b, rms = fit(ranks, [1.0 + 0.5 * p for p in ranks])
    assert model == "P" and a == pytest.approx(1.0) and b == pytest.approx(0.5) and rms < 1e-12
    assert project(model, a, b, 720) == pytest.approx(361.0)


def test_fit_prefers_the_logarithm_for_a_logarithmic_growth() -> None:
    ranks = [2, 4, 8, 16]
    model, _, b, rms = fit(ranks, [2.0 + 3.0 * math.log2(p) for p in ranks])
    assert model == "log2(P)" and b == pytest.approx(3.0) and rms < 1e-12
    # Negative control: the same ranks with a linear growth pick the other model.
    assert fit(ranks, [2.0 + 3.0 * p for p in ranks])[0] == "P"
