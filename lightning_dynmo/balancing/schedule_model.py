"""A step model that follows a schedule's real action list: each rank runs its actions in order.

Read in this order: the inputs (:data:`Action`, :class:`StageTimes`, :class:`LinkTime`), then
:func:`simulate_step` and its result :class:`StepSimulation` (:class:`TimedAction` per action), then the
evaluation loop ``_run`` and the deadlock report.

Unlike :func:`~lightning_dynmo.balancing.metrics.simulate_pipeline`, which builds its own GPipe / 1F1B /
ZB-H1 op orders with one stage per rank, this model takes the per-rank action lists torch's schedules
execute (:func:`lightning_dynmo.pipeline.step.actions.schedule_actions` extracts them), any number of
stages per rank, and backward split into input (``I``) and weight (``W``) gradients. Dependencies:

- ``F(s, m)`` needs ``F(s-1, m)``, plus the boundary's activation time when ``s-1`` runs on another rank;
- ``B(s, m)`` or ``I(s, m)`` needs ``F(s, m)`` and ``B/I(s+1, m)``, plus the boundary's gradient time
  when ``s+1`` runs on another rank;
- ``W(s, m)`` needs ``I(s, m)``.

A rank runs its list strictly in order, as torch's runtime does (it blocks on a receive before the action
that needs it; sends are asynchronous). Neighbouring stages on the same rank exchange tensors in memory,
so no link time applies between them. With every start time fixed by its rank's previous action and its
dependencies, the step is a longest path; the loop evaluates it in dependency order and, where no rank can
go on, names the actions that wait and what they wait for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

#: One action of a rank: ``(stage, kind, micro_batch)``, kind ``"F"``, ``"B"`` (full backward),
#: ``"I"`` (input gradient) or ``"W"`` (weight gradient).
Action = tuple[int, str, int]

KINDS: tuple[str, ...] = ("F", "B", "I", "W")


@dataclass(frozen=True)
class StageTimes:
    """One micro-batch's compute times on one stage, seconds.

    Give ``backward_s`` (schedules that run full backwards), or ``input_grad_s`` and ``weight_grad_s``
    (split-backward schedules), or all three; a missing ``backward_s`` is their sum.

    Attributes:
        forward_s: Forward time (``F``).
        backward_s: Full backward time (``B``).
        input_grad_s: Input-gradient time (``I``).
        weight_grad_s: Weight-gradient time (``W``).
    """

    forward_s: float
    backward_s: float | None = None
    input_grad_s: float | None = None
    weight_grad_s: float | None = None

    def duration(self, kind: str, stage: int) -> float:
        """The time of one ``kind`` action on this stage (``stage``: for the error message).

        Raises:
            ValueError: if the time of ``kind`` was not given.
        """
        value = {
            "F": self.forward_s,
            "B": self._full_backward(),
            "I": self.input_grad_s,
            "W": self.weight_grad_s,
        }[kind]
        if value is None:
            raise ValueError(
                f"stage {stage} runs {kind} actions but its StageTimes has no time for them; give "
                "input_grad_s and weight_grad_s for a split-backward schedule, or backward_s for a full one."
            )
        return value

    def _full_backward(self) -> float | None:
        if self.backward_s is not None:
            return self.backward_s
        if self.input_grad_s is None or self.weight_grad_s is None:
            return None
        return self.input_grad_s + self.weight_grad_s


@dataclass(frozen=True)
class LinkTime:
    """The time to cross one stage boundary (stage ``s`` to ``s+1``), seconds.

    Attributes:
        activation_s: An activation going forward.
        gradient_s: A gradient coming back; ``None``: the same as ``activation_s``.
    """

    activation_s: float = 0.0
    gradient_s: float | None = None

    @property
    def backward_s(self) -> float:
        """The gradient's time (``activation_s`` unless given)."""
        return self.activation_s if self.gradient_s is None else self.gradient_s


