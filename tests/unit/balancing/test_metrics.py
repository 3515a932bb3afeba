import itertools
import math

import pytest

from lightning_dynmo.balancing import imbalance, simulate_pipeline


def test_imbalance_is_max_minus_min_over_mean():
    assert imbalance([1.0, 2.0, 3.0]) == pytest.approx((3 - 1) / 2)
    assert imbalance([4.0, 4.0]) == 0.0
    assert imbalance([0.0, 0.0, 0.0]) == 0.0  # defined as balanced


@pytest.mark.parametrize(
    ("loads", "match"),
    [
        ([], r"loads=\[\] must be a non-empty sequence"),
        ([1.0, -1.0], r"loads\[1\]=-1.0 must be a finite"),
        ([math.nan], r"loads\[0\]=nan must be a finite"),
    ],
)
def test_imbalance_rejects_bad_loads(loads, match):
    with pytest.raises(ValueError, match=match):
        imbalance(loads)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 2), (4, 8), (8, 16), (4, 3)])
def test_equal_stages_reproduce_the_textbook_step_time(schedule, stages, microbatches):
    tf, tb = 1.0, 2.0
    sim = simulate_pipeline([tf] * stages, [tb] * stages, microbatches, schedule)
    assert sim.step_time_s == pytest.approx((microbatches + stages - 1) * (tf + tb))
    # Textbook bubble: (p - 1) / (m + p - 1) of every stage's time is idle.
    assert sim.bubble_ratio == pytest.approx((stages - 1) / (microbatches + stages - 1))
    assert all(idle == pytest.approx((stages - 1) * (tf + tb)) for idle in sim.stage_idle_s)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hand_worked_unequal_two_stage_case(schedule):
    # Stage 0: F=1, B=2; stage 1: F=2, B=4; two micro-batches, no communication time.
    # GPipe:  s0 F0[0,1] F1[1,2]; s1 F0[1,3] F1[3,5] B0[5,9] B1[9,13]; s0 B0[9,11] B1[13,15].
    # 1F1B:   s0 F0[0,1] F1[1,2]; s1 F0[1,3] B0[3,7] F1[7,9] B1[9,13]; s0 B0[7,9] B1[13,15].
    # Both end at 15; stage 0 computes 6 (idle 9), stage 1 computes 12 (idle 3); bubble 12 / 30.
    sim = simulate_pipeline([1.0, 2.0], [2.0, 4.0], 2, schedule)
    assert sim.step_time_s == 15.0
    assert sim.stage_idle_s == (9.0, 3.0)
    assert sim.bubble_ratio == pytest.approx(0.4)


def test_communication_time_delays_every_crossing():
    # Two stages, one micro-batch, F=B=1, crossing costs 0.5 each way: 1 + .5 + 1 + 1 + .5 + 1 = 5.
    sim = simulate_pipeline([1.0, 1.0], [1.0, 1.0], 1, "1f1b", comm_s=0.5)
    assert sim.step_time_s == 5.0
    assert simulate_pipeline([1.0, 1.0], [1.0, 1.0], 1, "1f1b", comm_s=[0.5]).step_time_s == 5.0


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8), (8, 16)])
def test_zero_bubble_beats_1f1b_on_equal_stages(stages, microbatches):
    one = simulate_pipeline([1.0] * stages, [2.0] * stages, microbatches, "1f1b")
    zb = simulate_pipeline([1.0] * stages, [2.0] * stages, microbatches, "zero_bubble")
    assert zb.bubble_ratio < one.bubble_ratio
    # With F = B = W (backward split in equal halves) ZB-H1's step is m(F+B+W) + (p-1)(F+B-W).
    assert zb.step_time_s == pytest.approx(3 * microbatches + (stages - 1))


def test_slow_stage_sets_the_steady_state_pace():
    # A 4-stage 1F1B pipeline with one stage twice as slow: steady state runs at the slow stage's pace.
    m = 32
    sim = simulate_pipeline([1, 2, 1, 1], [2, 4, 2, 2], m, "1f1b")
    assert sim.step_time_s >= m * 6
    assert sim.stage_idle_s[1] < min(sim.stage_idle_s[0], sim.stage_idle_s[2], sim.stage_idle_s[3])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage_bwd_s": [1.0]}, r"stage_fwd_s has 2 stages but stage_bwd_s has 1"),
        ({"num_microbatches": 0}, r"num_microbatches=0 must be an integer >= 1"),
        ({"schedule": "interleaved"}, r"schedule='interleaved' is not supported"),
        ({"comm_s": [0.1, 0.2]}, r"comm_s has 2 entries but 2 stages have 1 boundaries"),
        ({"comm_s": -1.0}, r"comm_s=-1.0 must be finite and >= 0"),
        ({"stage_fwd_s": [1.0, math.nan]}, r"stage_fwd_s\[1\]=nan must be a finite number"),
    ],
)
def test_simulator_rejects_bad_input(kwargs, match):
    args = {"stage_fwd_s": [1.0, 1.0], "stage_bwd_s": [1.0, 1.0], "num_microbatches": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        simulate_pipeline(**args)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_the_timeline_is_the_simulated_step_op_by_op(schedule: str) -> None:
    from lightning_dynmo.balancing.metrics import pipeline_timeline

    fwd, bwd = [1.0, 3.0, 2.0], [2.0, 5.0, 4.0]
    ops = pipeline_timeline(fwd, bwd, 4, schedule, comm_s=0.5)
    assert max(op[4] for op in ops) == simulate_pipeline(fwd, bwd, 4, schedule, comm_s=0.5).step_time_s
    for stage in range(3):
        mine = sorted((start, end) for s, _, _, start, end in ops if s == stage)
        assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(mine)), "a stage runs one op at once"
        assert len([op for op in ops if op[0] == stage and op[1] == "F"]) == 4
    # F of micro-batch 0 on stage 1 starts after stage 0's forward plus the link.
    f01 = next(op for op in ops if op[:3] == (1, "F", 0))
    assert f01[3] == pytest.approx(1.0 + 0.5)


def test_the_timeline_rejects_what_the_simulator_rejects() -> None:
    from lightning_dynmo.balancing.metrics import pipeline_timeline

    with pytest.raises(ValueError, match=r"stage_fwd_s has 2 stages but stage_bwd_s has 1"):
        pipeline_timeline([1.0, 1.0], [1.0], 2)
