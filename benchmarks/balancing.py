"""Quality and speed of the balancers on random costs and on dynamism-shaped cost profiles.

Run from the repository root::

    python -m benchmarks.balancing            # full run, writes benchmarks/results/balancing-<date>.md
    python -m benchmarks.balancing --quick    # smoke run (small sizes, one repeat), prints only

Read in this order: :func:`dynamism_profile` (the cost shapes), :func:`deepspeed_partition_balanced`
(the comparison point), :func:`measure` (one balancer on one problem), :func:`main`.

Costs are emulated (no model runs): decision times are wall-clock medians on whatever machine runs this,
so compare them only within one run on a quiet machine.
"""

from __future__ import annotations

import itertools
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from benchmarks._lib import harness
from benchmarks._lib.common import results_path
from lightning_dynmo.balancing import (
    BalanceProblem,
    Hardware,
    LayerCost,
    Placement,
    by_parameters,
    diffuse,
    imbalance,
    partition_workers,
    uniform,
    worker_loads,
)
from lightning_dynmo.balancing.partition import solve_partition

CASES = ("random", "early_exit", "freezing", "pruning", "sparse_attention", "moe", "mod")
SIZES = ((8, 2), (48, 8), (48, 24), (128, 32), (1024, 64), (1024, 720))
QUICK_SIZES = ((8, 2), (48, 24))
QUICK_CASES = ("random", "early_exit")
DEEPSPEED_MAX_WORK = 70_000  # layers x stages above which the O(n^2 m) comparison is skipped


def dynamism_profile(case: str, num_layers: int, seed: int = 0) -> list[LayerCost]:
    """Per-layer costs shaped like one dynamism case (deterministic for a given seed).

    * ``random``: forward time uniform in [0, 1), backward twice the forward.
    * ``early_exit``: the tokens still in flight fall with depth, so a layer's time decays
      exponentially with depth (to 5% at the last layer).
    * ``freezing``: the first 40% of the layers are frozen and cost their forward only.
    * ``pruning``: uneven global magnitude pruning; each layer keeps a log-normal density (median
      20%), and time, parameters and memory scale with it.
    * ``sparse_attention``: hashed sparse attention; the attention share (40%) of each layer scales
      with a random density.
    * ``moe``: routing noise; each layer's time is log-normal around 1 (sigma 0.3).
    * ``mod``: mixture of depths; every other layer routes 12.5% of the tokens, plus noise.
    """
    if case not in CASES:
        raise ValueError(f"case={case!r} is not a profile; use one of {CASES}.")
    rng = random.Random(f"{case}-{num_layers}-{seed}")
    costs = []
    for i in range(num_layers):
        depth = i / max(num_layers - 1, 1)
        fwd, bwd_factor, density = 1.0, 2.0, 1.0
        if case == "random":
            fwd = rng.random()
        elif case == "early_exit":
            fwd = math.exp(math.log(0.05) * depth)
        elif case == "freezing":
            bwd_factor = 0.0 if depth < 0.4 else 2.0
        elif case == "pruning":
            density = min(1.0, max(0.02, rng.lognormvariate(math.log(0.2), 0.8)))
            fwd = density
        elif case == "sparse_attention":
            fwd = 0.6 + 0.4 * rng.uniform(0.05, 1.0)
        elif case == "moe":
            fwd = rng.lognormvariate(0.0, 0.3)
        elif case == "mod":
            fwd = (0.125 if i % 2 else 1.0) * rng.lognormvariate(0.0, 0.15)
        costs.append(
            LayerCost(
                fwd_time_s=fwd,
                bwd_time_s=bwd_factor * fwd,
                num_params=int(1_000_000 * density),
                memory_bytes=int(16_000_000 * density),
                activation_bytes=1_000_000,
            )
        )
    return costs


