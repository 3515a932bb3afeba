"""The traces replayed at the paper's setup: 32 micro-batches, torch's ZBV schedule, the paper's costs.

The replay (:mod:`benchmarks.replay`: each block of a :class:`~lightning_dynmo.demos.DemoGPT` sleeps
what its trace costs at every step, in real gloo pipelines) with the projection's costs
(:mod:`benchmarks.paper_setup`): each case's trace mapped by depth fraction onto ``--layers`` layers
(every recorded step), costed at the paper's shape (a GPU dense block scaled to seq 2048, the GPT-2
head + loss measured with its loss, the embedding a lookup), then scaled so a dense block sleeps
``--block-ms`` per micro-batch forward. Under a split-backward schedule the blocks sleep half their
backward in the weight pass (``split_backward``, the step model's own share); the embedding and the head
+ loss sleep their whole backward in the input pass, and their true costs say so. **Emulated cost.**

Per case (and the dense model) and pipeline size (``--ranks``), the jobs. MoE and MoD, whose rows are
steps of one run: ``--steps`` steps, the first ``--warmup`` untimed, the trace spread over them. The other
cases, whose costs move in phases (a pruning stage, a freezing decision, a sparsity or exit level):
``--phases`` rows of the trace, evenly spaced, each held ``--hold`` timed steps after ``--warmup``
untimed steps on the first (:func:`recipe`):

- **uniform** (Megatron) and **params** (DeepSpeed: exact min-max of parameters, pruning's non-zeros);
- **head-aware static**: partitioned once from the true costs of the run's first step (step 0), refined by
  the step model (:func:`benchmarks.paper_setup.best_placement`, per worker under ZBV), then fixed;
- **search's best fixed**: the same search minimising the step summed over every timed step's true
  costs (a candidate, computed);
- **DynMo**: ``DynMoCallback`` live, from uniform, as each case's recipe runs it: every-step windows
  for MoE and MoD; otherwise a rebalance at each dynamism event (the replay announces every new row, the
  first included, as the case's callback would), profiling one step;
- **DynMo, background search**: the same with ``ProfilingConfig(background_decisions=True)`` (the
  search runs in a helper process on the deciding rank while every rank trains on);
- **head-aware static + callback** (a control, not a candidate): the head-aware split with
  ``DynMoCallback(balancer="static")`` attached, which times the stages, exchanges its row among the ranks
  and takes the replay's events every step as DynMo does, and never moves. Head-aware static over it is
  the callback's own per-step cost; it over DynMo is what DynMo's placements and events cost or saved
  against a split that carries the same per-step work.

A job's step is the mean of its timed steps (its run time: DynMo's profiled and migrating steps count).
Beside it, DynMo *between its events* (:func:`between_events`: its timed steps less those that closed
a window with a decision or applied one, against the same steps of the head-aware split): what its
placements ran at, the events' own cost left out; with the background search its helper's work falls in
steps counted there. The **best fixed placement in hindsight is measured**: per round, the fixed job with
the lowest median step over the *other* rounds (:func:`benchmarks._lib.paired.held_out_best`).
``--rounds`` interleaved rounds (the job order reversed every other round); every ratio is taken within a
round, each round's printed. DynMo is *slower than a split beyond the spread of its rounds* when it is
slower in every round (at least four). Idle per step: *simulated* (the step model on the true costs of
each timed step, the placement the job ended at) and *measured*, ``(ranks x step - work) / (ranks x
step)``.

    python -m benchmarks.paper_replay                 # 6 cases + dense, 8 and 16 ranks, ZBV, 5 rounds: hours
    python -m benchmarks.paper_replay --quick         # synthetic trace, 2 ranks, 1 round: not figures

With ``--kernels PATH`` (a ``kernels.json`` of ``python -m lightning_dynmo.gpu_check.kernels``) the costs
come from that GPU check's cost curves instead (:func:`benchmarks.paper_setup.gpu_trace`; ``--clamp-curves``
and ``--padded-vocab-head`` as in :mod:`benchmarks.paper_setup`), scaled the same way to ``--block-ms``.

The report goes to ``benchmarks/results/paper_replay-<date>.md``; an existing file is kept unless
``--force``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from benchmarks._lib import paired
from benchmarks._lib.common import command_line, launch, results_path, write_report
from benchmarks._lib.gpu_curves import FWD_SHARE, KernelCosts, add_kernel_arguments, kernels_from_args
from benchmarks._lib.trace_cases import CASES, synthetic_trace, trace_parser
from benchmarks.paper_setup import Costs, best_placement, cost_trace, gpu_trace, mapped, paper_costs
from benchmarks.projection import Shape
from benchmarks.replay import (
    DYNMO,
    JOB_TIMEOUT_FACTOR,
    MIN_JOB_TIMEOUT_S,
    SEQ,
    ReplayJob,
    idle_shares,
    replay_model,
    run_replay,
    select_traces,
)
from lightning_dynmo.balancing import Placement, by_parameters, uniform
from lightning_dynmo.balancing.step_prediction import predict_step
from lightning_dynmo.balancing.trace import CostTrace, StatisticTrace, StepCosts
from lightning_dynmo.callback import ProfilingConfig
from lightning_dynmo.demos import measure_call_overhead
from lightning_dynmo.demos.cost import SLEEPS
from lightning_dynmo.pipeline.step.actions import schedule_actions

#: The split of a block's backward into its weight pass (the step model's default share).
WEIGHT_SHARE = 0.5
#: A part's weight pass, as a share of its backward: the emulated parts sleep it all in the input pass.
PART_WEIGHT_SHARE = 1e-9
FIXED = ("uniform", "params", "head-aware static", "search's best fixed")
BACKGROUND = "DynMo, background search"
VARIANTS = ("DynMo", BACKGROUND)
#: The control: the head-aware split with a callback that measures every step and never moves.
CONTROL = "head-aware static + callback"
MEASURE_ONLY = {"balancer": "static"}


def split_backward(trace: CostTrace) -> CostTrace:
    """``trace`` with every record's weight-gradient part stated: :data:`WEIGHT_SHARE` of a block's
    backward, (almost) none of a part's, as the emulated pipeline sleeps them."""

    def split(c: Any, share: float) -> Any:
        return dataclasses.replace(c, bwd_weight_time_s=share * c.bwd_time_s)

    rows = tuple(
        StepCosts(
            tuple(split(c, WEIGHT_SHARE) for c in r.layers),
            split(r.first, PART_WEIGHT_SHARE),
            split(r.last, PART_WEIGHT_SHARE),
        )
        for r in trace.rows
    )
    return dataclasses.replace(trace, rows=rows)


