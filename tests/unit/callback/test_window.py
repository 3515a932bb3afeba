"""The profiling window's skipping rule (``skip_balanced``) on agreed per-stage loads."""

from __future__ import annotations

from lightning_dynmo.balancing.trigger import RebalanceTrigger, TriggerConfig
from lightning_dynmo.callback.window import SKIP_DRIFT, WAIT, ProfilingWindow, window_reason


def _window(skip: bool = True) -> ProfilingWindow:
    return ProfilingWindow(warmup_steps=1, steps=1, smoothing=0.5, skip=skip, by_params=False, min_gain=0.05)


def test_a_busiest_one_layer_end_stage_skips_the_window_from_the_first_loads() -> None:
    window = _window()
    window.observe_loads([1.0, 1.0, 5.0], event=False)  # a heavy head on a one-layer last stage
    assert window.nothing_to_gain((2, 3, 1))
    news = window.pinned_news((2, 3, 1))
    assert news is not None and "stage 2 is the busiest and holds one layer beside the head" in news
    assert window.nothing_to_gain((2, 3, 1)) and window.pinned_news((2, 3, 1)) is None  # said once
    # Negative controls: the same loads with two layers on the last stage leave 53% headroom and no kept
    # decision, so the window opens; and without skip_balanced nothing is skipped.
    assert not window.nothing_to_gain((2, 2, 2))
    off = _window(skip=False)
    off.observe_loads([1.0, 1.0, 5.0], event=False)
    assert not off.nothing_to_gain((2, 3, 1))


def test_a_busiest_rank_of_a_v_running_both_one_layer_end_stages_skips_the_window() -> None:
    window = _window()
    workers = [0, 1, 1, 0]  # ZBVZeroBubble on 2 ranks: rank 0 runs the first and the last stage
    window.observe_loads([5.0, 2.0], event=False)  # per rank: the embedding and the head on rank 0
    assert window.nothing_to_gain((1, 3, 3, 1), workers)
    news = window.pinned_news((1, 3, 3, 1), workers)
    assert news is not None
    assert "pipeline rank 0 is the busiest and runs stages 0 and 3 of 4" in news
    assert "one layer each beside the embedding and the head and loss" in news
    assert window.admit("every_step", (1, 3, 3, 1), workers) is None and window.news is None  # said once
    # Negative controls: two layers on its last stage could move off it, so the window opens; the same
    # sizes read stage by stage (no ranks given) map no load to rank 0's two stages.
    assert window.admit("every_step", (1, 3, 2, 2), workers) == "every_step"
    assert not window.nothing_to_gain((1, 3, 3, 1))


def test_a_pinned_rank_within_min_gain_of_the_busiest_skips_the_window() -> None:
    # A V on 3 ranks: rank 0 runs stages 0 and 5, one layer each; rank 1 is the busiest, 2% above it.
    # No placement brings rank 1 below rank 0's load, so none saves min_gain (5%): nothing to gain,
    # although the mean leaves 27% of headroom.
    workers, sizes = [0, 1, 2, 2, 1, 0], (1, 2, 2, 2, 2, 1)
    window = _window()
    window.observe_loads([4.9, 5.0, 1.0], event=False)
    assert window.admit("every_step", sizes, workers) is None
    assert window.news is not None
    assert "pipeline rank 0 runs stages 0 and 5 of 6, one layer each beside the embedding" in window.news
    assert "its load is within 2.0% of the busiest rank's (min_gain 5%)" in window.news
    # Negative controls: 20% below the busiest it leaves room, and the window opens; so it does when the
    # first stage holds two layers (rank 0 could shed one).
    wide = _window()
    wide.observe_loads([4.0, 5.0, 1.0], event=False)
    assert wide.admit("every_step", sizes, workers) == "every_step"
    assert window.admit("every_step", (2, 2, 2, 2, 1, 1), workers) == "every_step"


def test_a_window_waits_for_one_step_of_loads_at_the_start_and_after_an_event() -> None:
    window = _window()
    assert window.nothing_to_gain((2, 2, 2))  # nothing measured yet: wait one step
    window.observe_loads([1.0, 1.0, 5.0], event=False)
    assert not window.nothing_to_gain((2, 2, 2))  # 53% headroom, no kept decision: open
    window.observe_loads([1.0, 1.0, 5.0], event=True)  # the model changed: the loads are stale
    assert window.nothing_to_gain((2, 2, 2))
    window.observe_loads([1.0, 1.0, 5.0], event=False)
    assert not window.nothing_to_gain((2, 2, 2))


