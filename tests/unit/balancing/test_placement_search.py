"""The placement search by the schedule's step, and the compiled step it scores placements with.

- The compiled step equals :func:`simulate_step` (its reference) on hand-written action lists, V-shaped
  and split-backward ones included, with random times and links, by its loop and by its generated pass
  (which takes over after ``GENERATE_AFTER`` runs, up to ``GENERATED_MAX_ACTIONS`` actions); bad lists
  fail alike. Negative control: the generated source of a plan missing one dependency gives other steps.
- The local search (forced by a budget below the number of placements) never returns a placement slower
  than the proposal, and on small cases equals the brute-force optimum over every placement (enumerated
  here); the min-max partition it starts from is strictly slower on a constructed case (the negative
  control), and so is a descent of single-boundary moves (the old search) on a lumpy one.
- The busiest rank's time never exceeds the compiled step; a search that skips the candidates it bounds
  above the step to beat returns exactly what the full search does, with fewer simulations (a bound that
  lies, the negative control, stops it short).
- One :class:`StepPredictor` asked every placement of a pipeline (each stage's inputs reused across them)
  answers each exactly as a prediction of that placement alone; a predictor built for other workers, the
  negative control, does not.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest

from lightning_dynmo.balancing import (
    BalanceProblem,
    Hardware,
    LayerCost,
    Placement,
    compiled_schedule,
    partition,
    placement_search,
)
from lightning_dynmo.balancing.compiled_schedule import CompiledSchedule
from lightning_dynmo.balancing.schedule_model import Action, LinkTime, StageTimes, simulate_step
from lightning_dynmo.balancing.step_prediction import (
    ScheduleOrder,
    StepPredictor,
    predict_step,
    refine,
    step_at_least,
)
from tests.unit.balancing.brute import all_placements


def one_f_one_b(num_stages: int, m: int) -> list[list[Action]]:
    out = []
    for s in range(num_stages):
        warmup = min(m, num_stages - s)
        order: list[Action] = [(s, "F", i) for i in range(warmup)]
        for i in range(m):
            order.append((s, "B", i))
            if warmup + i < m:
                order.append((s, "F", warmup + i))
        out.append(order)
    return out


def v_split(num_stages: int, m: int) -> list[list[Action]]:
    """A V over ``num_stages // 2`` ranks (rank r holds stages r and S-1-r), backward split in I and W:
    each rank runs its first stage's forwards, its second's, then I and W of its second and first."""
    ranks = num_stages // 2
    out = []
    for r in range(ranks):
        first, second = r, num_stages - 1 - r
        acts: list[Action] = [(first, "F", i) for i in range(m)] + [(second, "F", i) for i in range(m)]
        for stage in (second, first):
            for i in range(m):
                acts += [(stage, "I", i), (stage, "W", i)]
        out.append(acts)
    return out


V_ORDER = ScheduleOrder("V", v_split)
ORDER = ScheduleOrder("1F1B", one_f_one_b)


def random_times(draw: random.Random, stages: int) -> list[StageTimes]:
    return [
        StageTimes(draw.uniform(0, 3), draw.uniform(0, 5), draw.uniform(0, 2), draw.uniform(0, 2))
        for _ in range(stages)
    ]


@pytest.mark.parametrize("generate_after", [0, 10**9], ids=["generated pass", "loop"])
@pytest.mark.parametrize("lists", [one_f_one_b, v_split], ids=["1F1B", "V split"])
def test_the_compiled_step_equals_simulate_step(
    lists: Callable[[int, int], list[list[Action]]], generate_after: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiled_schedule, "GENERATE_AFTER", generate_after)
    draw = random.Random(7)
    for stages, m in ((2, 1), (4, 3), (6, 5), (8, 4)):
        actions = lists(stages, m)
        compiled = CompiledSchedule.build(actions, stages)
        for _ in range(5):
            times = random_times(draw, stages)
            links = [LinkTime(draw.uniform(0, 1), draw.uniform(0, 1)) for _ in range(stages - 1)]
            for link in (0.0, 0.25, links):
                reference = simulate_step(actions, times, link)
                step, busy = compiled.step(times, link)
                assert step == reference.step_time_s
                assert busy == reference.rank_busy_s


def test_the_pass_is_generated_after_its_runs_and_keeps_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_schedule, "GENERATE_AFTER", 3)
    monkeypatch.setattr(compiled_schedule, "GENERATED_MAX_ACTIONS", 72)  # v_split(6, 4): 72 actions
    draw = random.Random(3)
    short, long = v_split(6, 4), v_split(8, 4)
    compiled, loop_only = CompiledSchedule.build(short, 6), CompiledSchedule.build(long, 8)
    for run in range(6):
        link = draw.uniform(0, 1)
        times = random_times(draw, 8)
        assert compiled.step(times[:6], link)[0] == simulate_step(short, times[:6], link).step_time_s
        assert loop_only.step(times, link)[0] == simulate_step(long, times, link).step_time_s
        assert (compiled._pass._generated is not None) == (run >= 3)
    assert loop_only._pass._generated is None  # more actions than GENERATED_MAX_ACTIONS: the loop only


def test_a_generated_pass_missing_a_dependency_gives_another_step() -> None:
    """The negative control of the equivalence above: the same source built from a plan with one
    cross-rank dependency dropped no longer equals simulate_step."""
    draw, actions = random.Random(5), one_f_one_b(4, 3)
    compiled = CompiledSchedule.build(actions, 4)
    plan = list(compiled._plan)
    i = next(i for i, step in enumerate(plan) if step[2] >= 0 and step[3] >= 0)
    plan[i] = (plan[i][0], plan[i][1], -1, -1, plan[i][4], plan[i][5])
    namespace: dict[str, Any] = {}
    exec(compile(compiled_schedule._runner_source(plan, 4), "<test>", "exec"), namespace)
    differs = 0
    for _ in range(10):
        times = random_times(draw, 4)
        link = compiled_schedule._link_slots(0.5, 4)
        durations = compiled.durations(times)
        true_step = simulate_step(actions, times, 0.5).step_time_s
        differs += namespace["run"](durations, link) != true_step
        assert compiled._pass.loop(durations, link) == true_step
    assert differs > 0


def test_the_compiled_step_rejects_what_simulate_step_rejects() -> None:
    stuck = [[(0, "B", 0), (0, "F", 0)], [(1, "F", 0), (1, "B", 0)]]  # rank 0 waits for its own F
    with pytest.raises(ValueError, match=r"the action lists deadlock: rank 0 waits at B\(stage 0, mb 0\)"):
        CompiledSchedule.build(stuck, 2)
    with pytest.raises(ValueError, match="stage 1 has actions on rank 0 and rank 1"):
        CompiledSchedule.build([[(0, "F", 0), (1, "F", 0)], [(1, "B", 0)]], 2)
    compiled = CompiledSchedule.build(one_f_one_b(2, 2), 2)
    with pytest.raises(ValueError, match="stage_times has 1 entries but the compiled lists run 2 stages"):
        compiled.step([StageTimes(1.0, 1.0)])
    with pytest.raises(ValueError, match=r"stage_times\[1\] gives F -1.0; times must be finite"):
        compiled.step([StageTimes(1.0, 1.0), StageTimes(-1.0, 1.0)])
    with pytest.raises(ValueError, match="links has 2 entries but 2 stages have 1 boundaries"):
        compiled.step([StageTimes(1.0, 1.0)] * 2, [LinkTime(0.1)] * 2)


def brute_best(problem: BalanceProblem, stages: int, step_of: Callable[[Placement], float]) -> float:
    return min(step_of(p) for p in all_placements(problem.num_layers, stages))


def dense_with_head(layers: int) -> BalanceProblem:
    """Equal blocks and a head + loss of 2 blocks pinned to the last stage (the paper's shape, small)."""
    block = LayerCost(fwd_time_s=1.0, bwd_time_s=2.0)
    return BalanceProblem([block] * layers, hardware=Hardware(last_stage_extra=LayerCost(2.0, 4.0)))


def lumpy(layers: int) -> BalanceProblem:
    """Mixture-of-Depths-like: dense layers alternate with routed ones at 0.3 of their cost."""
    costs = [LayerCost(fwd_time_s=1.0, bwd_time_s=2.0), LayerCost(fwd_time_s=0.3, bwd_time_s=0.6)] * (
        layers // 2
    )
    return BalanceProblem(costs, hardware=Hardware(last_stage_extra=LayerCost(1.5, 3.0)))


def random_problem(seed: int, layers: int) -> BalanceProblem:
    draw = random.Random(seed)
    costs = [
        LayerCost(fwd_time_s=draw.uniform(0.2, 2), bwd_time_s=draw.uniform(0.4, 4)) for _ in range(layers)
    ]
    return BalanceProblem(costs, hardware=Hardware(last_stage_extra=LayerCost(2.0, 3.0)))


CASES = [
    ("dense + head, 1F1B", dense_with_head(12), 4, ORDER, None),
    ("lumpy, 1F1B", lumpy(12), 4, ORDER, None),
    ("random, 1F1B", random_problem(3, 11), 4, ORDER, None),
    ("dense + head, V", dense_with_head(12), 4, V_ORDER, [0, 1, 1, 0]),
    ("lumpy, V", lumpy(12), 4, V_ORDER, [0, 1, 1, 0]),
]


@pytest.mark.parametrize(
    ("problem", "stages", "order", "workers"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_local_search_is_never_slower_than_the_proposal_and_finds_the_brute_force_optimum(
    problem: BalanceProblem, stages: int, order: ScheduleOrder, workers: list[int] | None
) -> None:
    m = 6

    def step_of(p: Placement) -> float:
        return predict_step(problem, p, order, m, workers).step_s

    proposal = partition(problem, stages)
    count = sum(1 for _ in all_placements(problem.num_layers, stages))
    found = refine(problem, proposal, step_of, budget=count - 1, stage_workers=workers)
    assert not found.exact and found.simulations <= count - 1  # the local search, not the enumeration
    assert found.proposal_step_s == step_of(proposal)
    assert found.step_s <= found.proposal_step_s
    assert found.step_s == step_of(found.placement)
    assert found.step_s == pytest.approx(brute_best(problem, stages, step_of), rel=1e-12)


def test_on_random_v_cases_the_local_search_is_a_local_search_within_3_percent_of_the_optimum() -> None:
    # No guarantee of the optimum: on 9 random V problems it reaches it on 6 and misses by 0.2-2.5% on
    # 3 (seeds 5, 6, 7). Below ``budget`` placements the search enumerates them all instead.
    reached = 0
    for seed in range(3, 12):
        problem, workers = random_problem(seed, 11), [0, 1, 1, 0]

        def step_of(p: Placement, problem: BalanceProblem = problem) -> float:
            return predict_step(problem, p, V_ORDER, 6, [0, 1, 1, 0]).step_s

        proposal = partition(problem, 4)
        found = refine(problem, proposal, step_of, budget=119, stage_workers=workers)  # 120 placements
        best = brute_best(problem, 4, step_of)
        assert not found.exact and found.step_s <= step_of(proposal)
        assert found.step_s <= best * 1.03
        reached += found.step_s <= best * (1 + 1e-12)
    assert reached == 6


def test_negative_control_the_partition_and_a_single_boundary_descent_are_strictly_slower() -> None:
    # The min-max partition of equal blocks beside a heavy head ties many stages at its bottleneck;
    # the schedule's fill and drain then favour another placement of that bottleneck.
    problem, m = dense_with_head(12), 6

    def step_of(p: Placement) -> float:
        return predict_step(problem, p, ORDER, m).step_s

    best = brute_best(problem, 4, step_of)
    proposal = partition(problem, 4)
    assert step_of(proposal) > best * (1 + 1e-9)
    # On lumpy layers (dense and routed alternating) one boundary moved by one layer swaps a dense layer
    # for a routed one: a descent of such moves (the search before this one) stops above the optimum.
    lumpy_problem = lumpy(12)

    def lumpy_step(p: Placement) -> float:
        return predict_step(lumpy_problem, p, ORDER, m).step_s

    start = partition(lumpy_problem, 4)
    _, stuck_s = single_boundary_descent(start, lumpy_step)
    optimum = brute_best(lumpy_problem, 4, lumpy_step)
    assert stuck_s > optimum * (1 + 1e-9)
    found = refine(lumpy_problem, start, lumpy_step, budget=100)
    assert not found.exact and found.step_s == pytest.approx(optimum, rel=1e-12)


def single_boundary_descent(
    start: Placement, step_of: Callable[[Placement], float]
) -> tuple[Placement, float]:
    best, best_s = start, step_of(start)
    improved = True
    while improved:
        improved = False
        bounds = best.boundaries
        for i, delta in itertools.product(range(1, len(bounds) - 1), (-1, 1)):
            moved = (*bounds[:i], bounds[i] + delta, *bounds[i + 1 :])
            if moved[i - 1] < moved[i] < moved[i + 1] and step_of(Placement(moved)) < best_s:
                best, best_s, improved = Placement(moved), step_of(Placement(moved)), True
                break
    return best, best_s


def test_beyond_eight_stages_the_result_is_a_local_optimum_of_neighbour_and_same_worker_moves() -> None:
    problem, stages, m = random_problem(11, 24), 12, 4
    workers = [min(s, stages - 1 - s) for s in range(stages)]  # a V: rank r holds stages r and 11 - r

    def step_of(p: Placement) -> float:
        return predict_step(problem, p, V_ORDER, m, workers).step_s

    proposal = partition(problem, stages)
    found = refine(problem, proposal, step_of, budget=2000, stage_workers=workers)
    assert not found.exact and found.simulations < 2000 and found.step_s <= step_of(proposal)
    pairs = [(a, a + 1) for a in range(stages - 1)] + [(s, stages - 1 - s) for s in range(stages // 2)]
    bounds = found.placement.boundaries
    for (a, b), count, sign in itertools.product(pairs, (1, 2), (1, -1)):
        src, dst = (a, b) if sign > 0 else (b, a)
        moved = list(bounds)
        for i in range(min(src, dst) + 1, max(src, dst) + 1):
            moved[i] += -count if src < dst else count
        if all(x < y for x, y in itertools.pairwise(moved)):
            assert step_of(Placement(tuple(moved))) >= found.step_s
    for src, dst in itertools.permutations(range(stages), 2):  # and of one layer between any two stages
        moved = list(bounds)
        for i in range(min(src, dst) + 1, max(src, dst) + 1):
            moved[i] += -1 if src < dst else 1
        if all(x < y for x, y in itertools.pairwise(moved)):
            assert step_of(Placement(tuple(moved))) >= found.step_s


def test_beyond_eight_stages_the_wider_moves_never_end_above_the_narrower_ones_and_go_below_on_some(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same 12-stage V problems searched twice: as refine runs, and with no wider moves (the search
    # before them). The wider moves come after both descents ended, so they can only go lower; on seeds
    # 1, 12, 16 and 19 they do (by 1.0-1.7%): the narrower local optimum was not theirs.
    stages, m = 12, 4
    workers = [min(s, stages - 1 - s) for s in range(stages)]
    wider, narrower = {}, {}
    for seed in range(20):
        problem = random_problem(seed, 24)

        def step_of(p: Placement, problem: BalanceProblem = problem) -> float:
            return predict_step(problem, p, V_ORDER, m, workers).step_s

        proposal = partition(problem, stages)
        wider[seed] = refine(problem, proposal, step_of, budget=2000, stage_workers=workers)
        with monkeypatch.context() as patch:
            patch.setattr(placement_search._Pairs, "wide", lambda self, placement: [])
            narrower[seed] = refine(problem, proposal, step_of, budget=2000, stage_workers=workers)
        assert wider[seed].simulations < 2000 and narrower[seed].simulations <= wider[seed].simulations
        assert wider[seed].step_s <= narrower[seed].step_s
    lower = [seed for seed in range(20) if wider[seed].step_s < narrower[seed].step_s * (1 - 1e-9)]
    assert lower == [1, 12, 16, 19]


def test_refine_rejects_workers_that_do_not_match_the_stages() -> None:
    problem = dense_with_head(8)
    with pytest.raises(ValueError, match=r"stage_workers has 3 entries but proposal=.* has 4 stages"):
        refine(problem, partition(problem, 4), lambda p: 0.0, stage_workers=[0, 1, 0])


@pytest.mark.parametrize("lists", [one_f_one_b, v_split], ids=["1F1B", "V split"])
def test_the_busiest_rank_bounds_the_compiled_step_from_below(
    lists: Callable[[int, int], list[list[Action]]],
) -> None:
    draw = random.Random(11)
    for stages, m in ((2, 1), (4, 3), (8, 4)):
        compiled = CompiledSchedule.build(lists(stages, m), stages)
        for _ in range(10):
            times = random_times(draw, stages)
            step, busy = compiled.step(times)
            assert compiled.busiest(times) == max(busy) <= step
    # One stage: the rank never waits, so the bound is the step itself.
    single = CompiledSchedule.build(one_f_one_b(1, 3), 1)
    assert single.busiest([StageTimes(1.0, 2.0)]) == single.step([StageTimes(1.0, 2.0)])[0] == 9.0
    with pytest.raises(ValueError, match="stage_times has 1 entries but the compiled lists run 2 stages"):
        CompiledSchedule.build(one_f_one_b(2, 2), 2).busiest([StageTimes(1.0, 1.0)])


SEARCHES = [
    ("dense + head, V, 16 stages", dense_with_head(44), 16, V_ORDER, [min(s, 15 - s) for s in range(16)]),
    ("lumpy, V, 12 stages", lumpy(36), 12, V_ORDER, [min(s, 11 - s) for s in range(12)]),
    ("random, 1F1B, 10 stages", random_problem(5, 30), 10, ORDER, None),
    ("random, 1F1B, 4 stages (exact)", random_problem(6, 9), 4, ORDER, None),
]


@pytest.mark.parametrize(
    ("problem", "stages", "order", "workers"), [c[1:] for c in SEARCHES], ids=[c[0] for c in SEARCHES]
)
def test_skipping_what_cannot_beat_the_best_changes_nothing_but_the_simulations_run(
    problem: BalanceProblem, stages: int, order: ScheduleOrder, workers: list[int] | None
) -> None:
    m, runs = 8, {"full": 0}

    def step_of(p: Placement) -> float:
        runs["full"] += 1
        return predict_step(problem, p, order, m, workers).step_s

    def at_least(p: Placement, time_s: float) -> float:
        value = step_at_least(problem, p, order, m, time_s, workers)
        exact = predict_step(problem, p, order, m, workers).step_s
        assert value == exact or exact >= value >= time_s  # the contract: the step, or a bound over time_s
        return value

    plain = refine(problem, partition(problem, stages), step_of, budget=1000, stage_workers=workers)
    calls = runs["full"]
    runs["full"] = 0
    fast = refine(
        problem, partition(problem, stages), step_of, budget=1000, stage_workers=workers, at_least=at_least
    )
    assert fast == plain  # the same placement, step, proposal step and count of placements scored
    assert runs["full"] < calls  # the bound answered for some candidates: fewer simulations
    # Negative control: a bound that wrongly claims every candidate slower leaves the search where its
    # starting points were (the proposal or the best seed, scored in full), short of what it finds.
    stuck = refine(
        problem,
        partition(problem, stages),
        step_of,
        budget=1000,
        stage_workers=workers,
        at_least=lambda p, time_s: time_s,
    )
    assert stuck.step_s > plain.step_s


def priced_problem(layers: int) -> BalanceProblem:
    """Every input a stage's prediction reads: both pinned parts, weight passes measured on some layers,
    updates, per-link send times, worker slowdowns and a cost per action."""
    draw = random.Random(11)
    costs = [
        LayerCost(
            fwd_time_s=draw.uniform(0.5, 2),
            bwd_time_s=(b := draw.uniform(1, 4)),
            bwd_weight_time_s=draw.choice((0.0, 0.4 * b)),
            update_time_s=draw.uniform(0, 0.3),
        )
        for _ in range(layers)
    ]
    links = [[draw.uniform(0, 0.2) for _ in range(layers)] for _ in range(5)]
    hardware = Hardware(
        first_stage_extra=LayerCost(0.7, 1.0, bwd_weight_time_s=1.0),  # run whole, as torch's first stage
        last_stage_extra=LayerCost(3.0, 2.0, update_time_s=0.5),
        comm_time_s=links,
        worker_slowdown=[1.0, 1.3, 0.9],
        per_op_s=0.05,
    )
    return BalanceProblem(costs, hardware=hardware)


def test_one_predictor_asked_every_placement_answers_each_as_a_prediction_of_it_alone() -> None:
    problem, stages, m, workers = priced_problem(11), 6, 4, [0, 1, 2, 2, 1, 0]
    placements = list(all_placements(11, stages))
    random.Random(3).shuffle(placements)  # neighbours apart: reused inputs come from any earlier one
    predictor = StepPredictor(problem, V_ORDER, m, stages, workers)
    for p in placements:
        alone = predict_step(problem, p, V_ORDER, m, workers)
        assert predictor.predict(p) == alone
        for time_s in (0.5 * alone.step_s, alone.step_s, 2.0 * alone.step_s):
            assert predictor.at_least(p, time_s) == step_at_least(problem, p, V_ORDER, m, time_s, workers)
    # Negative control: built for other workers (slowdowns), the same comparison fails.
    other = StepPredictor(problem, V_ORDER, m, stages, [2, 1, 0, 0, 1, 2])
    assert any(other.predict(p) != predict_step(problem, p, V_ORDER, m, workers) for p in placements)
    with pytest.raises(ValueError, match="has 2 stages but this predictor was built for 6"):
        predictor.predict(Placement.from_string("0-4|5-10"))
