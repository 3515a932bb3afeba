import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynmo.balancing import BalanceProblem, Hardware, LayerCost, Placement, repack, solve_partition

from .brute import assert_fits, assert_valid, brute_optimum, direct_loads, problem_of
from .strategies import problems


@st.composite
def repack_problems(draw: st.DrawFn):
    costs, stages = draw(problems(max_stages=4))
    current = Placement.from_sizes(_sizes(draw, len(costs), stages))
    mem = [sum(costs[i].memory_bytes for i in current.layers_of(s)) for s in range(stages)]
    if draw(st.booleans()):
        caps = max(mem) + draw(st.integers(0, 40))
    else:
        caps = [m + draw(st.integers(0, 40)) for m in mem]
    return costs, current, caps


def _sizes(draw, layers, stages):
    sizes = [1] * stages
    for _ in range(layers - stages):
        sizes[draw(st.integers(0, stages - 1))] += 1
    return sizes


def _caps(caps, stages):
    return [caps] * stages if isinstance(caps, int) else list(caps)


@settings(max_examples=120, deadline=None)
@given(repack_problems(), st.floats(0.0, 1.0))
def test_repack_without_target_picks_the_fewest_stages_within_the_slowdown(problem, slowdown):
    costs, current, caps = problem
    result = repack(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=caps)), current, max_slowdown=slowdown
    )
    assert_valid(result.placement, len(costs))
    assert_fits(costs, result.placement, _caps(caps, current.num_stages)[: result.num_stages])
    assert result.released_stages == tuple(range(result.num_stages, current.num_stages))
    previous = max(direct_loads(costs, current))
    limit = previous * (1 + slowdown)
    assert max(direct_loads(costs, result.placement)) <= limit + 1e-9
    full = _caps(caps, current.num_stages)
    # Brute force: no smaller stage count (with the kept stages' caps) would have been within the limit.
    for k in range(1, result.num_stages if result.released_stages else current.num_stages):
        best = brute_optimum(costs, k, caps=full[:k])
        assert best is None or best > limit - 1e-9 * max(1.0, limit)  # rounding: brute sums directly


@settings(max_examples=120, deadline=None)
@given(repack_problems(), st.data())
def test_repack_to_a_target_reaches_it_or_explains_memory(problem, data):
    costs, current, caps = problem
    target = data.draw(st.integers(1, current.num_stages))
    full = _caps(caps, current.num_stages)
    best = brute_optimum(costs, target, caps=full[:target])
    if best is None:
        with pytest.raises(
            ValueError, match=rf"target_num_stages={target} cannot be reached.*overflows stage"
        ):
            repack(
                BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=caps)),
                current,
                target_num_stages=target,
            )
        return
    result = repack(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=caps)),
        current,
        target_num_stages=target,
    )
    assert result.num_stages == target
    assert_fits(costs, result.placement, full[:target])
    assert result.bottleneck == pytest.approx(best)  # the best balanced re-pack, not the first fit


def test_released_stages_are_the_highest_indices():
    costs = [LayerCost(fwd_time_s=1.0, memory_bytes=10)] * 8
    result = repack(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=40)),
        "0-1|2-3|4-5|6-7",
        max_slowdown=1.0,
    )
    assert str(result.placement) == "0-3|4-7"
    assert result.released_stages == (2, 3)
    assert result.predicted_slowdown == pytest.approx(1.0)


def test_repack_keeps_current_when_nothing_smaller_is_fast_enough():
    costs = [LayerCost(fwd_time_s=1.0)] * 4
    result = repack(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=None)), "0-1|2-3", max_slowdown=0.05
    )
    assert (str(result.placement), result.released_stages) == ("0-1|2-3", ())


def test_repack_prefers_the_best_balanced_placement():
    # First-fit merging would put 0-2 on one stage; the balanced re-pack splits 6 + 1 + 1 | 6.
    costs = [LayerCost(fwd_time_s=w, memory_bytes=1) for w in [6.0, 1.0, 1.0, 6.0]]
    result = repack(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=10)), "0|1|2|3", target_num_stages=2
    )
    assert result.bottleneck == solve_partition(BalanceProblem(costs), 2).bottleneck == 7.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_num_stages": 3}, r"target_num_stages=3 must be an integer in 1..2"),
        ({"target_num_stages": 0}, r"target_num_stages=0 must be an integer in 1..2"),
        ({"target_num_stages": 1, "memory_capacity_bytes": 30}, r"target_num_stages=1 cannot be reached"),
        ({"max_slowdown": -1.0}, r"max_slowdown=-1.0 must be a number >= 0"),
        ({"memory_capacity_bytes": [1, 2, 3]}, r"memory_capacity_bytes has 3 entries but there are 2 stages"),
        ({"current": "0-4"}, r"current=0-4 covers 5 layers but costs has 4 records"),
    ],
)
def test_repack_rejects_bad_input(kwargs, match):
    costs = [LayerCost(fwd_time_s=1.0, memory_bytes=10)] * 4
    args = {"current": "0-1|2-3", "memory_capacity_bytes": 100, **kwargs}
    with pytest.raises(ValueError, match=match):
        problem, rest = problem_of(costs, **args)
        repack(problem, **rest)


# -- several stages per worker: only the stage counts the schedule can run -----------------------------