def test_after_a_move_windows_are_skipped_while_the_loads_are_shared_as_predicted() -> None:
    window = _window()
    window.observe_loads([1.0, 1.0, 5.0], event=False)
    window.decided(True, expected=[2.0, 2.0, 3.0])  # the move and its prediction
    assert window.nothing_to_gain((2, 2, 2))  # nothing measured on the new placement: wait one step
    window.observe_loads([2.1, 2.0, 3.1], event=False)  # shares within SKIP_DRIFT of the prediction
    assert window.nothing_to_gain((2, 2, 2))
    window.observe_loads([1.0, 1.0, 9.0], event=False)  # they moved away: a decision could find more
    assert not window.nothing_to_gain((2, 2, 2))
    # Negative control: the same move and loads without a prediction open the window, as before.
    plain = _window()
    plain.observe_loads([1.0, 1.0, 5.0], event=False)
    plain.decided(True)
    plain.observe_loads([2.1, 2.0, 3.1], event=False)
    assert not plain.nothing_to_gain((2, 2, 2))
    # By parameter counts the prediction is not read (the counts settle only on a kept decision).
    params = ProfilingWindow(warmup_steps=1, steps=1, smoothing=0.5, skip=True, by_params=True, min_gain=0.05)
    params.decided(True, expected=[2.0, 2.0, 3.0])
    assert not params.nothing_to_gain((2, 2, 2))


def test_a_confirmed_move_marks_the_shares_it_achieved_in_place_of_its_prediction() -> None:
    # The move predicted 2:2:3; the pipeline shares 2.4:2:3 (the step model's error, 8% of the busiest
    # share). Confirmed by its measured gain, those loads are the mark: the window stays closed while they
    # hold, and opens when they move.
    window = _window()
    window.observe_loads([1.0, 1.0, 5.0], event=False)
    window.decided(True, expected=[2.0, 2.0, 3.0])
    window.move_confirmed()
    window.observe_loads([2.4, 2.0, 3.0], event=False)
    assert window.stage_loads.drift == 0.0 and window.nothing_to_gain((2, 2, 2))
    window.observe_loads([2.4, 2.0, 3.0], event=False)
    assert window.nothing_to_gain((2, 2, 2))
    window.observe_loads([1.0, 1.0, 9.0], event=False)  # the costs moved: a decision could find more
    assert not window.nothing_to_gain((2, 2, 2))
    # Negative controls: unconfirmed, the same loads leave the prediction by more than SKIP_DRIFT and the
    # window opens; an event in the step that brings the loads cancels the confirmation (it is judged
    # against the prediction); a new decision drops a confirmation not yet used.
    for confirm, event in ((False, False), (True, True)):
        other = _window()
        other.observe_loads([1.0, 1.0, 5.0], event=False)
        other.decided(True, expected=[2.0, 2.0, 3.0])
        if confirm:
            other.move_confirmed()
        other.observe_loads([2.4, 2.0, 3.0], event=event, shown=True)
        drift = other.stage_loads.drift
        assert drift is not None and drift > SKIP_DRIFT and not other.nothing_to_gain((2, 2, 2))
    dropped = _window()
    dropped.observe_loads([1.0, 1.0, 5.0], event=False)
    dropped.move_confirmed()
    dropped.decided(True, expected=[2.0, 2.0, 3.0])
    dropped.observe_loads([2.4, 2.0, 3.0], event=False)
    assert not dropped.nothing_to_gain((2, 2, 2))


def test_an_event_opens_its_window_at_once_before_any_decision() -> None:
    window = _window()
    window.observe_loads([3.0, 3.0, 3.0], event=False)
    window.observe_loads([3.0, 3.0, 3.0], event=True)
    assert window.admit("event", (2, 2, 2)) == "event"  # nothing marked: nothing to compare with
    assert window.skipped == 0 and window.news is None


