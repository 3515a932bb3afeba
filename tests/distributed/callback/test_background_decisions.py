"""``ProfilingConfig(background_decisions=True)``: the search runs in a helper process while the ranks train.

The MoE GPT of ``test_moe_fit`` from its lopsided start, every-step windows balanced by parameter count:
in the foreground the first move lands at step 1 (decided at step 0's end while every rank waits); in the
background at a later step (the helper answers while step 1 runs, and the ranks broadcast the decision at
the first step end whose exchange says it is ready). Both equal the single-process reference exactly;
negative control: the reference that routes whole batches differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from typing_extensions import override

from lightning_dynmo.callback import ProfilingConfig
from tests.distributed.case_fit import Fit, fit_case
from tests.distributed.equivalence import assert_differs, assert_equivalent
from tests.distributed.test_moe_fit import EVERY_STEP, MoERun

pytestmark = pytest.mark.distributed


class SlowSteps(pl.Callback):
    """Every step lasts at least 0.3 s more (its work is a few milliseconds)."""

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(0.3)


@dataclass(frozen=True)
class SlowMoERun(MoERun):
    def rank_fit(self, rank: int, world_size: int, resume: bool) -> Fit:
        fit = super().rank_fit(rank, world_size, resume)
        fit.callbacks.append(SlowSteps())
        return fit


@pytest.mark.slow
def test_a_decision_taken_in_the_background_lands_later_and_training_stays_exact(tmp_path: Path) -> None:
    # Steps of at least 0.3 s: the helper process starts while training does, and answers within a step or
    # two (a decision's search here takes milliseconds) however loaded the machine is.
    foreground = SlowMoERun(steps=8, dynmo=(*EVERY_STEP, ("cost", "params")))
    in_background = ("profiling", ProfilingConfig(background_decisions=True))
    background = replace(foreground, dynmo=(*EVERY_STEP, ("cost", "params"), in_background))
    ref = foreground.reference()
    first_move = {}
    for name, run in (("foreground", foreground), ("background", background)):
        (tmp_path / name).mkdir()
        results = fit_case(run, tmp_path / name)
        for res in results:
            assert res["moved"], f"{name}: the callback must move layers off the lopsided start"
            assert res["placement"] != run.placement
        first_move[name] = results[0]["moved"][0]["step"]
        assert_equivalent(results, ref)
    assert first_move["foreground"] == 1 and first_move["background"] >= 2, first_move
    assert_differs(results, foreground.reference(microbatches=1), "routing whole batches")
