"""The every-step cost average's weight and margin, judged on the MoE trace at the paper's setup (projected).

DynMo's every-step policy (:func:`benchmarks.paper_setup.dynmo_placements`: after each step the library's
own decision on each layer's moving average of the measured costs, in force from the next step) run on
the true costs of the MoE trace (48 layers, 32 micro-batches, ``ZBVZeroBubble``, the GPU cost curves of
``--kernels`` as :mod:`benchmarks.paper_replay` replays them), once per history weight
(``ProfilingConfig(cost_smoothing=...)``, bias-corrected as the callback averages, at the default
margin), once per margin (``ProfilingConfig(cost_margin=...)``: standard deviations of the averaged rows
added to each layer's average, at the default weight), and once as the callback decided before both
(the average started from its first window, weight 0.8, no margin). Each on four replays of
the trace: ``--steps`` steps with the 30 recorded rows spread over them (as ``paper_replay`` replays
MoE), or one recorded row a step (the first ``steps`` rows, as a run records them); the first
``--warmup`` steps untimed. **Projected** (the step model on the trace's costs; no job runs).

Each run is the step summed over the timed steps, over the best fixed placement's: the better of this
project's search (:func:`benchmarks.paper_setup.best_placement` minimising the timed steps' sum) and the
independent search (:mod:`benchmarks._lib.independent_search`, which shares no code with the policy).

    python -m benchmarks.cost_smoothing                 # 8 and 16 ranks: about 25 minutes on 2 cores
    python -m benchmarks.cost_smoothing --quick         # synthetic trace, 2 ranks: not figures
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks._lib import independent_search
from benchmarks._lib.common import command_line, results_path, write_report
from benchmarks._lib.gpu_curves import add_kernel_arguments, kernels_from_args
from benchmarks._lib.trace_cases import synthetic_trace, trace_parser
from benchmarks.paper_replay import paper_trace
from benchmarks.paper_setup import _rows, best_placement, dynmo_placements, paper_costs, step_s
from benchmarks.projection import Shape
from benchmarks.replay import select_traces
from lightning_dynmo.balancing import Placement, uniform
from lightning_dynmo.balancing.trace import CostTrace
from lightning_dynmo.callback.config import COST_MARGIN, EVERY_STEP_COST_SMOOTHING
from lightning_dynmo.pipeline.step.actions import schedule_actions

#: The average the callback kept before the bias correction (started from its first window, weight 0.8)
#: and the margin: none.
UNCORRECTED = ("0.8, not corrected, no margin", 0.8, False, 0.0)


def replays(trace: CostTrace, lengths: list[int]) -> list[tuple[str, list[int]]]:
    """Per replay, its name and the trace row of every step."""
    n, out = trace.num_rows, []
    for steps in lengths:
        out.append((f"{steps} steps, trace spread", [s * n // steps for s in range(steps)]))
        out.append((f"{steps} steps, a row a step", [min(s, n - 1) for s in range(steps)]))
    return out


def policies(weights: Sequence[float], margins: Sequence[float]) -> list[tuple[str, float, bool, float]]:
    """Each policy's column name, history weight, whether bias-corrected, and margin."""
    return (
        [(f"{w:g}", w, True, COST_MARGIN) for w in weights]
        + [(f"margin {m:g}", EVERY_STEP_COST_SMOOTHING, True, m) for m in margins]
        + [UNCORRECTED]
    )