def test_after_a_decision_an_event_that_leaves_the_shares_is_skipped_after_one_measured_step() -> None:
    window = _window()
    window.observe_loads([2.0, 2.0, 2.2], event=False)
    window.decided(False)  # kept: the loads are marked
    window.observe_loads([2.0, 2.0, 2.2], event=True)  # the event's step: its loads may be the old model's
    assert window.admit("event", (2, 2, 2)) == WAIT
    window.observe_loads([1.8, 1.8, 2.0], event=False)  # faster, the shares as marked
    assert window.admit("event", (2, 2, 2)) is None
    assert window.skipped == 1
    news = window.news or ""
    assert "after the dynamism event" in news and "window is skipped" in news
    # The next event moves the shares: its window opens.
    window.observe_loads([1.8, 1.8, 2.0], event=True)
    assert window.admit("event", (2, 2, 2)) == WAIT
    window.observe_loads([1.0, 2.0, 4.0], event=False)
    assert window.stage_loads.drift is not None and window.stage_loads.drift > SKIP_DRIFT
    assert window.admit("event", (2, 2, 2)) == "event" and window.skipped == 1 and window.news is None


def test_an_event_its_own_step_ran_is_judged_on_that_steps_loads() -> None:
    window = _window()
    window.observe_loads([2.0, 2.0, 2.2], event=False)
    window.decided(False)
    window.observe_loads([1.8, 1.8, 2.0], event=True, shown=True)  # the step ran the changed model
    assert window.admit("event", (2, 2, 2)) is None and window.skipped == 1  # the shares stayed: no wait
    window.observe_loads([1.0, 2.0, 4.0], event=True, shown=True)  # this one moved them: opens at once
    assert window.admit("event", (2, 2, 2)) == "event" and window.skipped == 1
    # Negative control: the same loads from a step the event came in the middle of are not judged.
    late = _window()
    late.observe_loads([2.0, 2.0, 2.2], event=False)
    late.decided(False)
    late.observe_loads([1.0, 2.0, 4.0], event=True, shown=False)
    assert late.admit("event", (2, 2, 2)) == WAIT


def test_event_windows_are_never_skipped_by_params_or_without_skip_balanced() -> None:
    for window in (
        _window(skip=False),
        ProfilingWindow(warmup_steps=1, steps=1, smoothing=0.5, skip=True, by_params=True, min_gain=0.05),
    ):
        window.observe_loads([2.0, 2.0, 2.2], event=False)
        window.decided(False)
        window.observe_loads([2.0, 2.0, 2.2], event=True)
        assert window.admit("event", (2, 2, 2)) == "event"
        assert window.skipped == 0


def test_admit_keeps_the_every_step_rule() -> None:
    window = _window()
    assert window.admit("every_step", (2, 2, 2)) is None  # nothing measured yet: wait one step
    window.observe_loads([1.0, 1.0, 5.0], event=False)
    assert window.admit("every_step", (2, 3, 1)) is None and window.news is not None  # pinned head
    assert window.admit("every_step", (2, 2, 2)) == "every_step"  # 53% headroom, no decision yet
    assert window.admit("period", (2, 3, 1)) == "period" and window.admit(None, (2, 2, 2)) is None
    assert window.skipped == 2


def test_an_event_skipped_or_deferred_leaves_a_due_period_its_window() -> None:
    def judged(shown: bool) -> tuple[ProfilingWindow, RebalanceTrigger]:
        window, trigger = _window(), RebalanceTrigger(TriggerConfig(every_n_steps=3, on_events=True))
        window.observe_loads([2.0, 2.0, 2.2], event=False)
        window.decided(False)
        window.observe_loads([1.8, 1.8, 2.0], event=True, shown=shown)  # the shares stay where marked
        trigger.notify_event()
        return window, trigger

    window, trigger = judged(shown=True)  # skipped at once
    assert window_reason(window, trigger, 3, (2, 2, 2), resume=False) == "period"
    assert window.skipped == 1 and "window is skipped" in (window.news or "")
    window, trigger = judged(shown=False)  # deferred a step, and still pending
    assert window_reason(window, trigger, 3, (2, 2, 2), resume=False) == "period"
    assert trigger.check(4) == "event"
    # Off a period step the skipped event opens nothing; a resume opens at once.
    window, trigger = judged(shown=True)
    assert window_reason(window, trigger, 4, (2, 2, 2), resume=False) is None and window.skipped == 1
    assert window_reason(window, trigger, 4, (2, 2, 2), resume=True) == "resume"
