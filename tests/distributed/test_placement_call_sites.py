"""Where ``apply_placement`` may be called during fit: exact at step boundaries, refused inside a step.

Inside a step (after the schedule step, before Lightning's backward) the step's gradients are held by the
loss that carries them into ``backward`` (``lightning_dynmo.pipeline.step.grads``): a migration then would
move layers without them and lose that step's update, so the strategy refuses it on every rank. From
``on_before_optimizer_step`` the gradients are in ``.grad`` and move with the layers: training equals the
single-process reference in float64.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import Run, assert_matches_reference, fit_pipelined, max_param_diff, reference

pytestmark = pytest.mark.distributed

MOVES = {1: "0-3|4-5", 3: "0-0|1-5"}  # optimizer step -> placement (6 layers, start "0-2|3-5")


class MoveFromHook(DemoGPT):
    """Applies ``MOVES`` from the LightningModule hook named by ``hook`` at those optimizer steps."""

    def __init__(self, hook: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook = hook

    def _maybe_move(self, hook: str) -> None:
        step, strategy = self.trainer.global_step, self.trainer.strategy
        if not isinstance(strategy, DynMoStrategy):
            return  # the single-process reference has nothing to move
        if hook == self.hook and step in MOVES and str(strategy.placement) != MOVES[step]:
            strategy.apply_placement(MOVES[step])

    def on_pipeline_step_end(self, loss: Any, batch: Any, batch_idx: int) -> None:
        self._maybe_move("on_pipeline_step_end")

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self._maybe_move("on_before_zero_grad")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._maybe_move("on_before_optimizer_step")


class NoInStepCheck(DynMoStrategy):
    """Negative control: lets a migration happen inside the step, as before the check existed."""

    def apply_placement(self, new: Any) -> Any:
        self._pipeline.step_in_flight = False
        return super().apply_placement(new)


RUN = Run(
    model_cls=MoveFromHook,
    model_args=("on_before_optimizer_step",),
    num_layers=6,
    placement="0-2|3-5",
    accumulate=2,
    clip=0.05,
    steps=5,
)


def test_migrating_from_on_before_optimizer_step_is_exact(tmp_path: Any) -> None:
    results = fit_pipelined(RUN, tmp_path)
    assert all(res["placement"] == MOVES[3] for res in results)
    ref = reference(RUN)  # the single-process module never migrates (one stage)
    assert_matches_reference(results, ref, RUN)
    # Negative control: the same migrations inside the step lose their step's gradients.
    lost = fit_pipelined(
        replace(RUN, model_args=("on_pipeline_step_end",)), tmp_path, strategy_cls=NoInStepCheck
    )
    assert all(res["placement"] == MOVES[3] for res in lost)
    assert max_param_diff(lost, ref) > 1e-4


@pytest.mark.parametrize("hook", ["on_pipeline_step_end", "on_before_zero_grad"])
def test_migrating_inside_the_step_is_refused_on_every_rank(hook: str, tmp_path: Any) -> None:
    run = replace(RUN, model_args=(hook,), steps=2)
    match = (
        r"(?s)rank 0 -----.*apply_placement was called inside a training step.*rank 1 -----.*inside a train"
    )
    with pytest.raises(AssertionError, match=match):
        fit_pipelined(run, tmp_path)
