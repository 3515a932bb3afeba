"""Trace-driven pipelines: each case's recorded per-step costs replayed as sleeps in real gloo pipelines.

Per case (the newest trace of each case in ``benchmarks/results/traces/``, and ``dense``: the same
model without dynamism, which shows the head's static imbalance alone; a synthetic trace with
``--quick``) and per pipeline size (``--ranks``, 8 and 16 by default; 1F1B), every block of a
:class:`~lightning_dynmo.demos.DemoGPT` with the model's real layer count sleeps, at every step, what
the trace says its layer costs at that step (:class:`~lightning_dynmo.demos.TraceReplay`), and so do
the embedding and the head + loss (the parts, costed from the model's shape:
:mod:`benchmarks._lib.trace_cases`). Sleeping uses no CPU, so 8-16 ranks run on 2 cores
(``start_method="forkserver"``). The costs are scaled so a
dense block sleeps ``--block-ms`` per micro-batch forward, less what a call costs beyond its sleep (the
block's compute, the sleep's wake-up: :func:`~lightning_dynmo.demos.measure_call_overhead`, measured
before the ranks start), so a layer costs what the trace says; the few cheaper than that overhead cost the
overhead, and every "true" cost below (best fixed, simulated idle) is the cost the pipeline really runs
(:meth:`~lightning_dynmo.demos.CallOverhead.replayed`). Jobs, each ``--steps`` steps, the first
``--warmup`` untimed (the trace is spread over the run: step ``s`` replays row ``s x rows // steps``, so
a run shorter than the trace skips rows evenly):

- **static uniform**, **static params**: fixed placements;
- **best fixed**: the exact min-max partition of the true per-step costs averaged over the run, refined
  by the step model (many partitions tie on the head's stage; the step breaks the tie, as DynMo's
  policy does), run as a fixed placement (computed, never picked by measurement);
- **DynMo**: ``DynMoCallback`` live (it profiles the sleeps, decides and migrates), from uniform.

``--rounds`` interleaved rounds (the job order reversed every other round); every ratio is taken within
a round and summarised by its median (:mod:`benchmarks._lib.paired`; the ideal is the best fixed placement,
one candidate: nothing to hold out). Per job the idle (bubble) share per iteration two ways: *simulated*
(:func:`~lightning_dynmo.balancing.step_prediction.predict_step` on the true costs of each replayed step,
the placement the job ended at) and *measured*, ``(ranks x step - work) / (ranks x step)`` with ``work``
the sleeps the trace prescribes (known exactly) and ``step`` the measured median. DynMo's profiled
first/last parts are printed beside the true ones (they must be measured as parts, not lost).
**Emulated cost**.

    python -m benchmarks.replay                  # every trace, 8 and 16 ranks, 5 rounds: long
    python -m benchmarks.replay --quick          # synthetic trace, 2 ranks, 1 round: not figures
    python -m benchmarks.replay --kernels benchmarks/results/gpu/<date>/kernels.json

With ``--kernels PATH`` (a ``kernels.json`` of ``python -m lightning_dynmo.gpu_check.kernels``) each
case's block costs, the head + loss and the embedding are taken relative to the GPU dense block from that
check's cost curves (:func:`benchmarks._lib.gpu_curves.relative_cost_trace`: the statistic mapping, the
forward : backward = 1 : 2 split, out-of-range values refused unless ``--clamp-curves``); a dense block
still sleeps ``--block-ms``.

The report goes to ``benchmarks/results/replay-<date>.md``; an existing file is kept unless ``--force``.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib import paired
from benchmarks._lib.common import (
    CpuOfEveryRank,
    SleepsOfEveryRank,
    StepTimer,
    benchmark_trainer,
    command_line,
    cores_busy,
    launch,
    results_path,
    write_report,
)
from benchmarks._lib.gpu_curves import add_kernel_arguments, kernels_from_args, relative_cost_trace
from benchmarks._lib.trace_cases import (
    DENSE_FWD,
    cost_trace,
    dense_trace,
    load_traces,
    synthetic_trace,
    trace_parser,
)
from benchmarks.projection import Shape, best_placement
from lightning_dynmo.balancing import Placement, by_parameters, uniform
from lightning_dynmo.balancing.step_prediction import predict_step
from lightning_dynmo.balancing.trace import CostTrace, StatisticTrace
from lightning_dynmo.callback import DynMoCallback
from lightning_dynmo.demos import (
    CallOverhead,
    DemoGPT,
    RandomTokenDataModule,
    TraceReplay,
    measure_call_overhead,
)
from lightning_dynmo.demos.cost import SLEEPS
from lightning_dynmo.demos.emulated_block import COMPUTES
from lightning_dynmo.pipeline import schedule_order
from lightning_dynmo.strategy import DynMoStrategy

GAP = 0.05  # a static split within 5% of the best fixed placement is "not imbalanced"
DYNMO = {"balancer": "partition", "cost": "time", "every_step": True}
REFINE_BUDGET = 256  # step-model simulations that refine the best fixed placement
#: The job allowed to re-pack (issue 21: re-packing measured where the work shrinks).
REPACK = "DynMo + re-pack"
SEQ, VOCAB = 8, 32  # the replayed GPT's shape: tiny, its layers' cost is the sleeps
#: A job still running after this many times the slowest job so far (at least MIN_JOB_TIMEOUT_S) is
#: stopped and run once more (:func:`benchmarks._lib.common.launch`): a rank stuck in its launch costs
#: minutes.
JOB_TIMEOUT_FACTOR, MIN_JOB_TIMEOUT_S = 3.0, 240.0


def replay_model(num_layers: int, compute: str = "dense", split_backward: bool = False) -> DemoGPT:
    """The GPT every replay runs (one sample per micro-batch); ``compute``: what a block computes
    before its sleep (``"linear"``: little, for more ranks than cores); ``split_backward``: blocks sleep
    their records' weight-gradient part in the weight pass (:class:`~lightning_dynmo.demos.DemoConfig`)."""
    return DemoGPT(
        num_layers=num_layers,
        d_model=16,
        vocab_size=VOCAB,
        seq_len=SEQ,
        block_compute=compute,
        split_backward=split_backward,
    )


