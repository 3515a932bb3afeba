"""A step simulation's timeline as short text, per rank, for tests that state timelines by hand."""

from __future__ import annotations

from lightning_dynmo.balancing.schedule_model import StepSimulation


def per_rank(sim: StepSimulation) -> list[str]:
    """Each rank's timeline as ``"0F0@0-1 0F1@1-2 ..."``: stage, kind, micro-batch @ start-end."""
    ranks = max(t.rank for t in sim.timeline) + 1
    return [
        " ".join(
            f"{t.stage}{t.kind}{t.micro_batch}@{t.start_s:g}-{t.end_s:g}" for t in sim.timeline if t.rank == r
        )
        for r in range(ranks)
    ]