@dataclass(frozen=True)
class TimedAction:
    """One action of the simulated step.

    Attributes:
        rank: The pipeline rank that runs it.
        stage: Its stage.
        kind: ``"F"``, ``"B"``, ``"I"`` or ``"W"``.
        micro_batch: Its micro-batch.
        start_s: When it starts (the step starts at 0).
        end_s: When it ends.
    """

    rank: int
    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class StepSimulation:
    """The outcome of one simulated step.

    Attributes:
        step_time_s: The last action's end (the step starts at 0).
        rank_busy_s: Per rank, the time it computed.
        rank_idle_s: Per rank, ``step_time_s`` minus its busy time.
        timeline: Every action, sorted by start time, then rank.
        critical_path: The chain of actions that sets the step time, first to last: each one's start is
            its predecessor's end (plus a link time where the predecessor is a dependency on another rank);
            on a tie, the predecessor is the rank's previous action.
    """

    step_time_s: float
    rank_busy_s: tuple[float, ...]
    rank_idle_s: tuple[float, ...]
    timeline: tuple[TimedAction, ...]
    critical_path: tuple[TimedAction, ...]


def simulate_step(
    actions: Sequence[Sequence[Action]],
    stage_times: Sequence[StageTimes],
    links: float | Sequence[LinkTime] = 0.0,
) -> StepSimulation:
    """Simulate one pipeline step from each rank's ordered action list.

    Args:
        actions: Per pipeline rank, its actions ``(stage, kind, micro_batch)`` in the order it runs them.
        stage_times: Per stage (index = stage), one micro-batch's compute times.
        links: Per stage boundary (``len(stage_times) - 1`` entries), its link times; or one number of
            seconds for every boundary, both directions.

    Returns:
        The step time, per-rank busy and idle time, the timeline and its critical path.

    Raises:
        ValueError: on an unknown kind, a stage out of range or on two ranks, an action listed twice,
            a negative or non-finite time, a mismatched number of links, or action lists that deadlock
            (the message names each waiting rank, its action and what it waits for).
    """
    lists = check_action_lists(actions, len(stage_times))
    durations = _check_stage_times(stage_times, lists)
    fwd_link, bwd_link = check_links(links, len(stage_times))
    rank_of = {stage: rank for rank, acts in enumerate(lists) for stage, _, _ in acts}
    timed, cause = _run(lists, durations, fwd_link, bwd_link, rank_of)
    step = max((t.end_s for t in timed.values()), default=0.0)
    busy = tuple(sum(durations[(s, k)] for s, k, _ in acts) for acts in lists)
    timeline = tuple(sorted(timed.values(), key=lambda t: (t.start_s, t.rank)))
    return StepSimulation(
        step_time_s=step,
        rank_busy_s=busy,
        rank_idle_s=tuple(step - b for b in busy),
        timeline=timeline,
        critical_path=_critical_path(timed, cause, step),
    )


def check_action_lists(actions: Sequence[Sequence[Action]], num_stages: int) -> list[list[Action]]:
    """``actions`` as lists, checked: known kinds, stages in range and on one rank, no repeats."""
    if num_stages < 1:
        raise ValueError("stage_times is empty; give one StageTimes per stage.")
    lists: list[list[Action]] = []
    seen: dict[Action, int] = {}
    owner: dict[int, int] = {}
    for rank, acts in enumerate(actions):
        lists.append([])
        for action in acts:
            stage, kind, mb = _check_action(action, rank, num_stages)
            if (stage, kind, mb) in seen:
                raise ValueError(
                    f"rank {rank} lists {kind}({stage}, {mb}) which rank {seen[(stage, kind, mb)]} already "
                    "lists; every action runs once per step: drop the repeat."
                )
            if owner.setdefault(stage, rank) != rank:
                raise ValueError(
                    f"stage {stage} has actions on rank {owner[stage]} and rank {rank}; a stage runs on one "
                    "rank: move its actions onto one list."
                )
            seen[(stage, kind, mb)] = rank
            lists[-1].append((stage, kind, mb))
    for stage, kind, mb in seen:
        other = "I" if kind == "B" else "B" if kind == "I" else None
        if other is not None and (stage, other, mb) in seen:
            raise ValueError(
                f"stage {stage} runs both B and I for micro-batch {mb}; a backward is either full (B) or "
                "split (I then W): keep one."
            )
    return lists


