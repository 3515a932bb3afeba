"""The schedule model's step, compiled once per action lists, for searches that predict many placements.

Read in this order: :meth:`CompiledSchedule.build` (checks the lists as
:func:`~lightning_dynmo.balancing.schedule_model.simulate_step` does and fixes the order to evaluate
them in), then :meth:`CompiledSchedule.step` (one pass: the step and each rank's busy time) and
:meth:`CompiledSchedule.busiest` (the busiest rank's time alone: a lower bound of the step, without the
pass, which a search uses to skip the placements that cannot beat its best). Both are
:meth:`~CompiledSchedule.durations` (one action's seconds per stage and kind, checked) followed by
:meth:`~CompiledSchedule.run` or :meth:`~CompiledSchedule.busy`; a search that keeps each stage's
durations (:meth:`~CompiledSchedule.stage_durations`) calls those on them directly.

Why: :func:`~lightning_dynmo.balancing.schedule_model.simulate_step` checks its input, records every
action's timeline and traces the critical path on every call; a placement search predicts the same action
lists hundreds of times with only the stage times changed. Which actions its loop can run next depends
only on which results exist, never on how long anything took, so that order is found once; a step is then
one pass in it, each action starting at the latest of its rank's previous action and its dependencies
(plus the link where they run on another rank). Same arithmetic in the same order, so the same numbers.

A search runs that pass hundreds of times per decision, so after :data:`GENERATE_AFTER` runs of a loop over
the plan the pass becomes Python source generated for these lists (:func:`_runner_source`: one line per
action, each end time a local variable), about 3x faster; compiling it costs about as much as that many
loop runs, so a pass used once never pays for it. Lists of more than :data:`GENERATED_MAX_ACTIONS`
actions keep the loop. Both make the same comparisons and additions in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_dynmo.balancing.schedule_model import (
    KINDS,
    Action,
    LinkTime,
    StageTimes,
    check_action_lists,
    check_links,
    in_run_order,
    needs,
)

_SLOT = {kind: i for i, kind in enumerate(KINDS)}

#: Runs of the loop after which a pass switches to its generated source (compiling that source costs
#: about as long as this many loop runs: about 23 us against 0.12 us per action here).
GENERATE_AFTER = 200
#: Lists of up to this many actions may run generated source (:func:`_runner_source`); longer ones the loop.
GENERATED_MAX_ACTIONS = 20_000


#: One action in evaluation order: its duration slot (4 * stage + kind), the index of its rank's previous
#: action and of its (at most two) dependencies with their link slots. Index -1 reads the sentinel 0 s
#: after the last action, link slot -1 the 0 s after the last link: "none" costs no branch.
_Step = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class CompiledSchedule:
    """Per-rank action lists, checked once and put in an order that evaluates their step in one pass.

    Attributes:
        num_stages: Stages the lists run.
        num_ranks: Ranks (one list each).
        rank_of: Per stage, its rank (-1 for a stage no list runs).
    """

    num_stages: int
    num_ranks: int
    rank_of: tuple[int, ...]
    _plan: tuple[_Step, ...]
    _rank_slots: tuple[tuple[int, ...], ...]  # per rank, its actions' duration slots in its order
    _kinds: tuple[tuple[str, ...], ...]  # per stage, the kinds its actions use
    _pass: _Pass = field(compare=False, repr=False)  # the step's pass over _plan

    @classmethod
    def build(cls, actions: Sequence[Sequence[Action]], num_stages: int) -> CompiledSchedule:
        """Check ``actions`` (per rank, ``(stage, kind, micro_batch)`` in order) and compile them.

        Raises:
            ValueError: as :func:`~lightning_dynmo.balancing.schedule_model.simulate_step` on bad lists,
                or lists that deadlock.
        """
        lists = check_action_lists(actions, num_stages)
        owner = {stage: rank for rank, acts in enumerate(lists) for stage, _, _ in acts}
        index: dict[Action, int] = {}
        steps: list[_Step] = []

        def resolve(action: Action, rank: int) -> tuple[tuple[int, int], ...] | None:
            return _resolved(action, rank, num_stages, owner, index)

        for _, action, before, deps in in_run_order(lists, resolve, num_stages, index):
            previous = index[before] if before is not None else -1
            index[action] = len(steps)
            (dep1, link1), (dep2, link2) = (*deps, (-1, -1), (-1, -1))[:2]
            steps.append((4 * action[0] + _SLOT[action[1]], previous, dep1, link1, dep2, link2))
        kinds = tuple(tuple(sorted({k for s, k, _ in index if s == stage})) for stage in range(num_stages))
        rank_of = tuple(owner.get(s, -1) for s in range(num_stages))
        slots = tuple(tuple(4 * s + _SLOT[k] for s, k, _ in acts) for acts in lists)
        plan = tuple(steps)
        return cls(num_stages, len(lists), rank_of, plan, slots, kinds, _Pass(plan, num_stages))

    def step(
        self, stage_times: Sequence[StageTimes], links: float | Sequence[LinkTime] = 0.0
    ) -> tuple[float, tuple[float, ...]]:
        """The step time and each rank's busy time, as ``simulate_step`` computes them.

        Args:
            stage_times: Per stage, one micro-batch's compute times.
            links: Per stage boundary, its link times; or one number of seconds for every boundary.

        Raises:
            ValueError: for a stage count other than the lists', a missing, negative or non-finite time.
        """
        return self.run(self.durations(stage_times), links)

    def run(
        self, durations: Sequence[float], links: float | Sequence[LinkTime] = 0.0
    ) -> tuple[float, tuple[float, ...]]:
        """:meth:`step` from :meth:`durations` already computed (a search keeps each stage's apart)."""
        return self.end(durations, links), self.busy(durations)

    def end(self, durations: Sequence[float], links: float | Sequence[LinkTime] = 0.0) -> float:
        """The step alone (:meth:`run`'s first value)."""
        return self._pass(durations, _link_slots(links, self.num_stages))

    def busiest(self, stage_times: Sequence[StageTimes]) -> float:
        """The longest of the ranks' busy times, without the pass: no step is shorter, since a rank runs
        its actions one after another (a lower bound of :meth:`step`'s, up to rounding).

        Raises:
            ValueError: as :meth:`step`.
        """
        return max(self.busy(self.durations(stage_times)), default=0.0)

    def busy(self, durations: Sequence[float]) -> tuple[float, ...]:
        """Each rank's busy time: its actions' :meth:`durations` end to end."""
        return tuple(sum(map(durations.__getitem__, slots)) for slots in self._rank_slots)

    def durations(self, stage_times: Sequence[StageTimes]) -> list[float]:
        """Per duration slot (4 * stage + kind), one action's seconds; checked.

        Raises:
            ValueError: as :meth:`step`.
        """
        if len(stage_times) != self.num_stages:
            raise ValueError(
                f"stage_times has {len(stage_times)} entries but the compiled lists run {self.num_stages} "
                "stages; give one StageTimes per stage."
            )
        durations = [0.0] * (4 * self.num_stages)
        for stage, times in enumerate(stage_times):
            durations[4 * stage : 4 * stage + 4] = self.stage_durations(stage, times)
        return durations

    def stage_durations(self, stage: int, times: StageTimes) -> list[float]:
        """Stage ``stage``'s four duration slots (one per kind; 0 for a kind it does not run); checked.

        Raises:
            ValueError: for a missing, negative or non-finite time of a kind the stage runs.
        """
        slots = [0.0] * 4
        for kind in self._kinds[stage]:
            value = times.duration(kind, stage)
            if isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"stage_times[{stage}] gives {kind} {value!r}; times must be finite numbers of "
                    "seconds >= 0: fix the measurement."
                )
            slots[_SLOT[kind]] = value
        return slots