def deepspeed_partition_balanced(weights: Sequence[float], num_parts: int) -> Placement:
    """Our re-implementation of DeepSpeed's current ``partition_balanced``, from its description.

    A dynamic programme over (items, parts) that keeps, per state, one (max, min) pair of part sums
    and minimises ``max - min`` (ties go to the later split). It never returns empty parts for
    n > m, but it is not the min-max optimum (it balances the spread, not the heaviest part), and it
    costs O(n^2 m).
    """
    n = len(weights)
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    dp_max = np.full((n + 1, num_parts + 1), np.inf)
    dp_min = np.full((n + 1, num_parts + 1), -np.inf)
    choice = np.zeros((n + 1, num_parts + 1), dtype=np.int64)
    dp_max[1:, 1] = prefix[1:]
    dp_min[1:, 1] = prefix[1:]
    for parts in range(2, num_parts + 1):
        for i in range(parts, n + 1):
            k = np.arange(parts - 1, i)
            part = prefix[i] - prefix[k]
            hi = np.maximum(dp_max[k, parts - 1], part)
            lo = np.minimum(dp_min[k, parts - 1], part)
            cost = hi - lo
            best = len(cost) - 1 - int(np.argmin(cost[::-1]))  # ties: the later split
            dp_max[i, parts], dp_min[i, parts], choice[i, parts] = hi[best], lo[best], k[best]
    bounds = [n]
    for parts in range(num_parts, 1, -1):
        bounds.append(int(choice[bounds[-1], parts]))
    bounds.append(0)
    return Placement(tuple(reversed(bounds)))


def _median_time(fn: Callable[[], Placement], repeats: int) -> tuple[Placement, float]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    assert result is not None
    return result, statistics.median(times)


def balancers(costs: list[LayerCost], stages: int) -> dict[str, Callable[[], Placement]]:
    """The balancers compared, each as a zero-argument decision."""
    weights = [c.time_s for c in costs]
    start = uniform(len(costs), stages)
    comm = [c.activation_bytes / 50e9 * 1e3 for c in costs]  # 50 GB/s link, in the profile's time unit
    found: dict[str, Callable[[], Placement]] = {
        "uniform (Megatron)": lambda: uniform(len(costs), stages),
        "by_parameters (exact)": lambda: by_parameters(costs, stages),
        "partition by time": lambda: solve_partition(BalanceProblem(costs), stages).placement,
        "partition by time + comm (DP probe)": lambda: (
            solve_partition(BalanceProblem(costs, hardware=Hardware(comm_time_s=comm)), stages).placement
        ),
        "diffuse by time (from uniform)": lambda: diffuse(BalanceProblem(costs), start).placement,
    }
    if len(costs) * stages <= DEEPSPEED_MAX_WORK:
        found["DeepSpeed partition_balanced (ours)"] = lambda: deepspeed_partition_balanced(weights, stages)
    return found


def measure(case: str, layers: int, stages: int, repeats: int) -> list[tuple[str, float, float, float]]:
    """(balancer, bottleneck / optimum, imbalance, median decision seconds) for one problem."""
    costs = dynamism_profile(case, layers)
    optimum = solve_partition(BalanceProblem(costs), stages).bottleneck
    rows = []
    for name, decide in balancers(costs, stages).items():
        placement, seconds = _median_time(decide, repeats)
        loads = placement.stage_loads(costs, "time")
        ratio = max(loads) / optimum if optimum > 0 else 1.0
        rows.append((name, ratio, imbalance(loads), seconds))
    return rows


VIRTUAL_SIZES = ((8, 4), (48, 8), (48, 16), (128, 16), (128, 32))
LAYOUTS = {"loop": lambda w: list(range(w)) * 2, "V": lambda w: [*range(w), *reversed(range(w))]}


def _worker_search_vs_brute_force(problems: int) -> tuple[int, float]:
    """(problems where partition_workers is optimal, worst ratio to the optimum), by enumeration."""
    rng = random.Random(0)
    layouts = ([0, 1, 0, 1], [0, 1, 1, 0], [0, 1, 2, 0, 1, 2], [0, 1, 2, 2, 1, 0])
    optimal, worst = 0, 1.0
    for trial in range(problems):
        workers = layouts[trial % len(layouts)]
        n = rng.randint(len(workers), 10)
        costs = [LayerCost(fwd_time_s=rng.choice([rng.random(), 10 * rng.random()])) for _ in range(n)]
        best = min(
            max(worker_loads(BalanceProblem(costs), Placement((0, *cuts, n)), workers).values())
            for cuts in itertools.combinations(range(1, n), len(workers) - 1)
        )
        ratio = partition_workers(BalanceProblem(costs), workers).bottleneck / best
        optimal += ratio <= 1 + 1e-9
        worst = max(worst, ratio)
    return optimal, worst


