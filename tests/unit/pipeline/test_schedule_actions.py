"""Torch's action lists: what each schedule's ranks really run, and the step model's timeline on them.

Per schedule, a 2-rank case whose timeline is worked out by hand in the comment (``sFm@a-b``: stage ``s``,
kind ``F``, micro-batch ``m``, from ``a`` to ``b``), compared with the step model fed
:func:`schedule_actions`. And :func:`schedule_actions` against a recorded ``_step_microbatches`` of torch's
own schedule classes on stand-in stages that log their compute calls.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.pipelining.schedules import Schedule1F1B

from lightning_dynmo.balancing.schedule_model import LinkTime, StageTimes, simulate_step
from lightning_dynmo.pipeline.placement.layout import stages_of_pipeline_rank
from lightning_dynmo.pipeline.step.actions import Action, schedule_actions
from lightning_dynmo.pipeline.step.schedule import SCHEDULE_NAMES, resolve_schedule
from tests.unit.balancing.timelines import per_rank

FULL = StageTimes(forward_s=1.0, backward_s=2.0)
SPLIT = StageTimes(forward_s=1.0, input_grad_s=1.0, weight_grad_s=1.0)
BOTH = StageTimes(forward_s=1.0, backward_s=2.0, input_grad_s=1.0, weight_grad_s=1.0)


HAND_WORKED = [
    # GPipe, 2 stages, m=2, F=1, B=2, 0.5 s links. r1: F0 waits 1+.5; F1 max(2.5, 2+.5); B0, B1 back to back.
    # r0: B0 waits 5.5+.5 = 6; B1 max(8, 7.5+.5) = 8. Step 10 = textbook 9 + one link each way.
    (
        "GPipe",
        2,
        2,
        FULL,
        0.5,
        10.0,
        ["0F0@0-1 0F1@1-2 0B0@6-8 0B1@8-10", "1F0@1.5-2.5 1F1@2.5-3.5 1B0@3.5-5.5 1B1@5.5-7.5"],
    ),
    # 1F1B, 2 stages, m=3, links 0. r0 warms up with 2 forwards, r1 with 1. r1: F0 1-2, B0 2-4, F1 4-5,
    # B1 5-7, F2 (r0's F2 ends 7) 7-8, B2 8-10. r0: B0 (r1 B0 ends 4) 4-6, F2 6-7, B1 (ends 7) 7-9,
    # B2 (ends 10) 10-12. Step 12 = (m + p - 1)(F + B).
    (
        "1F1B",
        2,
        3,
        FULL,
        0.0,
        12.0,
        [
            "0F0@0-1 0F1@1-2 0B0@4-6 0F2@6-7 0B1@7-9 0B2@10-12",
            "1F0@1-2 1B0@2-4 1F1@4-5 1B1@5-7 1F2@7-8 1B2@8-10",
        ],
    ),
    # Interleaved1F1B, 4 stages on 2 ranks (r0: 0, 2; r1: 1, 3), m=2, links 0. Forwards ripple 0->1->2->3
    # one unit apart; r1 runs 3B0 right after 3F0 (4-6) before 3F1 (6-7), 3B1 7-9. r0's 2B0 waits for 3B0
    # (6-8), 2B1 for 3B1 (9-11); r1's 1B0 waits for its own turn (9-11), 1B1 11-13; r0: 0B0 11-13, 0B1 13-15.
    (
        "Interleaved1F1B",
        4,
        2,
        FULL,
        0.0,
        15.0,
        [
            "0F0@0-1 0F1@1-2 2F0@2-3 2F1@3-4 2B0@6-8 2B1@9-11 0B0@11-13 0B1@13-15",
            "1F0@1-2 1F1@2-3 3F0@3-4 3B0@4-6 3F1@6-7 3B1@7-9 1B0@9-11 1B1@11-13",
        ],
    ),
    # LoopedBFS, same case: all forwards of a stage, then backwards in reverse micro-batch order.
    # r1: 3F0 3-4, 3F1 4-5, 3B1 5-7, 3B0 7-9; r0: 2B1 (3B1 ends 7) 7-9, 2B0 9-11; r1: 1B1 9-11, 1B0 11-13;
    # r0: 0B1 11-13, 0B0 13-15.
    (
        "LoopedBFS",
        4,
        2,
        FULL,
        0.0,
        15.0,
        [
            "0F0@0-1 0F1@1-2 2F0@2-3 2F1@3-4 2B1@7-9 2B0@9-11 0B1@11-13 0B0@13-15",
            "1F0@1-2 1F1@2-3 3F0@3-4 3F1@4-5 3B1@5-7 3B0@7-9 1B1@9-11 1B0@11-13",
        ],
    ),
    # InterleavedZeroBubble, 4 stages on 2 ranks, m=2, F=I=W=1, links 0. r1: 3F0 3-4, 3I0 4-5, 3F1 5-6
    # (2F1 ended 4), 3I1 6-7, 3W0 7-8. r0: 2I0 (3I0 ends 5) 5-6, 2W0 6-7, 2I1 7-8, 2W1 8-9. r1: 1I0 8-9,
    # 3W1 9-10, 1I1 10-11, 1W0 11-12, 1W1 12-13. r0: 0I0 (1I0 ends 9) 9-10, 0W0 10-11, 0I1 11-12, 0W1 12-13.
    (
        "InterleavedZeroBubble",
        4,
        2,
        SPLIT,
        0.0,
        13.0,
        [
            "0F0@0-1 0F1@1-2 2F0@2-3 2F1@3-4 2I0@5-6 2W0@6-7 2I1@7-8 2W1@8-9 "
            "0I0@9-10 0W0@10-11 0I1@11-12 0W1@12-13",
            "1F0@1-2 1F1@2-3 3F0@3-4 3I0@4-5 3F1@5-6 3I1@6-7 3W0@7-8 1I0@8-9 "
            "3W1@9-10 1I1@10-11 1W0@11-12 1W1@12-13",
        ],
    ),
    # ZBVZeroBubble, V layout (r0: 0, 3; r1: 1, 2), m=2, F=I=W=1, 0.5 s links, none between 1 and 2 (same
    # rank). r1: 1F0 1.5-2.5, 2F0 2.5-3.5, 1F1 3.5-4.5, 2F1 4.5-5.5. r0: 3F0 (3.5+.5) 4-5, 3I0 5-6, 3W0 6-7,
    # 3F1 7-8, 3I1 8-9, 3W1 9-10. r1: 2I0 (6+.5) 6.5-7.5, 2W0, 1I0 8.5-9.5 (no link from 2I0), 1W0, 2I1 10.5,
    # 2W1, 1I1 12.5-13.5, 1W1 13.5-14.5. r0: 0I0 (9.5+.5) 10-11, 0W0 11-12, 0I1 (13.5+.5) 14-15, 0W1 15-16.
    (
        "ZBVZeroBubble",
        4,
        2,
        SPLIT,
        0.5,
        16.0,
        [
            "0F0@0-1 0F1@1-2 3F0@4-5 3I0@5-6 3W0@6-7 3F1@7-8 3I1@8-9 3W1@9-10 "
            "0I0@10-11 0W0@11-12 0I1@14-15 0W1@15-16",
            "1F0@1.5-2.5 2F0@2.5-3.5 1F1@3.5-4.5 2F1@4.5-5.5 2I0@6.5-7.5 2W0@7.5-8.5 1I0@8.5-9.5 "
            "1W0@9.5-10.5 2I1@10.5-11.5 2W1@11.5-12.5 1I1@12.5-13.5 1W1@13.5-14.5",
        ],
    ),
    # DualPipeV, V layout, m=4 (at least one per stage), F=1, B=2, I=W=1, links 0; an overlapped F+B pair
    # runs as its F then its B. r0: 0F0-0F2 0-3, 3F0 (2F0 ends 3) 3-4, 3I0 4-5, 3W0 5-6, 3F1 6-7, 0F3 7-8,
    # 3B1 8-10, 3F2 10-11, 0B0 (1B0 ends 11) 11-13, 3B2 13-15, 3F3 15-16, 0B1 (1B1 ends 17) 17-19, 3B3 19-21,
    # 0I2 (1B2 ends 21) 21-22, 0W2, 0I3 (1I3 ends 23) 23-24, 0W3 24-25. r1: 1F0 1-2, 2F0 2-3, 1F1 3-4,
    # 2F1 4-5, 1F2 5-6, 2B0 (3I0 ends 5) 6-8, 2F2 8-9, 1B0 9-11, 1F3 11-12, 2B1 (3B1 ends 10) 12-14,
    # 2F3 14-15, 1B1 15-17, 2B2 (3B2 ends 15) 17-19, 1B2 19-21, 2I3 (3B3 ends 21) 21-22, 1I3, 2W3, 1W3 24-25.
    (
        "DualPipeV",
        4,
        4,
        BOTH,
        0.0,
        25.0,
        [
            "0F0@0-1 0F1@1-2 0F2@2-3 3F0@3-4 3I0@4-5 3W0@5-6 3F1@6-7 0F3@7-8 3B1@8-10 3F2@10-11 0B0@11-13 "
            "3B2@13-15 3F3@15-16 0B1@17-19 3B3@19-21 0I2@21-22 0W2@22-23 0I3@23-24 0W3@24-25",
            "1F0@1-2 2F0@2-3 1F1@3-4 2F1@4-5 1F2@5-6 2B0@6-8 2F2@8-9 1B0@9-11 1F3@11-12 2B1@12-14 2F3@14-15 "
            "1B1@15-17 2B2@17-19 1B2@19-21 2I3@21-22 1I3@22-23 2W3@23-24 1W3@24-25",
        ],
    ),
]


@pytest.mark.parametrize(
    ("name", "num_stages", "m", "times", "link", "step", "timeline"),
    HAND_WORKED,
    ids=[case[0] for case in HAND_WORKED],
)
def test_the_step_model_on_torchs_actions_matches_the_hand_worked_timeline(
    name: str, num_stages: int, m: int, times: StageTimes, link: float, step: float, timeline: list[str]
) -> None:
    sim = simulate_step(schedule_actions(name, num_stages, m), [times] * num_stages, link)
    assert per_rank(sim) == timeline
    assert sim.step_time_s == step


def test_every_schedule_has_a_hand_worked_case() -> None:
    assert sorted(case[0] for case in HAND_WORKED) == sorted(SCHEDULE_NAMES)


def test_swapping_two_actions_changes_the_step() -> None:
    # Negative control: the model follows the order it is given. (Swapping two ranks' whole lists would
    # not do: a rank is only a label for the stages it runs.) Rank 1 of ZBV running 1F1 before 2F0 still
    # runs, and the step time shows it.
    acts = schedule_actions("ZBVZeroBubble", 4, 2)
    sim = simulate_step(acts, [SPLIT] * 4, [LinkTime(0.5), LinkTime(0.0), LinkTime(0.5)])
    swapped = [list(acts[0]), list(acts[1])]
    assert swapped[1][1:3] == [(2, "F", 0), (1, "F", 1)]
    swapped[1][1:3] = swapped[1][2:0:-1]
    other = simulate_step(swapped, [SPLIT] * 4, [LinkTime(0.5), LinkTime(0.0), LinkTime(0.5)])
    assert other.step_time_s != sim.step_time_s


def test_an_order_that_cannot_run_deadlocks() -> None:
    # Negative control: rank 1 of 1F1B running its first backward before its first forward.
    acts = schedule_actions("1F1B", 2, 2)
    acts[1][0], acts[1][1] = acts[1][1], acts[1][0]
    with pytest.raises(ValueError, match=r"deadlock: .*rank 1 waits at B\(stage 1, mb 0\) \(position 0\)"):
        simulate_step(acts, [FULL] * 2)


class _LoggingStage:
    """Stands in for a PipelineStage: records compute calls, sends and receives nothing."""

    def __init__(self, index: int, num_stages: int, pipeline_size: int, rank: int, log: list[Action]) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = pipeline_size, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod, self.has_backward, self._log = None, True, log

    def __getattr__(self, name: str) -> Any:
        # Every other stage method (p2p ops, local hand-overs, state resets) does nothing here.
        return lambda *args, **kwargs: []

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self._log.append((self.stage_index, "F", mb))

    def backward_one_chunk(
        self, mb: int, loss: Any = None, full_backward: bool = True, **kwargs: Any
    ) -> None:
        self._log.append((self.stage_index, "B" if full_backward else "I", mb))

    def backward_weight_one_chunk(self, mb: int, **kwargs: Any) -> None:
        self._log.append((self.stage_index, "W", mb))


def _recorded(name: str, num_stages: int, m: int) -> list[list[Action]]:
    """Each rank's compute calls in a run of torch's own schedule class on logging stages."""
    spec = resolve_schedule(name)
    size = num_stages // spec.stages_per_rank
    out = []
    for rank in range(size):
        log: list[Action] = []
        stages = [
            _LoggingStage(s, num_stages, size, rank, log)
            for s in stages_of_pipeline_rank(rank, num_stages, size, spec.style)
        ]
        schedule: Any = spec.cls(stages[0] if spec.stages_per_rank == 1 else stages, m)  # type: ignore[arg-type]
        schedule._initialize_stage = schedule._initialize_stages = lambda *args, **kwargs: (
            None
        )  # shape inference
        schedule._step_microbatches()
        out.append(log)
    return out


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize(("num_stages", "m"), [(2, 2), (4, 4), (4, 8), (8, 8), (6, 6)])
def test_the_actions_are_what_torchs_schedule_runs(name: str, num_stages: int, m: int) -> None:
    assert schedule_actions(name, num_stages, m) == _recorded(name, num_stages, m)


def test_the_recording_tells_schedules_apart() -> None:
    # Negative control for the comparison above: a recording is not the same whatever the schedule.
    assert _recorded("GPipe", 4, 4) != _recorded("1F1B", 4, 4)
    assert _recorded("ZBVZeroBubble", 4, 4) != _recorded("DualPipeV", 4, 4)


def test_torchs_own_1f1b_order_data_is_not_what_it_runs() -> None:
    # Why 1F1B's order is written from _step_microbatches: torch 2.13's pipeline_order starts the last rank
    # at micro-batch 1. If this fails, torch fixed it and actions.py could read the data instead.
    schedule = Schedule1F1B(_LoggingStage(0, 2, 2, 0, []), 2)  # type: ignore[arg-type]
    last = [a for a in schedule.pipeline_order[1] if a is not None and a.is_compute_op]  # type: ignore[index]
    assert str(last[0]) == "1F1"
    assert schedule_actions("1F1B", 2, 2)[1][0] == (1, "F", 0)


@pytest.mark.parametrize(
    ("name", "num_stages", "m", "match"),
    [
        ("PipeDream", 2, 2, r"schedule='PipeDream' is not a pipeline schedule"),
        (
            "ZBVZeroBubble",
            3,
            4,
            r"num_stages=3 cannot run under ZBVZeroBubble, which puts 2 stages on each rank",
        ),
        ("1F1B", 4, 2, r"num_microbatches=2 is rejected by schedule '1F1B' with 4 stages"),
        ("DualPipeV", 4, 2, r"num_microbatches=2 is rejected by schedule 'DualPipeV'"),
        ("GPipe", 0, 2, r"num_stages=0 must be an integer >= 1"),
        ("GPipe", 2, 0, r"num_microbatches=0 must be an integer >= 1"),
    ],
)
def test_bad_arguments_are_rejected(name: str, num_stages: int, m: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        schedule_actions(name, num_stages, m)
