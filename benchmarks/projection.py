"""The projection: each case's recorded trace on 8-24 pipeline stages, simulated with the policy's step model.

Pure simulation, fast. Per case (the newest trace of each case in ``benchmarks/results/traces/``, a
synthetic one with ``--quick``) and per pipeline shape (ranks x schedule; Interleaved1F1B runs two stages
per rank), every step of the trace is simulated by
:func:`~lightning_dynmo.balancing.step_prediction.predict_step` under the schedule's own action lists
(:func:`lightning_dynmo.pipeline.schedule_order`, so interleaving is kept), with the embedding and the
head + loss costed (:mod:`benchmarks._lib.trace_cases`). The model keeps its real layer count (SmolLM2-135M:
30 layers; no runs of copies); shapes with more stages than layers are left out. Placements:

- **static uniform** (equal layer counts) and **static params** (equal parameters): fixed;
- **best fixed**: the exact min-max partition of the true costs averaged over the whole trace, refined
  by the step model (the min-max partition ties on the head's stage; the step breaks the tie), fixed;
- **DynMo**: at each row, the best placement (the exact partition, refined by the step model, as the
  policy does) for the mean costs of the ``--window`` rows before it; for cases whose rows are phases
  announced by an event (pruning stages, freezing), for that row's own costs, as DynMo rebalances on
  the event (migrations are not counted).

Every figure sums the simulated steps over all rows of the trace (costs averaged over many steps, not
one window). Tables, one row per case and shape: (a) the bubble (idle) ratio per iteration, static vs
DynMo, beside the paper's Figure 1; (b) the rebalancing gain (better static / DynMo), achieved / best
fixed and the bound of moving whole layers (heaviest static stage / heaviest single unit); (c) the
paper's comparison, over the model without the dynamism, split into the dynamism's own saving and the
rebalancing gain; (d) re-packing: the fewest ranks whose best placement keeps >= 95% of DynMo's
throughput, and throughput per rank before and after.

    python -m benchmarks.projection              # every trace: a minute or two
    python -m benchmarks.projection --quick      # synthetic trace, small shapes: not figures

The report goes to ``benchmarks/results/projection-<date>.md``; an existing file is kept unless ``--force``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks._lib.common import command_line, results_path, write_report
from benchmarks._lib.trace_cases import (
    CASES,
    cost_trace,
    dense_trace,
    load_traces,
    synthetic_trace,
    trace_parser,
)
from lightning_dynmo.balancing import Placement, by_parameters, partition, uniform
from lightning_dynmo.balancing.step_prediction import ScheduleOrder, predict_step, refine
from lightning_dynmo.balancing.trace import CostTrace, StepCosts
from lightning_dynmo.pipeline import schedule_order
from lightning_dynmo.pipeline.step.schedule import resolve_schedule

#: (ranks, schedule) of the full run.
SHAPES: tuple[tuple[int, str], ...] = ((8, "1F1B"), (16, "1F1B"), (24, "1F1B"), (8, "Interleaved1F1B"))
QUICK_SHAPES: tuple[tuple[int, str], ...] = ((2, "1F1B"), (2, "Interleaved1F1B"))
KEEP = 0.95  # re-packing keeps at least this share of the throughput
MODEL = "predict_step (balancing.step_prediction: the schedule's action lists, parts pinned)"


@dataclass(frozen=True)
class Shape:
    """A pipeline: ``ranks`` ranks under ``schedule``, ``microbatches`` per step."""

    ranks: int
    schedule: str
    microbatches: int

    @property
    def stages(self) -> int:
        return self.ranks * resolve_schedule(self.schedule).stages_per_rank

    @property
    def order(self) -> ScheduleOrder:
        return schedule_order(self.schedule)

    def with_ranks(self, ranks: int) -> Shape:
        """The same schedule on ``ranks`` ranks (interleaved: micro-batches rounded up to a multiple)."""
        m = self.microbatches
        if resolve_schedule(self.schedule).stages_per_rank > 1 and m % ranks:
            m = ranks * -(-m // ranks)  # torch's interleaved schedules run whole rounds of ranks
        return Shape(ranks, self.schedule, m)

    def __str__(self) -> str:
        return f"{self.ranks} x {self.schedule} ({self.stages} stages, {self.microbatches} mb)"


def step_s(costs: StepCosts, placement: Placement, shape: Shape) -> float:
    """One step of ``placement`` under ``shape``'s schedule with ``costs``."""
    return predict_step(costs.problem(), placement, shape.order, shape.microbatches).step_s


def best_placement(costs: StepCosts, shape: Shape, budget: int) -> Placement:
    """What DynMo's policy picks: the exact partition of ``costs``, refined by the step model."""
    problem = costs.problem()
    proposal = partition(problem, shape.stages)
    found = refine(problem, proposal, lambda p: step_s(costs, p, shape), budget=budget)
    return found.placement