def _check_action(action: object, rank: int, num_stages: int) -> Action:
    if not isinstance(action, tuple) or len(action) != 3:
        raise ValueError(
            f"rank {rank} has action {action!r}; an action is a tuple (stage, kind, micro_batch)."
        )
    stage, kind, mb = action
    if kind not in KINDS:
        raise ValueError(f"rank {rank} has action {action!r} of unknown kind {kind!r}; use one of {KINDS}.")
    for name, value, top in (("stage", stage, num_stages), ("micro-batch", mb, None)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (top and value >= top):
            bound = f" below {top} (one StageTimes per stage)" if top else ""
            raise ValueError(
                f"rank {rank} has action {action!r} whose {name} must be an integer >= 0{bound}."
            )
    return stage, kind, mb


def _check_stage_times(
    stage_times: Sequence[StageTimes], lists: list[list[Action]]
) -> dict[tuple[int, str], float]:
    for stage, times in enumerate(stage_times):
        for name in ("forward_s", "backward_s", "input_grad_s", "weight_grad_s"):
            _check_time(getattr(times, name), f"stage_times[{stage}].{name}", optional=name != "forward_s")
    return {(s, k): stage_times[s].duration(k, s) for acts in lists for s, k, _ in acts}


def check_links(links: float | Sequence[LinkTime], num_stages: int) -> tuple[list[float], list[float]]:
    """Per boundary, the forward and the backward link time, checked."""
    if isinstance(links, (int, float)) and not isinstance(links, bool):
        _check_time(links, "links", optional=False)
        return [float(links)] * (num_stages - 1), [float(links)] * (num_stages - 1)
    if isinstance(links, (str, bytes, bool)) or not isinstance(links, Sequence):
        raise ValueError(f"links={links!r} must be seconds (one number) or one LinkTime per stage boundary.")
    if len(links) != num_stages - 1:
        raise ValueError(
            f"links has {len(links)} entries but {num_stages} stages have {num_stages - 1} boundaries; give "
            "one LinkTime per boundary or a single number."
        )
    for b, link in enumerate(links):
        _check_time(link.activation_s, f"links[{b}].activation_s", optional=False)
        _check_time(link.gradient_s, f"links[{b}].gradient_s", optional=True)
    return [link.activation_s for link in links], [link.backward_s for link in links]


def _check_time(value: object, name: str, optional: bool) -> None:
    if value is None and optional:
        return
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name}={value!r} must be a finite number of seconds >= 0; fix the measurement.")


_Cause = tuple[int, str, int] | None  # the action whose end (plus a link) set an action's start
_Found = TypeVar("_Found")  # what a sweep's resolver found an action needs


def _run(
    lists: list[list[Action]],
    durations: dict[tuple[int, str], float],
    fwd_link: list[float],
    bwd_link: list[float],
    rank_of: dict[int, int],
) -> tuple[dict[Action, TimedAction], dict[Action, _Cause]]:
    """Each action's start and end, and what set its start; raise on a deadlock."""
    done: dict[Action, TimedAction] = {}
    cause: dict[Action, _Cause] = {}

    def resolve(action: Action, rank: int) -> list[tuple[float, _Cause]] | None:
        return _dependencies(action, rank, fwd_link, bwd_link, rank_of, done)

    for rank, action, previous, deps in in_run_order(lists, resolve, len(fwd_link) + 1, done):
        ready = [(done[previous].end_s, previous)] if previous is not None else [(0.0, None)]
        start, cause[action] = max(ready + deps, key=lambda r: r[0])
        stage, kind, mb = action
        done[action] = TimedAction(rank, stage, kind, mb, start, start + durations[(stage, kind)])
    return done, cause