def paper_trace(
    stats: StatisticTrace,
    layers: int,
    costs: Costs | KernelCosts,
    block_ms: float,
    split: bool,
    rows: int | None = None,
    clamp: bool = False,
) -> CostTrace:
    """``stats`` on ``layers`` layers at every recorded step (or ``rows`` of them, evenly spaced), at the
    paper's costs (scaled GPU costs, or a GPU kernel check's curves; ``clamp``: clamp statistics outside
    a curve), scaled so a dense block sleeps ``block_ms`` per micro-batch forward (``split``: weight parts
    stated)."""
    kept = mapped(stats, layers, stats.num_rows if rows is None else rows)
    if isinstance(costs, KernelCosts):
        dense_fwd_s = FWD_SHARE * costs.dense_ms * 1e-3
        trace = gpu_trace(kept, costs, clamp=clamp).scaled(block_ms / 1e3 / dense_fwd_s)
    else:
        trace = cost_trace(kept, costs).scaled(block_ms / 1e3 / costs.block[0])
    return split_backward(trace) if split else trace


def recipe(case: str, phases: int, hold: int) -> dict[str, Any]:
    """How DynMo runs ``case`` in the replay, and how its trace is replayed (:class:`ReplayJob` fields).

    MoE and MoD (``TraceCase.every_step``): the rows are steps of one run, spread over the run, and DynMo
    decides at every step (:data:`benchmarks.replay.DYNMO`). The other cases: ``phases`` rows, each held
    ``hold`` steps, announced by a dynamism event as their callbacks announce a change (the first row
    too: DynMo's first decision, from uniform); DynMo rebalances on events, profiling one step.
    """
    known = CASES.get(case)
    if known is not None and known.every_step:
        return {"dynmo": DYNMO}
    kind = {"pruning": "pruned", "freezing": "frozen"}.get(case, "custom")
    profile_once = ProfilingConfig(warmup_steps=0, steps=1)
    return {
        "dynmo": {"balancer": "partition", "cost": "time", "profiling": profile_once},
        "announce": kind,
        "hold": hold,
        "phases": phases,
    }