@dataclass(frozen=True)
class ReplayJob:
    """One pipeline job: ``ranks`` gloo ranks replaying ``trace`` (emulated seconds) for ``steps`` steps.

    Attributes:
        trace: The costs to replay, in the emulated pipeline's seconds.
        ranks: Pipeline ranks (1F1B: one stage each).
        steps: Training steps.
        warmup: Untimed first steps.
        placement: The fixed placement, or where DynMo starts.
        dynmo: ``DynMoCallback`` keywords; ``None``: a fixed placement.
        overhead: What a call costs beyond its sleep, subtracted from every sleep (``None``: nothing).
        compute: What a block computes before its sleep (:func:`replay_model`).
        schedule: The pipeline schedule (torch's; several stages per rank under ``ZBVZeroBubble``).
        num_microbatches: Micro-batches per step; ``None``: two per rank.
        split_backward: Blocks sleep their weight-gradient part in the weight pass (:func:`replay_model`).
        hold: Steps each trace row lasts after the ``warmup`` steps, which replay the first row (the
            trace's rows are phases); ``None``: the rows spread evenly over all ``steps``.
        announce: Publish a dynamism event of this kind at every new row (``TraceReplay(announce=...)``).
        sleep_feedback: Every rank's sleeps follow their own wake-up delay
            (:attr:`lightning_dynmo.demos.cost.SleepAccount.feedback`), so a call lasts what the trace
            says under the load of more ranks than cores.
    """

    trace: CostTrace
    ranks: int
    steps: int
    warmup: int
    placement: str
    dynmo: dict[str, Any] | None = None
    overhead: CallOverhead | None = None
    compute: str = "dense"
    schedule: str = "1F1B"
    num_microbatches: int | None = None
    split_backward: bool = False
    hold: int | None = None
    announce: str | None = None
    sleep_feedback: bool = False

    @property
    def microbatches(self) -> int:
        return 2 * self.ranks if self.num_microbatches is None else self.num_microbatches

    def trace_replay(self) -> TraceReplay:
        """The callback replaying this job's trace: spread evenly over its steps, or held (``hold``)."""
        m, o, kind = self.microbatches, self.overhead, self.announce
        if self.hold is None:
            return TraceReplay(self.trace, m, overhead=o, spread_over=self.steps, announce=kind)
        return TraceReplay(self.trace, m, self.hold, overhead=o, lead_steps=self.warmup, announce=kind)

    def true_trace(self) -> CostTrace:
        """The costs this job's pipeline really runs (the trace, each call at least its overhead)."""
        return self.trace if self.overhead is None else self.overhead.replayed(self.trace, self.microbatches)

    def replayed_rows(self) -> list[int]:
        """The trace row of every timed step."""
        replay = self.trace_replay()
        return [replay.row(s) for s in range(self.warmup, self.steps)]


