"""Zhu & Gupta's schedule: the documented sparsity at each documented step, exactly the target at the end."""

from __future__ import annotations

import pytest

from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule


def zhu_gupta(t: int, s_i: float, s_f: float, t0: int, dt: int, n: int) -> float:
    """The paper's formula (appendix C.2), written out independently."""
    return s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt)) ** 3


def test_the_paper_defaults_prune_at_30_40_50_60_70_up_to_0_9() -> None:
    schedule = PruningSchedule()
    assert schedule.steps == (30, 40, 50, 60, 70)
    assert schedule.end_step == 70
    for t in schedule.steps:
        assert schedule.target_at(t) == pytest.approx(zhu_gupta(t, 0.0, 0.9, 30, 10, 4), abs=1e-15)
    assert schedule.target_at(30) == 0.0
    assert schedule.target_at(70) == 0.9  # exactly, not approximately


@pytest.mark.parametrize(
    ("s_i", "s_f", "t0", "dt", "n"), [(0.0, 0.9, 2, 2, 4), (0.2, 0.5, 0, 3, 5), (0.0, 0.0, 5, 1, 1)]
)
def test_every_documented_step_gets_its_level_and_the_last_one_the_target(
    s_i: float, s_f: float, t0: int, dt: int, n: int
) -> None:
    schedule = PruningSchedule(
        initial_sparsity=s_i, final_sparsity=s_f, start_step=t0, frequency=dt, num_steps=n
    )
    assert schedule.steps == tuple(t0 + j * dt for j in range(n + 1))
    levels = [schedule.target_at(t) for t in schedule.steps]
    assert levels[0] == s_i and levels[-1] == s_f
    for t, level in zip(schedule.steps, levels, strict=True):
        assert level == pytest.approx(zhu_gupta(t, s_i, s_f, t0, dt, n), abs=1e-15)
    assert levels == sorted(levels)  # never decreasing
    # Every other step prunes nothing; the sparsity in effect follows the last pruning step.
    for t in range(t0 + n * dt + 3):
        if t not in schedule.steps:
            assert schedule.target_at(t) is None
        expected = 0.0 if t < t0 else levels[min((t - t0) // dt, n)]
        assert schedule.sparsity_after(t) == expected


def test_the_reference_codes_defaults_end_at_0_9_not_0_7875() -> None:
    # DynMo's code (s_f=0.9, start 2, end 10, every 2) applies the level of t - dt at t and stops early.
    schedule = PruningSchedule.from_range(start_step=2, end_step=10, frequency=2, final_sparsity=0.9)
    assert schedule.num_steps == 4
    assert [schedule.target_at(t) for t in (2, 10)] == [0.0, 0.9]
    assert schedule.target_at(6) == pytest.approx(0.7875)  # what the reference code ends at, half way here


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"final_sparsity": 1.0}, r"final_sparsity=1.0 must be a fraction in \[0, 1\)"),
        ({"final_sparsity": -0.1}, r"final_sparsity=-0.1 must be a fraction in \[0, 1\)"),
        ({"initial_sparsity": 1.5}, r"initial_sparsity=1.5 must be a fraction in \[0, 1\)"),
        ({"final_sparsity": True}, r"final_sparsity=True must be a fraction"),
        (
            {"initial_sparsity": 0.6, "final_sparsity": 0.5},
            r"initial_sparsity=0.6 is above final_sparsity=0.5",
        ),
        ({"frequency": 0}, r"frequency=0 must be an integer >= 1"),
        ({"start_step": -1}, r"start_step=-1 must be an integer >= 0"),
        ({"num_steps": 0}, r"num_steps=0 makes the schedule end at step 30 .* end before it starts"),
        ({"num_steps": -2, "start_step": 5}, r"num_steps=-2 makes the schedule end at step -15"),
        ({"num_steps": 2.5}, r"num_steps=2.5 must be an integer >= 1"),
    ],
)
def test_bad_schedules_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PruningSchedule(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"start_step": 10, "end_step": 10, "frequency": 2},
            r"end_step=10\): the schedule ends before it starts",
        ),
        ({"start_step": 10, "end_step": 4, "frequency": 2}, r"the schedule ends before it starts"),
        ({"start_step": 0, "end_step": 10, "frequency": 3}, r"10 is not a multiple of the frequency"),
        ({"start_step": 0, "end_step": 10, "frequency": 0}, r"frequency=0 must be an integer >= 1"),
        ({"start_step": 0, "end_step": 10, "frequency": 2, "final_sparsity": 1.2}, r"final_sparsity=1.2"),
    ],
)
def test_bad_ranges_are_refused(kwargs: dict[str, object], match: str) -> None:
    kwargs = {"final_sparsity": 0.9, **kwargs}
    with pytest.raises(ValueError, match=match):
        PruningSchedule.from_range(**kwargs)  # type: ignore[arg-type]


def test_level_refuses_an_index_outside_the_schedule() -> None:
    with pytest.raises(ValueError, match=r"level\(j=5\): j must be in \[0, num_steps=4\]"):
        PruningSchedule().level(5)
