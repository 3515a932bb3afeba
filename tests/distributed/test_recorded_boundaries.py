"""Stages built from recorded boundaries after a migration train as the single process does (float64).

After a migration the strategy builds the new stages from what crossed each layer boundary in the first
build's metadata pass (lightning_dynmo/pipeline/step/boundaries.py), so torch's metadata pass (a
micro-batch's forward and backward through the whole pipeline) runs once, at the first build, not again
after every move. The runs here migrate twice under 1F1B and under the zero-bubble V schedule (two
stages per rank, same-rank neighbours) and count the passes.

Negative control: a record that says the boundary tensors need no gradients builds stages that would cut
the backward at every boundary; the stage check of its first outputs stops the run on every rank and
names the difference.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from lightning_dynmo.pipeline.step import boundaries
from lightning_dynmo.pipeline.step.stage import StageModule
from lightning_dynmo.strategy import replacement
from tests.distributed.fitting import Run, assert_matches_reference, fit_worker, reference
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

ONE_F_ONE_B = Run(num_layers=6, placement="0-2|3-5", steps=6, migrations=((2, "0-3|4-5"), (4, "0-0|1-5")))
ZBV = Run(
    schedule="ZBVZeroBubble",
    num_layers=8,
    placement="0-1|2-3|4-5|6-7",
    steps=6,
    migrations=((2, "0-2|3-3|4-4|5-7"), (4, "0-0|1-3|4-6|7-7")),
)


def _spoiled(*args: Any) -> dict[int, boundaries.StageTensors] | None:
    """The records with every boundary tensor marked as needing no gradient."""
    tensors = _RECORDED(*args)
    if tensors is None:
        return None

    def gradless(specs: boundaries.Specs) -> boundaries.Specs:
        return tuple(s._replace(requires_grad=False) for s in specs)

    last = max(tensors)
    return {
        s: boundaries.StageTensors(
            t.inputs if s == 0 else gradless(t.inputs), t.outputs if s == last else gradless(t.outputs)
        )
        for s, t in tensors.items()
    }


_RECORDED = replacement.recorded_stage_tensors


def _worker(rank: int, world_size: int, run: Run, mode: str) -> dict[str, Any]:
    passes: list[int] = []
    original = StageModule.forward

    def counted(self: StageModule, *args: Any, **kwargs: Any) -> Any:
        if self._inferring:  # torch's metadata pass runs the stage's forward inside shape_inference()
            passes.append(1)
        return original(self, *args, **kwargs)

    StageModule.forward = counted  # type: ignore[method-assign]  # this forked rank only
    if mode == "no records":
        replacement.recorded_stage_tensors = lambda *args: None  # type: ignore[assignment]
    elif mode == "spoiled":
        replacement.recorded_stage_tensors = _spoiled  # type: ignore[assignment]
    out = fit_worker(rank, world_size, run, {})
    out["passes"] = len(passes)
    return out


def _fit(run: Run, tmp_path: Any, mode: str) -> list[dict[str, Any]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return run_distributed(_worker, run.world_size, tmp_path, timeout_s=120, args=(run, mode))


@pytest.mark.parametrize("run", [ONE_F_ONE_B, ZBV], ids=["1F1B", "ZBV"])
def test_migrations_build_stages_from_the_record_and_train_as_one_process(run: Run, tmp_path: Any) -> None:
    recorded = _fit(run, tmp_path / "recorded", "records")
    inferred = _fit(run, tmp_path / "inferred", "no records")
    stages_per_rank = 2 if run.schedule == "ZBVZeroBubble" else 1
    for rank, (r, i) in enumerate(zip(recorded, inferred, strict=True)):
        assert r["applied"] == [p for _, p in run.migrations], f"rank {rank} did not migrate"
        # One metadata pass per local stage at the first build; after each migration only without records.
        assert r["passes"] == stages_per_rank, f"rank {rank} ran {r['passes']} metadata passes"
        assert i["passes"] == stages_per_rank * (1 + len(run.migrations))
    ref = reference(run)
    assert_matches_reference(recorded, ref, run)
    assert_matches_reference(inferred, ref, run)


def test_negative_control_a_record_without_gradients_stops_the_run_by_name(tmp_path: Any) -> None:
    built = r"sends \(2, 16, 32\) float64 \(grad\) but its stage was built for \(2, 16, 32\) float64,"
    with pytest.raises(AssertionError, match=built):
        _fit(ONE_F_ONE_B, tmp_path, "spoiled")


def test_a_smaller_batch_after_a_build_from_the_record_runs_the_metadata_pass_again(tmp_path: Any) -> None:
    # The migration at the last batch builds from the record of the full batches; the last batch is
    # smaller, so the strategy builds again for its shapes, with torch's pass.
    run = replace(ONE_F_ONE_B, extra_samples=4, migrations=((2, "0-3|4-5"), (6, "0-0|1-5")))
    results = _fit(run, tmp_path, "records")
    for rank, res in enumerate(results):
        assert res["applied"] == ["0-3|4-5", "0-0|1-5"], f"rank {rank}"
        assert res["passes"] == 2, f"rank {rank}: {res['passes']} passes (the first build, the smaller batch)"
    assert_matches_reference(results, reference(run), run)
