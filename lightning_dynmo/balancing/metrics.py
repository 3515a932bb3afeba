"""Balance metrics and an event-driven pipeline simulator.

Read in this order: :func:`imbalance` (paper section 2.2), then :func:`simulate_pipeline` and its result
:class:`PipelineSimulation` (:func:`pipeline_timeline`: the same step op by op), then the per-schedule
op orders (``_order_*``) and the event loop ``_run``.

The simulator does not use closed formulas: every stage executes its ops in the schedule's order, and an
op starts when the stage is free and the op it depends on (same micro-batch, neighbouring stage) has
finished and its activation or gradient has arrived. Unequal stages are therefore modelled correctly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dynmo.balancing._checks import check_positive_int

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "zero_bubble")

Op = tuple[str, int]  # ("F" | "B" | "W", micro-batch index)

# torch.distributed.pipelining schedule names (lower-cased) -> the simulator's schedule model.
_SIMULATED_SCHEDULE = {
    "gpipe": "gpipe",
    "loopedbfs": "gpipe",
    "1f1b": "1f1b",
    "interleaved1f1b": "1f1b",
    "interleavedzerobubble": "zero_bubble",
    "zbvzerobubble": "zero_bubble",
    "dualpipev": "zero_bubble",
    "zero_bubble": "zero_bubble",
}


def imbalance(loads: Sequence[float]) -> float:
    """Load imbalance ``(max - min) / mean`` of the stage loads (paper section 2.2).

    All-zero loads are perfectly balanced and give 0.

    Raises:
        ValueError: if ``loads`` is empty or holds a negative or non-finite value.
    """
    values = _check_loads(loads, "loads")
    mean = sum(values) / len(values)
    if mean == 0:
        return 0.0
    return (max(values) - min(values)) / mean


@dataclass(frozen=True)
class PipelineSimulation:
    """The outcome of one simulated training step.

    Attributes:
        step_time_s: Time from the first op's start to the last op's end.
        stage_idle_s: Per stage, ``step_time_s`` minus the time the stage computed.
        bubble_ratio: Summed idle time over ``num_stages * step_time_s`` (0 when the step takes no time).
    """

    step_time_s: float
    stage_idle_s: tuple[float, ...]
    bubble_ratio: float


def simulate_pipeline(
    stage_fwd_s: Sequence[float],
    stage_bwd_s: Sequence[float],
    num_microbatches: int,
    schedule: str = "1f1b",
    comm_s: float | Sequence[float] = 0.0,
) -> PipelineSimulation:
    """Simulate one step of a pipeline schedule with per-stage op times.

    Args:
        stage_fwd_s: Forward time of one micro-batch on each stage, seconds.
        stage_bwd_s: Backward time of one micro-batch on each stage, seconds.
        num_microbatches: Micro-batches per step, >= 1.
        schedule: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (warm-up of
            ``num_stages - stage - 1`` forwards, then one forward / one backward), or ``"zero_bubble"``
            (ZB-H1: 1F1B whose backward is split into B, the input gradient, and W, the weight gradient;
            we assume each is half of the backward time; a stage defers its first W passes to fill the
            idle slots of its cool-down).
        comm_s: Time for an activation or gradient to cross a stage boundary: one number, or one per
            boundary (``num_stages - 1`` entries).

    Returns:
        The step time, per-stage idle time and bubble ratio.

    Raises:
        ValueError: on mismatched lengths, negative/NaN times, a bad schedule name or micro-batch count.
    """
    finish, durations = _simulate(stage_fwd_s, stage_bwd_s, num_microbatches, schedule, comm_s)
    stages = len(durations)
    step = max(finish.values(), default=0.0)
    busy = [0.0] * stages
    for s, (kind, _) in finish:
        busy[s] += durations[s][kind]
    idle = tuple(step - b for b in busy)
    ratio = sum(idle) / (stages * step) if step > 0 else 0.0
    return PipelineSimulation(step, idle, ratio)


def pipeline_timeline(
    stage_fwd_s: Sequence[float],
    stage_bwd_s: Sequence[float],
    num_microbatches: int,
    schedule: str = "1f1b",
    comm_s: float | Sequence[float] = 0.0,
) -> list[tuple[int, str, int, float, float]]:
    """Every op of the step :func:`simulate_pipeline` simulates, for a Gantt chart.

    Takes the same arguments (and raises the same errors) as :func:`simulate_pipeline`.

    Returns:
        ``(stage, kind, micro_batch, start_s, end_s)`` per op (``kind``: ``"F"``, ``"B"`` or ``"W"``),
        sorted by start time; the last ``end_s`` is the simulated step time.
    """
    finish, durations = _simulate(stage_fwd_s, stage_bwd_s, num_microbatches, schedule, comm_s)
    ops = [(s, kind, i, end - durations[s][kind], end) for (s, (kind, i)), end in finish.items()]
    return sorted(ops, key=lambda op: (op[3], op[0]))


def _simulate(
    stage_fwd_s: Sequence[float],
    stage_bwd_s: Sequence[float],
    num_microbatches: int,
    schedule: str,
    comm_s: float | Sequence[float],
) -> tuple[dict[tuple[int, Op], float], list[dict[str, float]]]:
    """Validate the arguments and run the schedule: each op's finish time, and the op durations."""
    fwd = _check_loads(stage_fwd_s, "stage_fwd_s")
    bwd = _check_loads(stage_bwd_s, "stage_bwd_s")
    if len(fwd) != len(bwd):
        raise ValueError(
            f"stage_fwd_s has {len(fwd)} stages but stage_bwd_s has {len(bwd)}; give one time per stage "
            "in both."
        )
    check_positive_int(num_microbatches, "num_microbatches")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not supported; use one of {SCHEDULES}.")
    comm = _comm_per_boundary(comm_s, len(fwd))
    durations = _durations(fwd, bwd, schedule)
    orders = [_ORDERS[schedule](s, len(fwd), num_microbatches) for s in range(len(fwd))]
    return _run(orders, durations, comm), durations