def judge(
    trace: CostTrace,
    rows: list[int],
    warmup: int,
    shape: Shape,
    weights: list[float],
    budget: int,
    margins: Sequence[float] = (),
) -> dict[str, Any]:
    """Every policy's timed total over the best fixed placement's on one replay of ``trace``."""
    replayed = dataclasses.replace(trace, rows=tuple(trace.rows[r] for r in rows))
    timed = list(replayed.rows[warmup:])

    def total(placements: list[Placement]) -> float:
        return sum(step_s(row, p, shape) for row, p in zip(timed, placements[warmup:], strict=True))

    mean = dataclasses.replace(replayed, rows=tuple(timed)).mean_costs()
    ours = best_placement(mean, shape, budget, over=timed)
    actions = schedule_actions(shape.schedule, shape.stages, shape.microbatches)
    plain = _rows(dataclasses.replace(replayed, rows=tuple(timed)))
    theirs = Placement.from_sizes(independent_search.search(plain, shape.stages, actions, shape.microbatches))
    best = min(total([p] * len(rows)) for p in (ours, theirs))
    out = {"uniform": total([uniform(trace.num_layers, shape.stages)] * len(rows)) / best}
    out["head-aware"] = total([best_placement(replayed.rows[0], shape, budget)] * len(rows)) / best
    for name, w, corrected, margin in policies(weights, margins):
        placed = dynmo_placements(
            replayed, shape, phases=False, smoothing=w, bias_corrected=corrected, margin=margin
        )
        out[name] = total(placed) / best
    return out


def main(argv: list[str] | None = None) -> str:
    """Project every weight on every replay, print and write the report; return it."""
    parser = trace_parser(
        "python -m benchmarks.cost_smoothing", __doc__.split("\n")[0], "synthetic trace, 2 ranks"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--schedule", default="ZBVZeroBubble")
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--steps", type=int, nargs="+", default=[12, 20], help="replay lengths")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--weights", type=float, nargs="+", default=[0.3, 0.5, 0.65, 0.8])
    parser.add_argument("--margins", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--budget", type=int, default=512, help="step-model simulations per search")
    add_kernel_arguments(parser, "the costs")
    args = parser.parse_args(argv)
    kernels = kernels_from_args(parser, args)
    command = command_line("cost_smoothing", argv)
    out = results_path("cost_smoothing", args.out, args.force)
    if args.quick:
        stats = synthetic_trace(4, 3)
        args.ranks, args.layers, args.steps, args.warmup, args.microbatches, args.budget = (
            [2],
            8,
            [6],
            2,
            4,
            16,
        )
    else:
        (stats,) = select_traces(args.traces, ["moe"])
    costs = kernels if kernels is not None else paper_costs(args.quick)
    trace = paper_trace(stats, args.layers, costs, 1.0, split=True, clamp=args.clamp_curves)
    names = ["uniform", "head-aware", *(name for name, *_ in policies(args.weights, args.margins))]
    lines = [
        "# The every-step cost average's weight on the MoE trace (projected)",
        "",
        f"Command: `{command}`  ",
        "Device: the step model on the trace's costs (**projected**; no job runs).  ",
        f"Setup: {stats.case}, {args.layers} layers, {args.schedule}, {args.microbatches} micro-batches, the "
        f"first {args.warmup} steps of each replay untimed. Costs: {costs.label}.",
        "",
        "Each cell: the timed steps' summed step over the best fixed placement's (the better of this "
        "project's search and the independent one). Weights are `cost_smoothing`, bias-corrected as the "
        f"callback averages (the default is {EVERY_STEP_COST_SMOOTHING:g}), at the default margin "
        f"({COST_MARGIN:g}); `margin m` is `cost_margin` m at the default weight; `{UNCORRECTED[0]}` is "
        "the average the callback kept before, started from its first window, with no margin.",
        "",
    ]
    for ranks in args.ranks:
        shape = Shape(ranks, args.schedule, args.microbatches)
        lines += [f"## {shape}", "", "| replay | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        per: dict[str, list[float]] = {n: [] for n in names}
        for label, rows in replays(trace, args.steps):
            print(f"[{ranks} ranks] {label}", file=sys.stderr, flush=True)
            result = judge(trace, rows, args.warmup, shape, args.weights, args.budget, args.margins)
            for n in names:
                per[n].append(result[n])
            lines.append(f"| {label} | " + " | ".join(f"{result[n]:.3f}" for n in names) + " |")
        lines.append(
            "| **mean** | " + " | ".join(f"**{statistics.fmean(per[n]):.3f}**" for n in names) + " |"
        )
        lines.append("")
    report = "\n".join(lines)
    write_report(report, "cost_smoothing", out)
    return report


if __name__ == "__main__":
    main()
