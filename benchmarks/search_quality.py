"""DynMo's placement search against the head-aware split, both judged on the same costs.

The replay (:mod:`benchmarks.paper_replay`) compares DynMo with a head-aware static split partitioned on
the trace's first row. Part of the difference is not the dynamism nor the profile but the search: its
local optimum depends on where it starts. This script isolates that part. For every row of a case's
trace at the paper's setup (mapped onto ``--layers`` layers, the paper's costs scaled so a dense block
takes ``--block-ms`` forward, the replay's split backward), it takes:

- **DynMo**: the library's decision from the uniform split on that row's *true* costs
  (:func:`~lightning_dynmo.balancing.policy.decide`, as the callback runs it on a profile, with no
  profile error);
- **head-aware static**: the replay's split (:func:`benchmarks.paper_setup.best_placement` on row 0,
  ``--budget`` simulations), fixed;

and predicts both on the row's own costs with the step model. A ratio (split / DynMo) below 1 on a
row means the split, partitioned on another row's costs, is predicted faster on this row than what the
search found for this very row: the search stopped at a worse local optimum. **Projected** (the step
model, no job); the decision's CPU seconds are measured in this process.

    python -m benchmarks.search_quality --ranks 16 --case moe      # one case at 32 ZBV stages: seconds
    python -m benchmarks.search_quality --quick                    # synthetic trace: not figures

The report goes to ``benchmarks/results/search_quality-<date>.md``; an existing file is kept unless
``--force``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks._lib import harness
from benchmarks._lib.common import results_path, write_report
from benchmarks._lib.trace_cases import CASES, synthetic_trace, trace_parser
from benchmarks.paper_replay import paper_trace
from benchmarks.paper_setup import best_placement, paper_costs, stage_workers
from benchmarks.projection import Shape
from benchmarks.replay import select_traces
from lightning_dynmo.balancing import uniform
from lightning_dynmo.balancing.policy import BalanceConfig, decide
from lightning_dynmo.balancing.step_prediction import predict_step
from lightning_dynmo.balancing.trace import CostTrace


@dataclass(frozen=True)
class Row:
    """One row of a trace: the split's predicted step over DynMo's decision's, on the row's costs."""

    row: int
    ratio: float
    cpu_s: float  # the decision's CPU seconds
    search: str  # how the decision's search ran (exact or local, placements scored)


def compare(trace: CostTrace, shape: Shape, budget: int) -> list[Row]:
    """Per row of ``trace``: the split's predicted step over DynMo's decision's, both on the row's costs,
    and what the decision cost."""
    split = best_placement(trace.rows[0], shape, budget)
    workers = stage_workers(shape) if shape.stages > shape.ranks else None
    start = uniform(trace.num_layers, shape.stages)
    rows = []
    for i, costs in enumerate(trace.rows):
        problem = costs.problem()
        began = time.process_time()
        made = decide(problem, start, BalanceConfig(), shape.microbatches, shape.order, workers)
        cpu_s = time.process_time() - began
        split_s, dynmo_s = (
            predict_step(problem, p, shape.order, shape.microbatches).step_s for p in (split, made.proposed)
        )
        search = made.reason.split("refined by ")[-1].split(";")[0]
        rows.append(Row(i, split_s / dynmo_s, cpu_s, search))
    return rows


def section(name: str, shape: Shape, rows: list[Row]) -> list[str]:
    """One case on one pipeline: every row, then the median, the extremes and the rows the split wins."""
    ratios = [r.ratio for r in rows]
    return [
        f"### {name}, {shape}",
        "",
        "| row | head-aware static / DynMo, on the row's costs | decision CPU (s) | search |",
        "|---:|---:|---:|---|",
        *(f"| {r.row} | {r.ratio:.4f} | {r.cpu_s:.3f} | {r.search} |" for r in rows),
        "",
        f"Median {statistics.median(ratios):.4f}, min {min(ratios):.4f}, max {max(ratios):.4f}; rows where "
        f"the split is predicted faster than DynMo's own decision: {sum(x < 1 - 1e-9 for x in ratios)} of "
        f"{len(ratios)}. Decision CPU: median {statistics.median(r.cpu_s for r in rows):.3f} s.",
        "",
    ]


def main(argv: list[str] | None = None) -> str:
    """Compare the search with the split for every case and pipeline size; print and write the report."""
    parser = trace_parser("python -m benchmarks.search_quality", __doc__.split("\n")[0], "synthetic trace")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--schedule", default="ZBVZeroBubble", help="torch's pipeline schedule")
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--layers", type=int, default=48, help="the model's depth (traces mapped onto it)")
    parser.add_argument("--budget", type=int, default=512, help="the split's step-model simulations")
    parser.add_argument(
        "--block-ms", type=float, default=7.353, help="a dense block's forward per micro-batch"
    )
    parser.add_argument("--case", nargs="+", default=None, help="only these cases (default: all)")
    args = parser.parse_args(argv)
    command = harness.command("search_quality", argv)
    out = results_path("search_quality", args.out, args.force)
    if args.quick:
        stats = [synthetic_trace(4, 3)]
        args.ranks, args.layers, args.microbatches, args.budget = [2], 8, 4, 16
    else:
        stats = select_traces(args.traces, args.case)
        if not stats:
            raise SystemExit(f"no trace of the cases {args.case} in {args.traces}")
    costs = paper_costs(args.quick)
    lines = [
        "# DynMo's placement search against the head-aware split, on the same costs (projected)",
        "",
        f"Command: `{command}`  ",
        f"Device: a shared 2-core x86_64 CPU VM (torch {torch.__version__}), one process; **projected**: "
        "the step model on the trace's true costs, no job; the decisions' CPU is measured.",
        f"Setup: {args.schedule}, {args.microbatches} micro-batches, {args.layers} layers, every row of the "
        f"trace; a dense block {args.block_ms} ms forward; costs {costs.label}. DynMo: `decide` from the "
        f"uniform split on each row's costs; the split: row 0's, refined with {args.budget} simulations.",
        "",
    ]
    for s in stats:
        trace = paper_trace(s, args.layers, costs, args.block_ms, split=True)
        for ranks in args.ranks:
            shape = Shape(ranks, args.schedule, args.microbatches)
            if shape.stages > args.layers:
                continue
            part = section(
                CASES[s.case].name if s.case in CASES else s.case, shape, compare(trace, shape, args.budget)
            )
            print("\n".join(part), flush=True)
            lines += part
    report = "\n".join(lines)
    write_report(report, "search_quality", out)
    return report


if __name__ == "__main__":
    main()
