"""The decision on the deciding rank, at once or in a helper process: the same outcome, errors said.

One process here (no process group: the broadcast hands the value back); the 2-rank fits with background
decisions are in ``tests/distributed/callback/test_background_decisions.py``.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import time

import pytest

from lightning_dynmo.balancing import BalanceProblem, LayerCost, Placement
from lightning_dynmo.balancing.microbatches import RetuneOptions
from lightning_dynmo.balancing.policy import BalanceConfig, decide, decision_shapes
from lightning_dynmo.callback.decision import DecisionRunner
from lightning_dynmo.pipeline import schedule_order

COSTS = [LayerCost(fwd_time_s=t, bwd_time_s=2 * t, num_params=100) for t in (1, 1, 1, 1, 4, 4, 4, 4)]
UNIFORM = Placement.from_string("0-1|2-3|4-5|6-7")


def _decision(order):
    return functools.partial(decide, BalanceProblem(COSTS), UNIFORM, BalanceConfig(), 8, order)


def test_the_shapes_a_decision_may_simulate():
    plain = BalanceConfig()
    assert decision_shapes(4, 8, plain) == [(4, 8)]
    repack = BalanceConfig(repack=True)
    assert decision_shapes(4, 8, repack) == [(1, 8), (2, 8), (3, 8), (4, 8)]
    assert decision_shapes(4, 8, repack, repack_layouts={2: [0, 1]}) == [(2, 8), (4, 8)]
    retune = RetuneOptions(counts={2: [4, 8, 16]})
    assert decision_shapes(4, 8, repack, {2: [0, 1]}, retune) == [(2, 4), (2, 8), (2, 16), (4, 8)]


def test_a_tabled_order_pickles_predicts_the_same_and_names_a_shape_it_lacks():
    live = schedule_order("1F1B")
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        pickle.dumps(live)  # negative control: the live lists are built by torch's schedules
    tabled = pickle.loads(pickle.dumps(live.tabled([(4, 8)])))
    assert _decision(tabled)() == _decision(live)()
    with pytest.raises(
        ValueError, match=r"1F1B action lists of 3 stages and 8 micro-batches were not computed"
    ):
        tabled.actions(3, 8)


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_foreground_and_background_give_the_decision_and_its_context(background):
    runner = DecisionRunner(background)
    order = schedule_order("1F1B").tabled([(4, 8)])
    try:
        runner.warm()
        runner.start(lambda: (_decision(order), 0.5), source=0, what="the decision at step 3")
        assert runner.in_flight
        deadline = time.monotonic() + 60
        while not runner.ready():
            assert time.monotonic() < deadline, "the helper never answered"
            time.sleep(0.01)
        decision, context = runner.finish([0], None, contextlib.nullcontext())
    finally:
        runner.close()
    assert decision == _decision(order)() and decision.apply and context == 0.5
    assert not runner.in_flight and not runner.ready()


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_decision_that_cannot_be_taken_or_a_bug_is_raised_not_waited_for(background):
    runner = DecisionRunner(background)
    try:
        # A ValueError while preparing or deciding: "could not decide", on every rank.
        bad = functools.partial(decide, BalanceProblem(COSTS), UNIFORM, BalanceConfig(), 0, "1F1B")
        runner.start(lambda: (bad, None), source=0, what="the decision at step 3")
        with pytest.raises(ValueError, match=r"DynMo could not decide a placement: .*num_microbatches"):
            runner.finish([0], None, contextlib.nullcontext())
        # A call that cannot travel to the helper (background) or any other error: raised with a note.
        runner.start(lambda: (lambda: 1 / 0, None), source=0, what="the decision at step 4")
        with pytest.raises((TypeError, ZeroDivisionError)) as info:
            runner.finish([0], None, contextlib.nullcontext())
        assert "DynMo: raised on rank 0 during the decision at step 4" in info.value.__notes__[-1]
    finally:
        runner.close()