def run_replay(job: ReplayJob) -> dict[str, Any]:
    """Body of one rank (started by ``benchmarks._lib.common.launch``)."""
    torch.set_num_threads(1)
    SLEEPS.feedback = job.sleep_feedback
    timer, m = StepTimer(), job.microbatches
    dynmo = DynMoCallback(**job.dynmo) if job.dynmo is not None else None
    sleeps, cpu = SleepsOfEveryRank(), CpuOfEveryRank()
    callbacks = [timer, cpu, job.trace_replay(), sleeps, *([dynmo] if dynmo else [])]
    strategy = DynMoStrategy(num_microbatches=m, schedule=job.schedule, placement=job.placement)
    trainer = benchmark_trainer(strategy, callbacks, job.steps, devices=job.ranks)
    model = replay_model(job.trace.num_layers, job.compute, job.split_backward)
    trainer.fit(
        model, RandomTokenDataModule(batch_size=m, num_samples=m * job.steps, seq_len=SEQ, vocab_size=VOCAB)
    )
    hardware = dynmo.last_hardware if dynmo is not None else None
    parts = {}
    if hardware is not None:
        parts = {
            name: None if cost is None else cost.time_s
            for name, cost in (("first", hardware.first_stage_extra), ("last", hardware.last_stage_extra))
        }
    return {
        "step_s": timer.step_s[job.warmup :],
        "placement": str(strategy.placement),
        "rebalances": sum(1 for r in dynmo.rebalances if r.applied) if dynmo else 0,
        "moves": [r.step for r in dynmo.rebalances if r.applied] if dynmo else [],  # global steps
        "decided": [r.step for r in dynmo.rebalances] if dynmo else [],  # each decision's step, kept too
        # What DynMo's monitoring did: decisions (one per profiling window), windows skipped, seconds spent.
        "windows": (len(dynmo.rebalances), dynmo.skipped_windows, dynmo.overhead_s) if dynmo else (0, 0, 0.0),
        "parts_s": parts,
        "stages": strategy.placement.num_stages,
        "placements": [(r.step, r.new) for r in dynmo.rebalances if r.applied] if dynmo else [],
        "overshoot": sleeps.overshoot,  # every rank's slept / requested
        "cores": cores_busy(cpu.cpu_s, timer.step_s, job.warmup),  # CPU the ranks kept busy
        "profile": profile_against_replayed(job, dynmo) if dynmo else None,
    }


def profile_against_replayed(job: ReplayJob, dynmo: DynMoCallback) -> dict[str, float] | None:
    """DynMo's last profile over the costs this rank's pipeline replayed while it was taken.

    The ratios of the profiled to the replayed (:meth:`ReplayJob.true_trace`) costs: per block forward and
    backward, their medians over the blocks, and the last part's (head and loss) forward plus backward.
    Only where the trace held one row over the profiled steps (``hold``; a decision recorded at step ``s``
    closed its window at the end of ``s - 1``): an every-step trace changes under the window, and its
    profile is a moving average of rows. ``None`` there, or without a decision.
    """
    costs, hardware = dynmo.last_costs, dynmo.last_hardware
    if job.hold is None or not costs or hardware is None or not dynmo.rebalances:
        return None
    replay = job.trace_replay()
    step = dynmo.rebalances[-1].step - 1
    row = job.true_trace().rows[replay.row(step)]
    if replay.row(step - dynmo.profiling.steps + 1) != replay.row(step):
        return None  # the window straddled two rows
    last = hardware.last_stage_extra
    return {
        "fwd": statistics.median(c.fwd_time_s / r.fwd_time_s for c, r in zip(costs, row.layers, strict=True)),
        "bwd": statistics.median(c.bwd_time_s / r.bwd_time_s for c, r in zip(costs, row.layers, strict=True)),
        "last": math.nan if last is None else last.time_s / row.last.time_s,
    }