def fixed_placements(job: ReplayJob, shape: Shape, budget: int) -> dict[str, str]:
    """The fixed placements of one case on one pipeline (on the costs the pipeline really runs)."""
    true, rows = job.true_trace(), job.replayed_rows()
    layers, stages = true.num_layers, shape.stages
    timed = [true.rows[r] for r in rows]
    mean = dataclasses.replace(true, rows=tuple(timed)).mean_costs()
    return {
        "uniform": str(uniform(layers, stages)),
        "params": str(by_parameters(list(mean.layers), stages)),
        # Partitioned once from the costs of the run's first step (step 0), as a careful user would.
        "head-aware static": str(best_placement(true.rows[job.trace_replay().row(0)], shape, budget)),
        "search's best fixed": str(best_placement(mean, shape, budget, over=timed)),
    }


def dynmo_variants(dynmo: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The DynMo jobs of a case: the callback as the recipe runs it, and the same with its decision's
    search in a helper process while the ranks train (``ProfilingConfig(background_decisions=True)``)."""
    profiling = dynmo.get("profiling", ProfilingConfig())
    background = dataclasses.replace(profiling, background_decisions=True)
    return {"DynMo": dynmo, BACKGROUND: {**dynmo, "profiling": background}}


def replay_case(
    base: ReplayJob,
    shape: Shape,
    rounds: int,
    budget: int,
    dynmo: dict[str, Any] = DYNMO,
    announce: str | None = None,
) -> dict[str, Any]:
    """Every fixed placement and both DynMo variants (``dynmo``: the recipe's keywords; ``announce``: the
    replay's events), ``rounds`` interleaved rounds."""
    fixed = fixed_placements(base, shape, budget)
    jobs = {p: replace(base, placement=p) for p in dict.fromkeys(fixed.values())}
    for name, keywords in dynmo_variants(dynmo).items():
        jobs[name] = replace(base, placement=fixed["uniform"], dynmo=keywords, announce=announce)
    head_split = fixed["head-aware static"]
    jobs[CONTROL] = replace(base, placement=head_split, dynmo=MEASURE_ONLY, announce=announce)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    slowest_s = 0.0
    for r in range(rounds):
        for name in list(jobs) if r % 2 == 0 else list(jobs)[::-1]:
            print(
                f"  [{base.trace.case}] {shape}, round {r + 1}/{rounds}: {name}", file=sys.stderr, flush=True
            )
            started = time.perf_counter()
            runs[name].append(
                launch(
                    run_replay,
                    jobs[name],
                    nproc=shape.ranks,
                    start_method="forkserver",
                    timeout_s=max(MIN_JOB_TIMEOUT_S, JOB_TIMEOUT_FACTOR * slowest_s),
                )
            )
            slowest_s = max(slowest_s, time.perf_counter() - started)
    # The mean of the timed steps: a run's time, DynMo's profiled and migrating steps included.
    # Fixed runs that share a placement share a job.
    job_of = {**fixed, **{name: name for name in (*VARIANTS, CONTROL)}}
    per_round = {name: [statistics.fmean(run["step_s"]) for run in runs[job]] for name, job in job_of.items()}
    dynmo_rounds = {name: per_round[name] for name in VARIANTS}
    candidates = {name: per_round[name] for name in FIXED}
    statics = {k: per_round[k] for k in ("uniform", "params")}
    versus_static = paired.compare(statics, dynmo_rounds, candidates, gap=0.05)
    head = {"head-aware static": per_round["head-aware static"]}
    versus_head = paired.compare(head, dynmo_rounds, candidates, 0.05)
    control = per_round[CONTROL]
    callback_cost = tuple(h / c for h, c in zip(per_round["head-aware static"], control, strict=True))
    rows = {}
    for name in (*FIXED, CONTROL, *VARIANTS):
        last = runs[job_of[name]][-1]
        step = statistics.median(per_round[name])
        rows[name] = {
            "ms": 1e3 * step,
            "placement": last["placement"],
            "idle": idle_shares(base, last["placement"], step),
            "rounds": per_round[name],
        }
    for name in VARIANTS:
        rows[name]["rebalances"] = [run["rebalances"] for run in runs[name]]
        rows[name]["windows"] = [run["windows"] for run in runs[name]]
        head = runs[job_of["head-aware static"]]
        rows[name]["between"] = [
            between_events(run, h, base.warmup) for run, h in zip(runs[name], head, strict=True)
        ]
        rows[name]["simulated"] = [
            under_replayed_costs(base, shape, run, fixed["head-aware static"], fixed["uniform"])
            for run in runs[name]
        ]
        rows[name]["profile"] = [run["profile"] for run in runs[name] if run["profile"] is not None]
        rows[name]["versus control"] = tuple(c / d for c, d in zip(control, per_round[name], strict=True))
    overshoot = statistics.median(statistics.fmean(run["overshoot"]) for job in runs.values() for run in job)
    cores = statistics.median(run["cores"] for job in runs.values() for run in job)
    return {
        "rows": rows,
        "static": versus_static,
        "head": versus_head,
        "callback cost": callback_cost,
        "shape": shape,
        "steps": base.steps,
        "overshoot": overshoot,
        "cores": cores,
    }


def between_events(run: dict[str, Any], other: dict[str, Any], warmup: int) -> float:
    """``other``'s mean step over ``run``'s timed steps outside its events, over ``run``'s: the steps that
    took no decision (a decision recorded at step ``s`` closed its window at the end of ``s - 1``) and
    applied none (``s``: a move's migration), the same steps of both jobs (phases differ in cost); over
    every timed step when each one is an event's."""
    events = {t for s in run["decided"] for t in (s - 1, s)}
    kept = [i for i in range(len(run["step_s"])) if warmup + i not in events] or range(len(run["step_s"]))
    return statistics.fmean(other["step_s"][i] for i in kept) / statistics.fmean(
        run["step_s"][i] for i in kept
    )


def under_replayed_costs(
    base: ReplayJob, shape: Shape, run: dict[str, Any], static: str, start: str
) -> float:
    """``static``'s simulated step over the placements ``run`` ran, on the costs the pipeline replayed.

    The step model (no job) on each timed step's replayed row (:meth:`ReplayJob.true_trace`), each step on
    the placement DynMo ran then (``start`` until its first move; a move recorded at step ``s`` migrated at
    the start of ``s``), the means over the timed steps divided: DynMo's choices as the costs it was given
    rank them, apart from how the emulation ran them.
    """
    true, replay, order = base.true_trace(), base.trace_replay(), shape.order
    predicted: dict[tuple[int, str], float] = {}

    def step_s(row: int, placement: str) -> float:
        if (row, placement) not in predicted:
            problem = true.rows[row].problem()
            p = Placement.from_string(placement)
            predicted[row, placement] = predict_step(problem, p, order, base.microbatches).step_s
        return predicted[row, placement]

    ran, theirs, ours = start, [], []
    moves = dict(run["placements"])
    for step in range(base.steps):
        ran = moves.get(step, ran)  # moves in the untimed first steps count too
        if step >= base.warmup:
            row = replay.row(step)
            theirs.append(step_s(row, static))
            ours.append(step_s(row, ran))
    return statistics.fmean(theirs) / statistics.fmean(ours)


def _profile_note(profiles: list[dict[str, float]]) -> str:
    """DynMo's last profile over the replayed costs (:func:`benchmarks.replay.profile_against_replayed`),
    medians over the rounds that have one."""
    if not profiles:
        return ""
    fwd, bwd, last = (statistics.median(p[k] for p in profiles) for k in ("fwd", "bwd", "last"))
    return (
        f" Its last profile over the costs replayed then (medians over blocks, then over {len(profiles)} "
        f"rounds): forward x{fwd:.2f}, backward x{bwd:.2f}; head + loss x{last:.2f}."
    )


def _ratios(values: tuple[float, ...]) -> str:
    return ", ".join(f"{x:.3f}" for x in values)


def section(case: str, layers: int, result: dict[str, Any]) -> list[str]:
    """One case on one pipeline: the runs, every round, the paired verdicts of each DynMo variant."""
    rows, s, h = result["rows"], result["static"], result["head"]
    lines = [
        f"### {case}, {result['shape']} ({layers} layers)",
        "",
        "| run | step (ms: timed steps' mean, rounds' median) | every round (ms) | idle, simulated | "
        "idle, measured | placement (last) |",
        "|---|---:|---|---:|---:|---|",
    ]
    for name, row in rows.items():
        sim, meas = row["idle"]
        every = ", ".join(f"{1e3 * x:.1f}" for x in row["rounds"])
        lines.append(
            f"| {name} | {row['ms']:.1f} | {every} | {sim:.0%} | {meas:.0%} | `{row['placement']}` |"
        )
    lines += [
        "",
        f"Best fixed in hindsight (measured, held out per round): {', '.join(s.ideal)}. Sleeps lasted "
        f"x{result['overshoot']:.3f} what they asked for (the mean over a job's ranks, the median over its "
        f"jobs). The ranks kept {result['cores']:.2f} of this machine's {os.cpu_count()} cores busy (their "
        "CPU seconds per timed step, summed over ranks, over the step: the median over its jobs; sleeps "
        "use none, so what is busy is the pipeline's own work, and near all cores the sleeps wake late).",
        "",
        f'- **The callback\'s own cost** ({CONTROL}: the split with `DynMoCallback(balancer="static")`, '
        "which times the stages, exchanges its row and takes the events every step, never moving): "
        f"head-aware static / {CONTROL} **{statistics.median(result['callback cost']):.3f}x** (per round "
        f"{_ratios(result['callback cost'])}).",
    ]
    for v in VARIANTS:
        head_gain = h.median_speedup(v)
        windows = ", ".join(f"{d} / {k} / {t:.2f} s" for d, k, t in rows[v]["windows"])
        simulated = rows[v]["simulated"]
        lines += [
            f"- **{v}**: better static ({s.static}) / {v}: **{s.median_speedup(v):.3f}x** (per round "
            f"{_ratios(s.speedup[v])}); head-aware static / {v}: **{head_gain:.3f}x** (per round "
            f"{_ratios(h.speedup[v])}){' (gain under 2%)' if head_gain < 1.02 else ''}; of best fixed: "
            f"**{s.median_of_ideal(v):.1%}** (per round {_ratios(s.of_ideal[v])}). Slower than the "
            f"head-aware split in every round: {'YES' if h.slower_beyond_noise(v) else 'no'}. Rebalances "
            f"per round: {rows[v]['rebalances']}; windows per round (decided, skipped, seconds the callback "
            f"reported over the job's {result['steps']} steps): {windows}. Between its events (the "
            f"timed steps that took no decision and applied none, the same steps of both): head-aware "
            f"static / {v} "
            f"{statistics.median(rows[v]['between']):.3f}x (per round {_ratios(tuple(rows[v]['between']))}). "
            f"Its placements on the replayed costs (step model, no job): head-aware static / {v} "
            f"{statistics.median(simulated):.3f}x (per round {_ratios(tuple(simulated))}). Against the "
            f"split carrying the same per-step work: {CONTROL} / {v} "
            f"{statistics.median(rows[v]['versus control']):.3f}x (per round "
            f"{_ratios(rows[v]['versus control'])}).{_profile_note(rows[v]['profile'])}",
        ]
    return [*lines, ""]


def summary(done: list[tuple[str, int, dict[str, Any]]]) -> list[str]:
    """One row per case, pipeline and DynMo variant: the medians of the paired ratios and the verdicts."""
    lines = [
        "### Summary",
        "",
        "| case | shape | DynMo | better static / DynMo | head-aware static / DynMo (rounds: min-max) | "
        "DynMo of best fixed (measured) | idle measured: head-aware -> DynMo | >= 95% of best fixed | "
        "not slower than head-aware beyond its rounds | the callback's own cost (head-aware / + callback) | "
        "head-aware + callback / DynMo |",
        "|---|---|---|---:|---|---:|---|---|---|---:|---:|",
    ]
    for case, _, result in done:
        s, h, rows = result["static"], result["head"], result["rows"]
        for v in VARIANTS:
            gains = h.speedup[v]
            note = " (under 2%)" if h.median_speedup(v) < 1.02 else ""
            lines.append(
                f"| {case} | {result['shape']} | {v} | {s.median_speedup(v):.3f}x | "
                f"{h.median_speedup(v):.3f}x{note} ({min(gains):.3f}-{max(gains):.3f}) | "
                f"{s.median_of_ideal(v):.1%} | "
                f"{rows['head-aware static']['idle'][1]:.0%} -> {rows[v]['idle'][1]:.0%} | "
                f"{'yes' if s.median_of_ideal(v) >= 0.95 else 'NO'} | "
                f"{'NO' if h.slower_beyond_noise(v) else 'yes'} | "
                f"{statistics.median(result['callback cost']):.3f}x | "
                f"{statistics.median(rows[v]['versus control']):.3f}x |"
            )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> str:
    """Replay every trace at the paper's setup, print and write the report; return it."""
    parser = trace_parser(
        "python -m benchmarks.paper_replay", __doc__.split("\n")[0], "synthetic trace, 2 ranks, 1 round"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--schedule", default="ZBVZeroBubble", help="torch's pipeline schedule")
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--layers", type=int, default=48, help="the model's depth (traces mapped onto it)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=512, help="step-model simulations per search")
    parser.add_argument("--block-ms", type=float, default=1.0, help="a dense block's forward per micro-batch")
    parser.add_argument("--case", nargs="+", default=None, help="only these cases (default: all + dense)")
    parser.add_argument(
        "--phases", type=int, default=4, help="rows replayed of a phased case (not MoE, MoD), evenly spaced"
    )
    parser.add_argument("--hold", type=int, default=5, help="timed steps each phase lasts")
    parser.add_argument(
        "--sleep-feedback",
        action="store_true",
        help="each rank's sleeps ask for less by their own wake-up delay (SleepAccount.feedback)",
    )
    add_kernel_arguments(parser, "the costs (then scaled to --block-ms)")
    args = parser.parse_args(argv)
    kernels = kernels_from_args(parser, args)
    command = command_line("paper_replay", argv)
    out = results_path("paper_replay", args.out, args.force)
    if args.quick:
        stats = [synthetic_trace(4, 3)]
        args.ranks, args.steps, args.warmup, args.rounds, args.layers = [2], 6, 2, 1, 8
        args.microbatches, args.budget, args.phases, args.hold = 4, 16, 2, 2
    else:
        stats = select_traces(args.traces, args.case)
        if not stats:
            raise SystemExit(f"no trace of the cases {args.case} in {args.traces}")
    costs: Costs | KernelCosts = paper_costs(args.quick) if kernels is None else kernels
    probe = Shape(2, args.schedule, args.microbatches)  # does the schedule run weight passes?
    split = any(k == "W" for acts in schedule_actions(args.schedule, probe.stages, 4) for _, k, _ in acts)
    torch.set_num_threads(1)  # before forking the ranks
    SLEEPS.feedback = args.sleep_feedback  # the overhead is then measured as the ranks will sleep
    overhead = measure_call_overhead(replay_model(2, "linear", split), microbatch_size=1, seq_len=SEQ)
    lines = [
        "# The traces replayed at the paper's setup (emulated cost)",
        "",
        f"Command: `{command}`  ",
        f"Device: a shared 2-core x86_64 CPU VM (torch {torch.__version__}), gloo, one thread per rank; "
        "**emulated cost**: every block and part sleeps its recorded cost (sleeping uses no CPU, so more "
        "ranks than cores run).",
        f"Setup: {args.schedule}, {args.microbatches} micro-batches per step, {args.layers} layers, "
        f"MoE and MoD {args.steps} steps ({args.warmup} untimed), the trace spread over them; the other "
        f"cases {args.phases} phases of {args.hold} steps after {args.warmup} untimed on the first; "
        f"{args.rounds} round(s); a dense block sleeps "
        f"{args.block_ms} ms forward per micro-batch; blocks compute `linear` before their sleep"
        f"{'; half of a block backward sleeps in its weight pass' if split else ''}.",
        f"Costs (scaled to those sleeps): {costs.label}.",
        f"Sleeps compensated: measured before the ranks start, {overhead.describe()}"
        + (
            "; every sleep asks for less by its process's wake-up delay, as its last sleeps had it "
            "(`--sleep-feedback`)."
            if args.sleep_feedback
            else "; a sleep's late wake-up under load is not compensated."
        ),
        "",
    ]
    done: list[tuple[str, int, dict[str, Any]]] = []
    todo = len(stats) * len(args.ranks)
    for s in stats:
        how = recipe(s.case, args.phases, args.hold)
        trace = paper_trace(s, args.layers, costs, args.block_ms, split, how.get("phases"), args.clamp_curves)
        hold = how.get("hold")
        # Every phased case runs phases x hold timed steps (a trace of fewer rows holds its last one).
        steps = args.steps if hold is None else args.warmup + args.phases * hold
        for ranks in args.ranks:
            shape = Shape(ranks, args.schedule, args.microbatches)
            if shape.stages > args.layers:
                continue
            base = ReplayJob(
                trace,
                ranks,
                steps,
                args.warmup,
                "uniform",
                overhead=overhead,
                compute="linear",
                schedule=args.schedule,
                num_microbatches=args.microbatches,
                split_backward=split,
                hold=hold,
                sleep_feedback=args.sleep_feedback,
            )
            result = replay_case(base, shape, args.rounds, args.budget, how["dynmo"], how.get("announce"))
            part = section(CASES[s.case].name if s.case in CASES else s.case, args.layers, result)
            print("\n".join(part), flush=True)
            lines += part
            done.append((s.case, ranks, result))
            if len(done) < todo:  # what is measured so far survives a run stopped before its end
                note = f"**Partial: {len(done)} of {todo} case x pipeline runs so far.**"
                out.write_text("\n".join([*lines, note, "", *summary(done)]) + "\n")
    report = "\n".join([*lines, *summary(done)])
    write_report(report, "paper_replay", out)
    return report


if __name__ == "__main__":
    main()