def in_run_order(
    lists: list[list[Action]],
    resolve: Callable[[Action, int], _Found | None],
    num_stages: int,
    ran: Collection[Action],
) -> Iterator[tuple[int, Action, Action | None, _Found]]:
    """Every action of ``lists`` in an order the ranks can run them: round after round over the ranks, a
    rank's next action as soon as ``resolve(action, rank)`` finds what it needs (``None``: not yet).

    Yields ``(rank, action, the rank's previous action or None, what resolve found)``; the caller records
    the action (in ``ran``, which ``resolve`` reads) before the next one is resolved.

    Raises:
        ValueError: when actions are left that no rank can start (the lists deadlock).
    """
    cursor = [0] * len(lists)
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(lists):
            while cursor[rank] < len(acts):
                action = acts[cursor[rank]]
                found = resolve(action, rank)
                if found is None:
                    break
                yield rank, action, acts[cursor[rank] - 1] if cursor[rank] else None, found
                cursor[rank] += 1
                progress = True
    if any(c < len(acts) for c, acts in zip(cursor, lists, strict=True)):
        raise ValueError(deadlock_message(lists, cursor, ran, num_stages))


def needs(action: Action, num_stages: int) -> list[tuple[Action, ...]]:
    """What ``action`` needs, each entry satisfied by any one of its alternatives."""
    stage, kind, mb = action
    if kind == "F":
        return [((stage - 1, "F", mb),)] if stage > 0 else []
    if kind == "W":
        return [((stage, "I", mb),)]
    own_forward: list[tuple[Action, ...]] = [((stage, "F", mb),)]
    if stage == num_stages - 1:
        return own_forward  # the loss, computed with the last forward, starts the backward
    return [*own_forward, ((stage + 1, "B", mb), (stage + 1, "I", mb))]


def _dependencies(
    action: Action,
    rank: int,
    fwd_link: list[float],
    bwd_link: list[float],
    rank_of: dict[int, int],
    done: dict[Action, TimedAction],
) -> list[tuple[float, _Cause]] | None:
    """When each dependency's result reaches ``rank``, and what produced it; ``None`` if one is not done."""
    out: list[tuple[float, _Cause]] = []
    for alternatives in needs(action, len(fwd_link) + 1):
        found = next((a for a in alternatives if a in done), None)
        if found is None:
            return None
        link = 0.0
        if rank_of[found[0]] != rank:
            boundary = min(found[0], action[0])
            link = fwd_link[boundary] if found[1] == "F" else bwd_link[boundary]
        out.append((done[found].end_s + link, found))
    return out


def deadlock_message(
    lists: list[list[Action]], cursor: list[int], done: Collection[Action], num_stages: int
) -> str:
    """What each rank that cannot go on waits for (``done``: the actions that ran)."""
    listed = {a for acts in lists for a in acts}
    waits = []
    for rank, acts in enumerate(lists):
        if cursor[rank] == len(acts):
            continue
        action = acts[cursor[rank]]
        missing = next(alts for alts in needs(action, num_stages) if not any(a in done for a in alts))
        wanted = " or ".join(_name(a) for a in missing)
        never = "" if any(a in listed for a in missing) else " (which no rank lists)"
        waits.append(f"rank {rank} waits at {_name(action)} (position {cursor[rank]}) for {wanted}{never}")
    return (
        "the action lists deadlock: "
        + "; ".join(waits)
        + ". Each rank runs its list in order, so reorder the lists (or add the missing actions) so that "
        "every action's inputs are produced before some rank blocks on them."
    )


def _name(action: Action) -> str:
    stage, kind, mb = action
    return f"{kind}(stage {stage}, mb {mb})"


def _critical_path(
    timed: dict[Action, TimedAction], cause: dict[Action, _Cause], step: float
) -> tuple[TimedAction, ...]:
    if not timed:
        return ()
    last = max(timed, key=lambda a: (timed[a].end_s, -timed[a].rank))
    assert math.isclose(timed[last].end_s, step)
    path: list[TimedAction] = []
    current: _Cause = last
    while current is not None:
        path.append(timed[current])
        current = cause[current]
    return tuple(reversed(path))