# V layouts of a 4-worker pipeline and the smaller ones (what pipeline.release.repack_layouts gives).
V_LAYOUTS = {
    8: [0, 1, 2, 3, 3, 2, 1, 0],
    6: [0, 1, 2, 2, 1, 0],
    4: [0, 1, 1, 0],
    2: [0, 0],
}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 5.0), min_size=8, max_size=12), st.floats(0.0, 3.0))
def test_repack_with_layouts_proposes_only_runnable_counts(times, slowdown):
    costs = [LayerCost(fwd_time_s=t, memory_bytes=1) for t in times]
    current = Placement.from_sizes([1] * 7 + [len(times) - 7])
    result = repack(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=None)),
        current,
        max_slowdown=slowdown,
        layouts=V_LAYOUTS,
    )
    assert result.num_stages in V_LAYOUTS
    assert_valid(result.placement, len(costs))
    if result.num_stages < 8:  # within the slowdown, judged by the heaviest worker
        assert result.bottleneck <= result.previous_bottleneck * (1 + slowdown) + 1e-9


def test_repack_with_layouts_balances_and_compares_workers():
    costs = [LayerCost(fwd_time_s=t) for t in (1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0)]
    current = Placement.from_string("0-1|2-3|4-5|6-7")  # V: worker 0 runs stages 0 and 3 (load 2)
    layouts = {4: [0, 1, 1, 0], 2: [0, 0]}
    result = repack(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=None)),
        current,
        max_slowdown=1.0,
        layouts=layouts,
    )
    assert (result.num_stages, result.previous_bottleneck, result.bottleneck) == (2, 2.0, 4.0)
    # Per stage the bottleneck would be 2 -> 4 as well, but an odd count is never proposed.
    assert (
        repack(
            BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=None)),
            current,
            max_slowdown=0.9,
            layouts=layouts,
        ).placement
        == current
    )


def test_repack_target_must_be_a_runnable_count():
    costs = [LayerCost(fwd_time_s=1.0) for _ in range(8)]
    current = Placement.from_string("0-1|2-3|4-5|6-7")
    with pytest.raises(
        ValueError, match=r"target_num_stages=3 is not a pipeline this schedule can run; .* are \[2\]"
    ):
        repack(
            BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=None)),
            current,
            target_num_stages=3,
            layouts={4: [0, 1, 1, 0], 2: [0, 0]},
        )
    packed = repack(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=None)),
        current,
        target_num_stages=2,
        layouts={4: [0, 1, 1, 0], 2: [0, 0]},
    )
    assert packed.num_stages == 2 and packed.released_stages == (2, 3)


@settings(max_examples=120, deadline=None)
@given(repack_problems(), st.floats(0.0, 1.0), st.data())
def test_repack_counts_slow_workers_links_and_extras_of_the_kept_stages(problem, slowdown, data):
    costs, current, caps = problem
    stages = current.num_stages
    factors = data.draw(st.lists(st.sampled_from([1.0, 0.5, 2.0, 3.0]), min_size=stages, max_size=stages))
    row = st.lists(st.floats(0.0, 5.0), min_size=len(costs), max_size=len(costs))
    links = data.draw(st.lists(row, min_size=stages - 1, max_size=stages - 1)) if stages > 1 else None
    first = data.draw(st.none() | st.builds(LayerCost, fwd_time_s=st.floats(0.0, 5.0)))
    last = data.draw(st.none() | st.builds(LayerCost, fwd_time_s=st.floats(0.0, 5.0)))
    result = repack(
        BalanceProblem(
            costs,
            hardware=Hardware(
                first_stage_extra=first,
                last_stage_extra=last,
                worker_slowdown=factors,
                comm_time_s=links,
                memory_capacity_bytes=caps,
            ),
        ),
        current,
        max_slowdown=slowdown,
    )
    full = _caps(caps, stages)

    def model(k):
        return {
            "first": first,
            "last": last,
            "comm": links[: k - 1] if k > 1 else None,
            "slowdown": factors[:k],
        }

    previous = max(direct_loads(costs, current, "time", **model(stages)))
    assert result.previous_bottleneck == pytest.approx(previous)
    limit = previous * (1 + slowdown)
    kept = result.num_stages
    assert result.bottleneck == pytest.approx(
        max(direct_loads(costs, result.placement, "time", **model(kept)))
    )
    assert_fits(costs, result.placement, full[:kept])
    if result.released_stages:
        assert result.bottleneck <= limit + 1e-9
        assert result.bottleneck == pytest.approx(brute_optimum(costs, kept, caps=full[:kept], **model(kept)))
    for k in range(1, kept if result.released_stages else stages):
        best = brute_optimum(costs, k, caps=full[:k], **model(k))
        assert best is None or best > limit - 1e-9 * max(1.0, limit)  # rounding: brute sums directly


def test_repack_gives_the_heavy_head_its_own_room():
    costs = [LayerCost(fwd_time_s=1.0)] * 6
    head = LayerCost(fwd_time_s=3.0)
    result = repack(
        BalanceProblem(costs, hardware=Hardware(last_stage_extra=head, memory_capacity_bytes=None)),
        "0-1|2-3|4-5",
        target_num_stages=2,
    )
    assert result.bottleneck == 5.0  # 4 | 2 + 3 or 5 | 1 + 3; the block-only optimum 3 | 3 + 3 costs 6
    assert result.placement.sizes[1] <= 2
    assert repack(
        BalanceProblem(costs, hardware=Hardware(memory_capacity_bytes=None)),
        "0-1|2-3|4-5",
        target_num_stages=2,
    ).placement.sizes == (3, 3)
