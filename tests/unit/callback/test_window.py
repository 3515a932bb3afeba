"""The profiling window's skipping rule (``skip_balanced``) on agreed per-stage loads."""

from __future__ import annotations

from lightning_dynmo.callback.window import ProfilingWindow


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