def _resolved(
    action: Action, rank: int, num_stages: int, owner: dict[int, int], index: dict[Action, int]
) -> tuple[tuple[int, int], ...] | None:
    """``action``'s dependencies as (index, link slot); ``None`` while one has not run."""
    out = []
    for alternatives in needs(action, num_stages):
        found = next((a for a in alternatives if a in index), None)
        if found is None:
            return None
        slot = -1
        if owner[found[0]] != rank:
            boundary = min(found[0], action[0])
            slot = boundary if found[1] == "F" else num_stages - 1 + boundary
        out.append((index[found], slot))
    return tuple(out)


class _Pass:
    """The step's pass over a plan: a loop over it for the first :data:`GENERATE_AFTER` runs, then its
    generated source (lists of up to :data:`GENERATED_MAX_ACTIONS` actions)."""

    def __init__(self, plan: tuple[_Step, ...], num_stages: int) -> None:
        self._plan, self._num_stages = plan, num_stages
        self._runs = 0
        self._generated: Callable[[Sequence[float], Sequence[float]], float] | None = None

    def __call__(self, durations: Sequence[float], link: Sequence[float]) -> float:
        """The step from the duration slots and ``link`` (:func:`_link_slots`'s list)."""
        if self._generated is not None:
            return self._generated(durations, link)
        self._runs += 1
        if self._runs > GENERATE_AFTER and len(self._plan) <= GENERATED_MAX_ACTIONS:
            namespace: dict[str, Any] = {}
            source = _runner_source(self._plan, self._num_stages)
            exec(compile(source, "<compiled schedule>", "exec"), namespace)  # source of our own: no input
            self._generated = namespace["run"]
            return self(durations, link)
        return self.loop(durations, link)

    def loop(self, durations: Sequence[float], link: Sequence[float]) -> float:
        """The step by a loop over the plan."""
        end = [0.0] * (len(self._plan) + 1)  # index -1: the sentinel 0 (no such action)
        for i, (slot, previous, dep1, link1, dep2, link2) in enumerate(self._plan):
            start = end[previous]
            ready = end[dep1] + link[link1]
            if ready > start:
                start = ready
            ready = end[dep2] + link[link2]
            if ready > start:
                start = ready
            end[i] = start + durations[slot]
        return max(end)


