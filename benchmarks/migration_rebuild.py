"""What a migration costs with its stages built from the recorded boundaries, and with torch's metadata pass.

After a migration the strategy builds the new stages from what crossed every layer boundary in the first
build's metadata pass (:mod:`lightning_dynmo.pipeline.step.boundaries`); without the record each new stage
runs torch's metadata pass before its first step (a micro-batch's forward and backward through the whole
pipeline, stage after stage). This runs the paper replay's DynMo job (:mod:`benchmarks.paper_replay`: a
case's trace at the paper's costs, 48 layers, torch's ZBV, 32 micro-batches, phases announced by events,
DynMo from uniform, each block sleeping its cost) both ways, ``--rounds`` interleaved rounds (the order
reversed every other round). Printed per round: each way's step (the mean of its timed steps) and their
ratio, and each way's migration steps (the step a move was applied at: migration, rebuild and the new
stages' first step) against its other timed steps. **Emulated cost.**

    python -m benchmarks.migration_rebuild                   # pruning, 8 ranks, 5 rounds: about 6 minutes
    python -m benchmarks.migration_rebuild --quick           # synthetic trace, 2 ranks, 1 round: not figures

The report goes to ``benchmarks/results/migration_rebuild-<date>.md``; an existing file is kept unless
``--force``.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks._lib.common import command_line, launch, results_path, write_report
from benchmarks._lib.trace_cases import synthetic_trace, trace_parser
from benchmarks.paper_replay import paper_trace, recipe
from benchmarks.paper_setup import paper_costs
from benchmarks.replay import (
    JOB_TIMEOUT_FACTOR,
    MIN_JOB_TIMEOUT_S,
    SEQ,
    ReplayJob,
    replay_model,
    run_replay,
    select_traces,
)
from lightning_dynmo.demos import measure_call_overhead
from lightning_dynmo.strategy import replacement

WAYS = ("recorded boundaries", "metadata pass")


@dataclass(frozen=True)
class Way:
    """One job run one way: ``recorded`` False makes every migration's stages run torch's metadata pass."""

    job: ReplayJob
    recorded: bool


def run_way(way: Way) -> dict[str, Any]:
    """Body of one rank (started by :func:`benchmarks._lib.common.launch`)."""
    if not way.recorded:
        replacement.recorded_stage_tensors = lambda *args: None  # type: ignore[assignment]  # this rank only
    return run_replay(way.job)


def migration_steps(run: dict[str, Any], warmup: int) -> tuple[list[float], list[float]]:
    """A run's timed steps split into those a move was applied at and the others."""
    moved = {s - warmup for s in run["moves"]}
    steps = run["step_s"]
    return [t for i, t in enumerate(steps) if i in moved], [t for i, t in enumerate(steps) if i not in moved]


def main(argv: list[str] | None = None) -> str:
    """Run both ways, print and write the report; return it."""
    parser = trace_parser(
        "python -m benchmarks.migration_rebuild", __doc__.split("\n")[0], "2 ranks, 1 round"
    )
    parser.add_argument("--case", default="pruning")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--schedule", default="ZBVZeroBubble")
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--phases", type=int, default=4)
    parser.add_argument("--hold", type=int, default=6)
    parser.add_argument("--block-ms", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    command = command_line("migration_rebuild", argv)
    out = results_path("migration_rebuild", args.out, args.force)
    if args.quick:
        stats = synthetic_trace(4, 3)
        args.ranks, args.rounds, args.layers, args.microbatches = 2, 1, 8, 4
        args.warmup, args.phases, args.hold = 2, 2, 2
    else:
        found = select_traces(args.traces, [args.case])
        if not found:
            raise SystemExit(f"no trace of the case {args.case} in {args.traces}")
        stats = found[0]
    how = recipe(args.case, args.phases, args.hold)
    trace = paper_trace(stats, args.layers, paper_costs(args.quick), args.block_ms, True, args.phases)
    torch.set_num_threads(1)  # before forking the ranks
    overhead = measure_call_overhead(replay_model(2, "linear", True), microbatch_size=1, seq_len=SEQ)
    job = ReplayJob(
        trace,
        args.ranks,
        args.warmup + args.phases * args.hold,
        args.warmup,
        "uniform",
        dynmo=how["dynmo"],
        overhead=overhead,
        compute="linear",
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        split_backward=True,
        hold=args.hold,
        announce=how.get("announce", "custom"),
    )
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    slowest_s = 0.0
    for r in range(args.rounds):
        for name in WAYS if r % 2 == 0 else WAYS[::-1]:
            print(f"  round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            way, started = Way(job, recorded=name == WAYS[0]), time.perf_counter()
            timeout = max(MIN_JOB_TIMEOUT_S, JOB_TIMEOUT_FACTOR * slowest_s)
            runs[name].append(
                launch(run_way, way, nproc=args.ranks, start_method="forkserver", timeout_s=timeout)
            )
            slowest_s = max(slowest_s, time.perf_counter() - started)
    lines = [
        "# A migration's stages: from the recorded boundaries, or by torch's metadata pass (emulated cost)",
        "",
        f"Command: `{command}`  ",
        f"Device: a shared 2-core x86_64 CPU VM (torch {torch.__version__}), gloo, one thread per rank; "
        "**emulated cost** (every block and part sleeps its recorded cost).",
        f"Setup: the paper replay's DynMo job ({args.case}, {args.layers} layers, {args.ranks} x "
        f"{args.schedule}, {args.microbatches} micro-batches, {args.phases} phases of {args.hold} steps "
        f"after {args.warmup} untimed, a dense block {args.block_ms} ms forward), {args.rounds} "
        "interleaved round(s).",
        "",
        "| round | step (ms): recorded boundaries | step (ms): metadata pass | metadata pass / recorded | "
        "moves (recorded, pass) | migration steps (ms), recorded | migration steps (ms), metadata pass |",
        "|---:|---:|---:|---:|---|---|---|",
    ]
    ratios, extra = [], {w: [] for w in WAYS}
    for r in range(args.rounds):
        means = {w: statistics.fmean(runs[w][r]["step_s"]) for w in WAYS}
        ratios.append(means[WAYS[1]] / means[WAYS[0]])
        shown = []
        for w in WAYS:
            moved, other = migration_steps(runs[w][r], args.warmup)
            extra[w] += [1e3 * (t - statistics.median(other)) for t in moved]
            shown.append(", ".join(f"{1e3 * t:.0f}" for t in moved) or "-")
        counts = ", ".join(str(len(runs[w][r]["moves"])) for w in WAYS)
        lines.append(
            f"| {r + 1} | {1e3 * means[WAYS[0]]:.1f} | {1e3 * means[WAYS[1]]:.1f} | {ratios[-1]:.3f} | "
            f"{counts} | {shown[0]} | {shown[1]} |"
        )
    lines += [
        "",
        "- Metadata pass / recorded boundaries, the runs' steps: median "
        f"**{statistics.median(ratios):.3f}x** (every round: {', '.join(f'{x:.3f}' for x in ratios)}).",
    ]
    for w in WAYS:
        if extra[w]:
            lines.append(
                f"- {w}: a migration step is {statistics.median(extra[w]):+.0f} ms over its run's median "
                f"other timed step (median of {len(extra[w])} moves; every one: "
                f"{', '.join(f'{x:+.0f}' for x in extra[w])})."
            )
        else:
            lines.append(f"- {w}: no move was applied in a timed step.")
    report = "\n".join(lines)
    write_report(report, "migration_rebuild", out)
    return report


if __name__ == "__main__":
    main()