def virtual_stage_section(cases: Sequence[str], sizes: Sequence[tuple[int, int]]) -> list[str]:
    """Two stages per worker: the heaviest worker under the per-stage optimum vs ``partition_workers``."""
    lines = [
        "",
        "## Two (virtual) stages per worker",
        "",
        "Interleaved / looped schedules (`loop`: stage s on worker s mod W) and V schedules (`V`: 0..W-1, "
        "then back). Ratio = heaviest worker / (total work / workers), a lower bound, so the ratio bounds "
        "the distance to the optimum from above. 'per-stage optimum' is `partition`'s placement judged "
        "by its workers; 'partition_workers' is the local search over the workers.",
        "",
        "| case | layers x stages | layout | per-stage optimum | partition_workers | decision time (ms) |",
        "|---|---|---|---|---|---|",
    ]
    optimal, worst = _worker_search_vs_brute_force(problems=200)
    lines[-4] += (
        f" Against brute force on 200 seeded random problems (4-10 layers, 4 or 6 stages on 2 or 3 "
        f"workers), partition_workers finds the optimum in {optimal} and is at worst {worst:.3f}x it."
    )
    for case in cases:
        for layers, stages in sizes:
            costs = dynamism_profile(case, layers)
            bound = sum(c.time_s for c in costs) / (stages // 2)
            for layout, make in LAYOUTS.items():
                workers = make(stages // 2)
                per_stage = max(
                    worker_loads(
                        BalanceProblem(costs),
                        solve_partition(BalanceProblem(costs), stages).placement,
                        workers,
                    ).values()
                )
                start = time.perf_counter()
                found = partition_workers(BalanceProblem(costs), workers)
                seconds = time.perf_counter() - start
                lines.append(
                    f"| {case} | {layers}x{stages} | {layout} | {per_stage / bound:.3f} "
                    f"| {found.bottleneck / bound:.3f} | {seconds * 1e3:.1f} |"
                )
    return lines


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark; print the report and write it unless ``--quick`` without ``--out``."""
    parser = harness.argument_parser(__doc__, "small sizes and one repeat")
    args = parser.parse_args(argv)
    out = None if args.quick and args.out is None else results_path("balancing", args.out, args.force)
    sizes, cases, repeats = (QUICK_SIZES, QUICK_CASES, 1) if args.quick else (SIZES, CASES, 5)
    lines = [
        harness.header("Balancing benchmark", "balancing", argv, [harness.EMULATED]),
        "",
        f"Python {platform.python_version()}, numpy {np.__version__}. Costs are emulated profiles (see "
        "`dynamism_profile`); time = median of {repeats} decisions (3 at 1,024 layers), wall clock, "
        "not a quiet machine unless stated. Ratio = heaviest stage / exact optimum (partition by "
        "time). Diffusion starts from the uniform placement.".replace("{repeats}", str(repeats)),
        "",
        "| case | layers x stages | balancer | bottleneck / optimum | imbalance | decision time (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        for layers, stages in sizes:
            reps = repeats if layers < 1024 else min(repeats, 3)
            for name, ratio, imb, seconds in measure(case, layers, stages, reps):
                lines.append(
                    f"| {case} | {layers}x{stages} | {name} | {ratio:.3f} | {imb:.3f} | {seconds * 1e3:.2f} |"
                )
    lines += virtual_stage_section(cases, (((8, 4), (48, 16)) if args.quick else VIRTUAL_SIZES))
    report = "\n".join(lines) + "\n"
    sys.stdout.write(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    return report


if __name__ == "__main__":
    main()