def fixed_placements(trace: CostTrace, ranks: int) -> dict[str, str]:
    """Static uniform, static params and the best fixed placement (of the costs averaged over the run)."""
    mean = trace.mean_costs()
    return {
        "static uniform": str(uniform(trace.num_layers, ranks)),
        "static params": str(by_parameters(list(mean.layers), ranks)),
        "best fixed": str(best_placement(mean, Shape(ranks, "1F1B", 2 * ranks), budget=REFINE_BUDGET)),
    }


def idle_shares(job: ReplayJob, placement: str, step_s: float) -> tuple[float, float]:
    """Simulated (step model, true costs, per replayed step, mean) and measured idle share of a job."""
    order, p, true = schedule_order(job.schedule), Placement.from_string(placement), job.true_trace()
    rows = job.replayed_rows()
    simulated = statistics.fmean(
        predict_step(true.rows[r].problem(), p, order, job.microbatches).bubble_ratio for r in rows
    )
    work = statistics.fmean(true.rows[r].total_s for r in rows)
    return simulated, max(0.0, 1.0 - work / (job.ranks * step_s))


def replay_case(
    trace: CostTrace,
    ranks: int,
    steps: int,
    warmup: int,
    rounds: int,
    repack: bool = False,
    overhead: CallOverhead | None = None,
    compute: str = "dense",
) -> dict[str, Any]:
    """Every fixed placement and DynMo on ``ranks`` ranks, ``rounds`` interleaved rounds; with ``repack``,
    also DynMo allowed to re-pack onto fewer ranks (``RepackConfig()``: at most 5% slower, predicted)."""
    base = ReplayJob(trace, ranks, steps, warmup, "uniform", overhead=overhead, compute=compute)
    fixed = fixed_placements(base.true_trace(), ranks)
    jobs = {p: replace(base, placement=p) for p in dict.fromkeys(fixed.values())}
    jobs["DynMo"] = replace(base, placement="uniform", dynmo=DYNMO)
    if repack:
        # memory_capacity_bytes: the sleeping blocks hold no memory worth a cap (a re-pack needs one).
        repacking = {**DYNMO, "repack": True, "memory_capacity_bytes": 2**40}
        jobs[REPACK] = replace(base, placement="uniform", dynmo=repacking)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    slowest_s = 0.0  # a job past JOB_TIMEOUT_FACTOR x the slowest so far is stopped and run again
    for r in range(rounds):
        for name in list(jobs) if r % 2 == 0 else list(jobs)[::-1]:
            print(
                f"  [{trace.case}] {ranks} ranks, round {r + 1}/{rounds}: {name}", file=sys.stderr, flush=True
            )
            timeout_s = max(MIN_JOB_TIMEOUT_S, JOB_TIMEOUT_FACTOR * slowest_s)
            started = time.perf_counter()
            runs[name].append(
                launch(run_replay, jobs[name], nproc=ranks, start_method="forkserver", timeout_s=timeout_s)
            )
            slowest_s = max(slowest_s, time.perf_counter() - started)
    per_round = {name: [statistics.median(run["step_s"]) for run in runs[p]] for name, p in fixed.items()}
    per_round["DynMo"] = [statistics.median(run["step_s"]) for run in runs["DynMo"]]
    comparison = paired.compare(
        statics={k: per_round[k] for k in ("static uniform", "static params")},
        dynmo={"DynMo": per_round["DynMo"]},
        candidates={"best fixed": per_round["best fixed"]},
        gap=GAP,
        held_out=False,
    )
    rows = {}
    for name in (*fixed, "DynMo"):
        last = runs[fixed.get(name, name)][-1]
        step = statistics.median(per_round[name])
        simulated, measured = idle_shares(base, last["placement"], step)
        rows[name] = {"ms": 1e3 * step, "placement": last["placement"], "idle": (simulated, measured)}
    rows["DynMo"]["rebalances"] = [run["rebalances"] for run in runs["DynMo"]]
    rows["DynMo"]["windows"] = [run["windows"] for run in runs["DynMo"]]
    result = {
        "rows": rows,
        "comparison": comparison,
        "parts": runs["DynMo"][-1]["parts_s"],
        "ranks": ranks,
        "true_trace": base.true_trace(),
    }
    if repack:
        result["repack"] = {
            "stages": [run["stages"] for run in runs[REPACK]],
            # Per round, the throughput DynMo keeps on fewer ranks: DynMo's step / the re-packed job's.
            "kept": [
                d / statistics.median(run["step_s"])
                for d, run in zip(per_round["DynMo"], runs[REPACK], strict=True)
            ],
            "placement": runs[REPACK][-1]["placement"],
        }
    return result