@dataclass(frozen=True)
class Run:
    """One placement policy over the whole trace: per row, the placement in force and the step."""

    placements: tuple[Placement, ...]
    steps_s: tuple[float, ...]
    bubbles: tuple[float, ...]

    @property
    def total_s(self) -> float:
        return sum(self.steps_s)

    @property
    def bubble(self) -> float:
        """Mean idle share per iteration."""
        return statistics.fmean(self.bubbles)


def simulate(trace: CostTrace, placements: Sequence[Placement], shape: Shape) -> Run:
    """Each row of ``trace`` run at its placement."""
    steps, bubbles = [], []
    for row, placement in zip(trace.rows, placements, strict=True):
        prediction = predict_step(row.problem(), placement, shape.order, shape.microbatches)
        steps.append(prediction.step_s)
        bubbles.append(prediction.bubble_ratio)
    return Run(tuple(placements), tuple(steps), tuple(bubbles))


def dynmo_placements(
    trace: CostTrace, shape: Shape, window: int, budget: int, phases: bool = False
) -> list[Placement]:
    """DynMo's placement at each row: the best for the mean of the ``window`` rows before it.

    A placement is kept unless the new one is predicted faster. The first row's comes from the first
    row itself (DynMo's first window runs in the warm-up steps
    before the trace's first recorded step). With ``phases`` each row is a phase announced by an event,
    on which DynMo rebalances: every row runs at the best placement for its own costs.
    """
    placement, out = uniform(trace.num_layers, shape.stages), []
    for r in range(trace.num_rows):
        seen = trace.mean_costs(range(r, r + 1) if phases or r == 0 else range(max(0, r - window), r))
        candidate = best_placement(seen, shape, budget)
        # As the policy: a move is applied only when the step model predicts it faster.
        if step_s(seen, candidate, shape) < step_s(seen, placement, shape):
            placement = candidate
        out.append(placement)
    return out


@dataclass(frozen=True)
class Projection:
    """One case on one shape: every policy's run, the bound, re-packing, and the dense model's static."""

    shape: Shape
    runs: dict[str, Run]
    bound: float
    repack: tuple[int, float]  # (ranks kept, throughput kept)
    dense_static_s: float | None

    @property
    def static(self) -> str:
        return min(("static uniform", "static params"), key=lambda k: self.runs[k].total_s)

    def gain(self, over: str) -> float:
        return self.runs[over].total_s / self.runs["DynMo"].total_s


def project(
    trace: CostTrace,
    shape: Shape,
    window: int,
    budget: int,
    dense: CostTrace | None = None,
    phases: bool = False,
) -> Projection:
    """Every policy on ``shape`` over the whole ``trace`` (``dense``: the model without the dynamism).

    ``phases``: the rows are phases DynMo rebalances on (see :func:`dynmo_placements`).
    """
    rows, layers, stages = trace.num_rows, trace.num_layers, shape.stages
    mean = trace.mean_costs()
    fixed = {
        "static uniform": uniform(layers, stages),
        "static params": by_parameters(list(mean.layers), stages),
        "best fixed": best_placement(mean, shape, budget),
    }
    runs = {name: simulate(trace, [p] * rows, shape) for name, p in fixed.items()}
    runs["DynMo"] = simulate(trace, dynmo_placements(trace, shape, window, budget, phases), shape)
    static = min(("static uniform", "static params"), key=lambda k: runs[k].total_s)
    loads = predict_step(mean.problem(), fixed[static], shape.order, shape.microbatches).stage_loads
    units = [c.time_s for c in (*mean.layers, mean.first, mean.last)]
    dense_s = None
    if dense is not None:  # its static run's mean step, over as many steps as the trace
        dense_run = simulate(dense, [fixed["static uniform"]] * dense.num_rows, shape)
        dense_s = dense_run.total_s / dense.num_rows * rows
    return Projection(
        shape,
        runs,
        bound=max(loads) / max(units),
        repack=repack(mean, shape, budget),
        dense_static_s=dense_s,
    )


def repack(mean: StepCosts, shape: Shape, budget: int) -> tuple[int, float]:
    """The fewest ranks whose best placement keeps >= :data:`KEEP` of the full pipeline's throughput."""
    full = step_s(mean, best_placement(mean, shape, budget), shape)
    kept, share = shape.ranks, 1.0
    for ranks in range(shape.ranks - 1, 0, -1):
        smaller = shape.with_ranks(ranks)
        if smaller.stages > len(mean.layers) or (smaller.stages == 1 and shape.schedule != "1F1B"):
            continue
        ratio = full / step_s(mean, best_placement(mean, smaller, budget), smaller)
        if ratio < KEEP:
            break
        kept, share = ranks, ratio
    return kept, share


# -- report -----------------------------------------------------------------------------------------


