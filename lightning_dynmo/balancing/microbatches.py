"""How many micro-batches a re-packed pipeline should run (pure Python).

Read :func:`choose_microbatches` first, then :class:`MicrobatchChoice` and :class:`RetuneOptions` (how
:func:`~lightning_dynmo.balancing.policy.decide` is asked to re-tune after a re-pack).

A pipeline's inherent bubble is set by its depth and its micro-batch count: with ``p`` stages and ``m``
micro-batches, 1F1B idles about ``(p - 1) / (m + p - 1)`` of a step (paper appendix E.4, after GPipe's
"m >= 4p"). A re-pack changes ``p``, so the count chosen for the old pipeline is rarely the one the new
pipeline wants: fewer stages need fewer micro-batches for the same bubble, and every micro-batch costs a
fixed overhead per op (launches, schedule bookkeeping, smaller and less efficient kernels). The count
is chosen by the same simulator as the placements, per candidate:

* a stage's step work (layers, pinned parts, worker slowdown:
  :func:`~lightning_dynmo.balancing.hardware.stage_times`) splits evenly over the ``m`` equal
  micro-batches, each forward and backward op adds ``per_op_s``, and a micro-batch ``k`` times larger
  sends ``k`` times the bytes;
* the candidates are the counts the caller allows (divisors of the batch, which keep micro-batches equal
  and training exactly the same, that the schedule accepts on the new pipeline);
* memory: a stage measured at ``m0`` micro-batches holds at most ``m0 / m`` times its measured memory at
  ``m < m0`` (whatever part of it is activations: an in-flight micro-batch grows by ``m0 / m`` and no
  schedule keeps more of them in flight with fewer micro-batches) and no more at ``m >= m0``; candidates
  that may not fit the caps are skipped.

The current count is kept unless another is predicted at least ``min_gain`` faster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.hardware import Hardware, stage_times
from lightning_dynmo.balancing.metrics import simulate_pipeline, simulated_schedule
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem, takes_problem


@dataclass(frozen=True)
class RetuneOptions:
    """What a re-pack may re-tune the micro-batch count to (:func:`~lightning_dynmo.balancing.policy.decide`).

    Attributes:
        counts: For each stage count a re-pack may reach, the micro-batch counts the pipeline can run
            (divisors of the batch that the schedule accepts there).
        per_op_s: Fixed seconds of every forward and backward op (measured: a stage's busy time beyond its
            units' work, per op).
    """

    counts: Mapping[int, Sequence[int]]
    per_op_s: float = 0.0


@dataclass(frozen=True)
class MicrobatchChoice:
    """The micro-batch count for a pipeline and what each candidate was predicted to take.

    Attributes:
        num_microbatches: The chosen count.
        predicted_step_s: Predicted step seconds of each candidate that fits memory.
        skipped: Candidates left out because they may not fit the memory caps.
    """

    num_microbatches: int
    predicted_step_s: Mapping[int, float]
    skipped: tuple[int, ...] = ()


@takes_problem
def choose_microbatches(
    problem: BalanceProblem,
    placement: Placement,
    *,
    current: int,
    candidates: Sequence[int],
    schedule: str,
    stage_workers: Sequence[int] | None = None,
    per_op_s: float = 0.0,
    min_gain: float = 0.0,
) -> MicrobatchChoice:
    """The micro-batch count that minimises the predicted step time of ``placement``.

    How a count is predicted and when it may not fit memory is described once, in this module's
    docstring.

    Args:
        problem: One record per layer, per training step, measured with ``current`` micro-batches, and
            the hardware (pinned parts, worker slowdowns, links, memory caps per stage of
            ``placement``). Counts are weighed in seconds: the time view, whatever ``problem.by``.
        placement: The pipeline to choose for (e.g. a re-pack's target).
        current: The count the costs were measured with (and kept unless another is better).
        candidates: The counts allowed (e.g. divisors of the batch that the schedule accepts).
        schedule: The pipelining schedule name.
        stage_workers: The worker of each stage when workers run several stages.
        per_op_s: Fixed seconds of every forward and backward op, >= 0.
        min_gain: Another count is chosen only if predicted at least this fraction faster than
            ``current`` (when ``current`` is a candidate that fits).

    Raises:
        ValueError: on a bad count, overhead or gain, or when no candidate is given.
        TypeError: when called in the old shape (loose costs, or a keyword that moved into the problem).
    """
    _check_count(current, "current")
    if not candidates:
        raise ValueError("candidates is empty; give the micro-batch counts the pipeline may run.")
    for m in candidates:
        _check_count(m, "candidates")
    if not (isinstance(per_op_s, (int, float)) and per_op_s >= 0):
        raise ValueError(f"per_op_s={per_op_s!r} must be a number of seconds >= 0.")
    if not (isinstance(min_gain, (int, float)) and 0 <= min_gain < 1):
        raise ValueError(f"min_gain={min_gain!r} must be in [0, 1).")
    timed = problem if problem.by == "time" else dataclasses.replace(problem, by="time")
    times = stage_times(timed, placement, stage_workers)
    memory = _stage_memory(problem.costs, placement, problem.hardware)
    caps = problem.caps(placement.num_stages)
    steps: dict[int, float] = {}
    skipped = []
    for m in sorted(set(candidates)):
        growth = max(1.0, current / m)
        if any(mem * growth > cap for mem, cap in zip(memory, caps, strict=True)):
            skipped.append(m)
            continue
        fwd, bwd = times.per_microbatch(m, measured_with=current, per_op_s=per_op_s)
        steps[m] = simulate_pipeline(fwd, bwd, m, simulated_schedule(schedule)).step_time_s
    if not steps:
        return MicrobatchChoice(current, steps, tuple(skipped))
    best = min(steps, key=lambda m: (steps[m], m))
    if current in steps and not steps[best] < steps[current] * (1.0 - min_gain):
        best = current
    return MicrobatchChoice(best, steps, tuple(skipped))


def _stage_memory(costs: Sequence[LayerCost], placement: Placement, hw: Hardware) -> list[float]:
    memory = [
        float(sum(costs[i].memory_bytes for i in placement.layers_of(s))) for s in range(placement.num_stages)
    ]
    if hw.first_stage_extra is not None:
        memory[0] += hw.first_stage_extra.memory_bytes
    if hw.last_stage_extra is not None:
        memory[-1] += hw.last_stage_extra.memory_bytes
    return memory


def _check_count(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} holds {value!r}; micro-batch counts are integers >= 1.")