def repack_line(ranks: int, repack: dict[str, Any]) -> str:
    """What re-packing measured: ranks released, throughput kept, per-rank throughput before -> after."""
    stages, kept = repack["stages"], statistics.median(repack["kept"])
    fewest = statistics.median(stages)
    return (
        f"{REPACK}: ended on {', '.join(str(s) for s in stages)} of {ranks} ranks (per round; last "
        f"`{repack['placement']}`), keeping **{kept:.0%}** of DynMo's throughput on all {ranks} (per round "
        f"{', '.join(f'{k:.0%}' for k in repack['kept'])}); throughput per rank {kept * ranks / fewest:.2f}x "
        "what it was on all of them."
    )


def section(trace: CostTrace, result: dict[str, Any]) -> list[str]:
    """One case on one pipeline size: the table, the paired verdict, the parts."""
    c: paired.PairedComparison = result["comparison"]
    rows = result["rows"]
    lines = [
        f"### {trace.case}, {result['ranks']} ranks ({trace.num_layers} layers, cost curve: "
        f"{trace.curve_label})",
        "",
        "| run | step (ms) | idle, simulated | idle, measured | placement (last) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, row in rows.items():
        sim, meas = row["idle"]
        lines.append(f"| {name} | {row['ms']:.1f} | {sim:.0%} | {meas:.0%} | `{row['placement']}` |")
    mean = result["true_trace"].mean_costs()
    per_layer = sorted(1e3 * c.time_s for c in mean.layers)  # what makes the case uneven, or not
    parts = result["parts"]
    profiled = ", ".join(
        f"{name} {1e3 * parts[name]:.1f} ms (true {1e3 * true.time_s:.1f})"
        if parts.get(name) is not None
        else f"{name} -"
        for name, true in (("first", mean.first), ("last", mean.last))
    )
    of_best = c.median_of_ideal()
    windows = ", ".join(f"{d} / {k} / {t:.2f} s" for d, k, t in rows["DynMo"]["windows"])
    per_round = ", ".join(f"{x:.3f}" for x in c.speedup["DynMo"])
    lines += [
        "",
        f"Better static ({c.static}) / DynMo: **{c.median_speedup():.2f}x**; DynMo achieves "
        f"**{of_best:.0%}** of the best fixed placement (medians over {c.rounds} round(s) of ratios within "
        f"a round; better static / DynMo per round: {per_round}); >= 95% of best fixed: "
        f"{'yes' if of_best >= 0.95 else 'NO'}; slower than static beyond "
        f"noise: {'YES' if c.slower_beyond_noise() else 'no'}. DynMo rebalances per round: "
        f"{rows['DynMo']['rebalances']}; its windows per round (decided, skipped, seconds it reported): "
        f"{windows}. Parts as DynMo profiled them, per step: {profiled}. A layer's "
        f"cost per step, averaged over the run: min {per_layer[0]:.1f} / median "
        f"{statistics.median(per_layer):.1f} / max {per_layer[-1]:.1f} ms.",
        "",
    ]
    if "repack" in result:
        lines += [repack_line(result["ranks"], result["repack"]), ""]
    return lines


def select_traces(folder: Path, cases: list[str] | None) -> list[StatisticTrace]:
    """The newest trace of each case in ``folder`` (only ``cases``, if given), then ``dense``: the model
    without dynamism (one row, every block dense), which shows the head's static imbalance alone."""
    loaded = load_traces(folder)
    everything = [*loaded, dense_trace(loaded[0].num_layers)] if loaded else []
    return [s for s in everything if cases is None or s.case in cases]


def summary(results: list[tuple[CostTrace, dict[str, Any]]]) -> list[str]:
    """One row per case and pipeline size: the gain, the share of the best fixed, the idle, the verdict."""
    lines = [
        "### Summary",
        "",
        "| case | ranks | better static / DynMo | DynMo of best fixed | idle measured, better static -> "
        "DynMo | >= 95% of best fixed, not slower than static |",
        "|---|---:|---:|---:|---|---|",
    ]
    for trace, result in results:
        c: paired.PairedComparison = result["comparison"]
        rows = result["rows"]
        ok = c.median_of_ideal() >= 0.95 and not c.slower_beyond_noise()
        lines.append(
            f"| {trace.case} | {result['ranks']} | {c.median_speedup():.2f}x | {c.median_of_ideal():.0%} | "
            f"{rows[c.static]['idle'][1]:.0%} -> {rows['DynMo']['idle'][1]:.0%} | {'yes' if ok else 'NO'} |"
        )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> str:
    """Replay every trace, print and write the report; return it."""
    parser = trace_parser(
        "python -m benchmarks.replay", __doc__.split("\n")[0], "synthetic trace, 2 ranks, 1 round"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-ms", type=float, default=4.0, help="a dense block's forward per micro-batch")
    parser.add_argument("--case", nargs="+", default=None, help="only these cases' traces (default: all)")
    parser.add_argument(
        "--repack", action="store_true", help="also run DynMo allowed to re-pack onto fewer ranks"
    )
    parser.add_argument(
        "--block-compute",
        choices=COMPUTES,
        default="dense",
        help="what a block computes before its sleep ('linear': little, for more ranks than cores)",
    )
    add_kernel_arguments(parser, "costs relative to the dense block")
    args = parser.parse_args(argv)
    kernels = kernels_from_args(parser, args)
    out = results_path("replay", args.out, args.force)
    stats = select_traces(args.traces, args.case)
    if not stats and not args.quick:
        raise SystemExit(f"no trace of the cases {args.case} in {args.traces}")
    if args.quick:
        stats, args.ranks, args.steps, args.warmup, args.rounds = [synthetic_trace(4, 3)], [2], 6, 2, 1
        args.block_ms = 1.0
    torch.set_num_threads(1)  # before forking the ranks
    # One sample per micro-batch; measured here, on the machine and threads the ranks inherit.
    overhead = measure_call_overhead(replay_model(2, args.block_compute), microbatch_size=1, seq_len=SEQ)
    lines = [
        "# Trace-driven pipelines: recorded costs replayed as sleeps (emulated cost)",
        "",
        f"Command: `{command_line('replay', argv)}`  ",
        f"Setup: 1F1B, 2 micro-batches per rank, {args.steps} steps ({args.warmup} untimed), {args.rounds} "
        f"round(s); a dense block sleeps {args.block_ms} ms forward per micro-batch (backward 2x); blocks "
        f"compute `{args.block_compute}` before their sleep. Simulated "
        "idle: predict_step (balancing.step_prediction) on the true costs of each replayed step.",
        f"Sleeps compensated: measured before the ranks start, {overhead.describe()}; each sleep is the "
        "trace's cost less that, and the true costs (best fixed, idle, per-layer spread) are what the "
        "pipeline then runs: every call at least its overhead.",
        "",
    ]
    if kernels is not None:
        lines += [f"Costs: relative to the dense block, {kernels.label}.", ""]
    done: list[tuple[CostTrace, dict[str, Any]]] = []
    for s in stats:
        for ranks in args.ranks:
            # Costs are per step in dense-forward units; a block sleeps per micro-batch.
            units = cost_trace(s) if kernels is None else relative_cost_trace(s, kernels, args.clamp_curves)
            trace = units.scaled(args.block_ms / 1e3 / DENSE_FWD * 2 * ranks)
            if trace.num_layers < ranks:
                continue
            result = replay_case(
                trace,
                ranks,
                args.steps,
                args.warmup,
                args.rounds,
                args.repack,
                overhead=overhead,
                compute=args.block_compute,
            )
            section_lines = section(trace, result)
            print("\n".join(section_lines), flush=True)
            lines += section_lines
            done.append((trace, result))
    report = "\n".join([*lines, *summary(done)])
    write_report(report, "replay", out)
    return report


if __name__ == "__main__":
    main()