def _check_loads(values: Sequence[float], name: str) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{name}={values!r} must be a non-empty sequence of numbers, one per stage.")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v < 0:
            raise ValueError(f"{name}[{i}]={v!r} must be a finite number >= 0; fix or drop the measurement.")
        out.append(float(v))
    return out


def _comm_per_boundary(comm_s: float | Sequence[float], stages: int) -> list[float]:
    if isinstance(comm_s, bool):
        raise ValueError(f"comm_s={comm_s!r} must be a number of seconds or one per boundary.")
    if isinstance(comm_s, (int, float)):
        values = [float(comm_s)] * max(stages - 1, 0)
    else:
        values = _check_loads(comm_s, "comm_s") if stages > 1 else []
        if len(values) != stages - 1:
            raise ValueError(
                f"comm_s has {len(values)} entries but {stages} stages have {stages - 1} boundaries; give "
                "one time per boundary or a single number."
            )
    if any(math.isnan(v) or math.isinf(v) or v < 0 for v in values):
        raise ValueError(f"comm_s={comm_s!r} must be finite and >= 0 (seconds).")
    return values


def _durations(fwd: list[float], bwd: list[float], schedule: str) -> list[dict[str, float]]:
    if schedule == "zero_bubble":
        return [{"F": f, "B": b / 2, "W": b / 2} for f, b in zip(fwd, bwd, strict=True)]
    return [{"F": f, "B": b, "W": 0.0} for f, b in zip(fwd, bwd, strict=True)]


def _order_gpipe(stage: int, stages: int, m: int) -> list[Op]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _order_1f1b(stage: int, stages: int, m: int) -> list[Op]:
    warmup = min(stages - stage - 1, m)
    order: list[Op] = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


_ORDERS = {"gpipe": _order_gpipe, "1f1b": _order_1f1b, "zero_bubble": _order_1f1b}


def _dependency(op: Op, stage: int, stages: int) -> tuple[Op, int] | None:
    """The op (and its stage) whose result ``op`` needs from a neighbouring stage, if any."""
    kind, i = op
    if kind == "F" and stage > 0:
        return ("F", i), stage - 1
    if kind == "B" and stage < stages - 1:
        return ("B", i), stage + 1
    return None


def _run(
    orders: list[list[Op]], durations: list[dict[str, float]], comm: list[float]
) -> dict[tuple[int, Op], float]:
    """Discrete-event run; return each op's finish time keyed by (stage, op).

    Each stage executes its F/B ops in ``orders``. W ops (zero-bubble only, ``durations[s]["W"] > 0``)
    are not in the order: after each B its W becomes pending, and a stage runs its oldest pending W
    whenever its next F/B op is not ready yet, and at the end. This is how ZB-H1 fills the 1F1B
    bubbles with weight-gradient work without changing the F/B order (hence the activation memory).
    The globally earliest possible action is always executed next, so a stage that runs a W because
    its input "is not ready" can be sure no earlier event would have made it ready.
    """
    stages = len(orders)
    finish: dict[tuple[int, Op], float] = {}
    cursor = [0] * stages
    free_at = [0.0] * stages
    pending_w: list[list[int]] = [[] for _ in range(stages)]
    split_w = [d["W"] > 0 for d in durations]
    while True:
        best: tuple[float, int, Op] | None = None
        for s in range(stages):
            action = _next_action(s, orders[s], cursor[s], pending_w[s], free_at[s], finish, comm, stages)
            if action is not None and (best is None or action[0] < best[0]):
                best = (action[0], s, action[1])
        if best is None:
            break
        start, s, op = best
        free_at[s] = start + durations[s][op[0]]
        finish[(s, op)] = free_at[s]
        if op[0] == "W":
            pending_w[s].pop(0)
        else:
            cursor[s] += 1
            if op[0] == "B" and split_w[s]:
                pending_w[s].append(op[1])
    assert all(c == len(o) for c, o in zip(cursor, orders, strict=True)), "pipeline schedule deadlocked"
    return finish


def _next_action(
    s: int,
    order: list[Op],
    cursor: int,
    pending_w: list[int],
    free_at: float,
    finish: dict[tuple[int, Op], float],
    comm: list[float],
    stages: int,
) -> tuple[float, Op] | None:
    """The op stage ``s`` would run next and when, or ``None`` if it must wait for an unknown event."""
    if cursor < len(order):
        op = order[cursor]
        dep = _dependency(op, s, stages)
        ready: float | None = free_at
        if dep is not None:
            dep_op, dep_stage = dep
            done = finish.get((dep_stage, dep_op))
            ready = None if done is None else max(free_at, done + comm[min(s, dep_stage)])
        if ready is not None and ready <= free_at:
            return ready, op
        if pending_w:
            return free_at, ("W", pending_w[0])
        return None if ready is None else (ready, op)
    if pending_w:
        return free_at, ("W", pending_w[0])
    return None


def simulated_schedule(schedule: str) -> str:
    """The simulator's model (``"gpipe"``, ``"1f1b"``, ``"zero_bubble"``) of a pipelining schedule name."""
    key = schedule.lower()
    if key not in _SIMULATED_SCHEDULE:
        raise ValueError(
            f"schedule={schedule!r} has no simulator model; use one of torch's schedule names "
            f"({', '.join(sorted(_SIMULATED_SCHEDULE))})."
        )
    return _SIMULATED_SCHEDULE[key]