def tables(results: Sequence[tuple[str, CostTrace, Projection]]) -> list[str]:
    """The tables (a)-(d), one row per case and shape."""
    a = [
        "**(a) Bubble (idle) ratio per iteration**, mean over the trace's steps:",
        "",
        "| case | shape | better static | DynMo | best fixed | paper, Figure 1 (static -> DynMo) |",
        "|---|---|---:|---:|---:|---|",
    ]
    b = [
        "**(b) Rebalancing gain** (same dynamism; steps summed over the trace):",
        "",
        "| case | shape | better static / DynMo | DynMo of best fixed | bound (moving whole layers) |",
        "|---|---|---:|---:|---:|",
    ]
    c = [
        "**(c) The paper's comparison**, over the model without the dynamism (static uniform):",
        "",
        "| case | shape | no dynamism static / DynMo | dynamism's own saving | rebalancing gain | paper |",
        "|---|---|---:|---:|---:|---|",
    ]
    d = [
        f"**(d) Re-packing**: the fewest ranks keeping >= {KEEP:.0%} of the throughput of all ranks (best "
        "placements of the mean costs):",
        "",
        "| case | shape | ranks kept (released) | throughput kept | per-rank throughput, before -> after |",
        "|---|---|---:|---:|---|",
    ]
    for name, _, p in results:
        case, runs, shape = CASES[name], p.runs, p.shape
        a.append(
            f"| {name} | {shape} | {runs[p.static].bubble:.0%} | {runs['DynMo'].bubble:.0%} | "
            f"{runs['best fixed'].bubble:.0%} | {case.paper_bubble} |"
        )
        achieved = runs["best fixed"].total_s / runs["DynMo"].total_s
        b.append(f"| {name} | {shape} | {p.gain(p.static):.2f}x | {achieved:.0%} | {p.bound:.2f}x |")
        if p.dense_static_s is not None:
            own = p.dense_static_s / runs[p.static].total_s
            total = p.dense_static_s / runs["DynMo"].total_s
            gain = p.gain(p.static)
            c.append(f"| {name} | {shape} | {total:.2f}x | {own:.2f}x | {gain:.2f}x | {case.paper_speedup} |")
        else:
            c.append(f"| {name} | {shape} | - | - | {p.gain(p.static):.2f}x | {case.paper_speedup} |")
        kept, share = p.repack
        before = 1.0 / shape.ranks
        after = share / kept
        d.append(
            f"| {name} | {shape} | {kept} ({shape.ranks - kept}) | {share:.0%} | "
            f"1.00 -> {after / before:.2f} (relative) |"
        )
    return [*a, "", *b, "", *c, "", *d, ""]


def describe(name: str, trace: CostTrace, source: str) -> list[str]:
    """Where a case's costs come from."""
    shape = f"{trace.num_layers} layers, {trace.num_rows} steps"
    return [f"- **{name}**: {shape}; cost curve: {trace.curve_label}; {source}"]


def main(argv: list[str] | None = None) -> str:
    """Project every trace, print and write the report; return it."""
    parser = trace_parser(
        "python -m benchmarks.projection", __doc__.split("\n")[0], "a synthetic trace, 2 ranks"
    )
    parser.add_argument("--window", type=int, default=1, help="trace rows per DynMo decision")
    parser.add_argument("--microbatches-per-rank", type=int, default=2)
    parser.add_argument("--budget", type=int, default=24, help="step-model simulations per refinement")
    args = parser.parse_args(argv)
    out = results_path("projection", args.out, args.force)
    if args.quick:
        stats, shapes = [synthetic_trace(6, 4)], QUICK_SHAPES
    else:
        stats, shapes = load_traces(args.traces), SHAPES
        if stats:
            stats.append(dense_trace(stats[0].num_layers))
    results, sources = [], []
    for s in stats:
        trace = cost_trace(s)
        dense = cost_trace(s, dense=True) if CASES[s.case].dense_statistic is not None else None
        sources += describe(s.case, trace, s.source or "-")
        for ranks, schedule in shapes:
            shape = Shape(ranks, schedule, args.microbatches_per_rank * ranks)
            if shape.stages > trace.num_layers:
                continue
            print(f"[{s.case}] {shape} ...", file=sys.stderr, flush=True)
            projection = project(trace, shape, args.window, args.budget, dense, CASES[s.case].phases)
            results.append((s.case, trace, projection))
    command = command_line("projection", argv)
    lines = [
        "# Projection: recorded traces on 8-24 stages (simulated)",
        "",
        f"Command: `{command}`  ",
        f"Step model: {MODEL}. **Projected**: simulated steps, migrations not counted; costs in units of "
        "a dense block's forward; the head + loss and the embedding costed from the model's shape.",
        "",
        "Traces and cost curves:",
        "",
        *(sources or ["- none found: nothing to project"]),
        "",
        *tables(results),
    ]
    report = "\n".join(lines)
    write_report(report, "projection", out)
    return report


if __name__ == "__main__":
    main()