def _runner_source(plan: Sequence[_Step], num_stages: int) -> str:
    """Python source of ``run(durations, links)``: :meth:`_Pass.loop` over ``plan`` unrolled, one action a
    line (or four), each end time a local ``e<index>``.

    A dependency on no action (index -1, the loop's sentinel 0 s) is left out, since no start is below 0;
    so is a link slot -1 (0 s: ``x + 0.0 == x``). The step is the latest end among each rank's last
    actions: an action never ends before its rank's previous one (durations are >= 0)."""
    slots = ", ".join(f"d{i}" for i in range(4 * num_stages))
    links = ", ".join(f"l{i}" for i in range(2 * (num_stages - 1)))
    lines = ["def run(durations, links):", f"    {slots}, = durations"]
    if links:
        lines.append(f"    {links}, _ = links")
    followed: set[int] = set()
    for i, (slot, previous, dep1, link1, dep2, link2) in enumerate(plan):
        followed.add(previous)
        deps = ((dep1, link1), (dep2, link2))
        ready = [f"e{d}" + (f" + l{k}" if k >= 0 else "") for d, k in deps if d >= 0]
        start = f"e{previous}" if previous >= 0 else "0.0"
        if not ready:
            lines.append(f"    e{i} = {start} + d{slot}")
            continue
        lines.append(f"    s = {start}")
        for term in ready:
            lines += [f"    r = {term}", "    if r > s:", "        s = r"]
        lines.append(f"    e{i} = s + d{slot}")
    lasts = [f"e{i}" for i in range(len(plan)) if i not in followed]
    lines.append(f"    return max(0.0, {', '.join(lasts)})" if lasts else "    return 0.0")
    return "\n".join(lines) + "\n"


def _link_slots(links: float | Sequence[LinkTime], num_stages: int) -> list[float]:
    """Forward link times per boundary, then backward ones (the slots :func:`_resolved` refers to), then
    0 for slot -1 (no link: the two stages share a rank)."""
    forward, backward = check_links(links, num_stages)
    return [*forward, *backward, 0.0]
