"""The step model against measured steps where the true costs are known: emulated-cost pipelines.

Issue 19 asks the schedule model (:func:`lightning_dynmo.balancing.step_prediction.predict_step`, torch's
own action lists) to predict a measured step within 2% on emulated pipelines of 4 and 8 ranks under
1F1B, Interleaved1F1B and ZBVZeroBubble. Each block of a :class:`~lightning_dynmo.demos.DemoGPT` sleeps a
known time forward and backward (:class:`~lightning_dynmo.demos.EmulatedCost`, no CPU), so the model's
inputs are exact and only the model, and what it leaves out, can miss.

Per (ranks, schedule), one job of that many gloo ranks:

1. ``--calibrate-steps`` steps at the first candidate (the uniform split) with every block sleeping its
   cost: what the runtime costs besides the layers' sleeps and the blocks' own compute (timed alone in
   this process, :func:`block_compute_ms`) is found as the cost per action (``per_op_s``) at which the
   schedule model reproduces this phase's median step
   (:func:`~lightning_dynmo.balancing.step_prediction.fit_per_op`): sends, receives, the schedule's
   bookkeeping, as they cost where the runtime really runs the pipeline. These steps are never compared;
   DynMo's policy can fit it the same way on the placement it runs.
2. ``--rounds`` rounds visiting each candidate placement (``--warm`` untimed steps after the migration,
   ``--measure`` timed): the uniform split, the exact min-max partition of the true costs, the schedule
   model's best (:func:`~lightning_dynmo.balancing.step_prediction.refine`) and a skewed split.

An earlier version took ``per_op_s`` from steps whose blocks slept nothing: every rank then computes at
once and queues for the 2 cores, so it overstated what an action costs in a pipeline that mostly sleeps
(errors up to +4.4% at 8 ranks, ``results/step_model-2026-11-26.md``).

For each candidate it prints the predicted step from the sleeps as asked (no overhead), the predicted
step with what the run measured (each layer's sleep as it took, a sleep waking late on a busy machine,
:data:`~lightning_dynmo.demos.cost.SLEEPS` per rank as that worker's slowdown; plus its block's own
compute; plus ``per_op_s`` an action), the measured median and the error, and which candidate each
ranks first; the errors are summarised over every candidate and over the candidates other than the
calibration's placement (whose compared steps are other steps than the calibration's, at the same
placement). ZBVZeroBubble splits backward into input and weight gradients: an emulated block sleeps in
its input gradient only (its sleep sits on the input's path), so the jobs predict with
``weight_grad_share=0``. Sleeps are ``--scale`` times a fixed pattern (2-8 ms forward per micro-batch
at 1.0), so the runtime's own cost is a small part of a step. **Emulated cost.**

    python -m benchmarks.step_model            # 4 and 8 ranks x 3 schedules: ~15 minutes on 2 cores
    python -m benchmarks.step_model --quick    # smoke run (2 ranks, 1F1B, one round): not figures

The report goes to ``benchmarks/results/step_model-<date>.md``; an existing file is kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from benchmarks.common import StepTimer, benchmark_trainer, launch, results_path, write_report
from benchmarks.gpt_pipeline import PlacementSweep, visit_schedule
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.balancing import BalanceProblem, LayerCost, Placement, partition, uniform
from lightning_dynmo.balancing.hardware import Hardware
from lightning_dynmo.balancing.step_prediction import ScheduleOrder, fit_per_op, predict_step, refine
from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
from lightning_dynmo.demos.cost import SLEEPS
from lightning_dynmo.pipeline import schedule_order
from lightning_dynmo.pipeline.step.schedule import resolve_schedule

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
#: A block timed alone sleeps this: not 0, so it runs the same code (an autograd function and a sleep
#: call) as with its cost, and only the cost is missing.
TINY_MS = 1e-6
#: Forward sleep of each block per micro-batch, ms, cycled over the layers (backward sleeps twice).
PATTERN_MS = (2.0, 3.0, 5.0, 8.0, 3.0, 2.0, 6.0, 4.0)


@dataclass(frozen=True)
class Options:
    """How long each part of a job runs."""

    calibrate_steps: int = 5
    warm: int = 2
    measure: int = 4
    rounds: int = 2
    scale: float = 3.0  # sleeps are this many times PATTERN_MS


@dataclass(frozen=True)
class StepModelJob:
    """One pipeline job: ``ranks`` gloo ranks under ``schedule``, blocks sleeping ``fwd_ms`` (2x back)."""

    schedule: str
    ranks: int
    fwd_ms: tuple[float, ...]
    candidates: tuple[str, ...]
    options: Options

    @property
    def microbatches(self) -> int:
        return 2 * self.ranks

    @property
    def num_stages(self) -> int:
        return self.ranks * resolve_schedule(self.schedule).stages_per_rank

    def costs(self, block_ms: tuple[float, float] = (0.0, 0.0)) -> list[LayerCost]:
        """Per layer, one step's sleep (all micro-batches) plus the block's own compute, seconds."""
        m, (fwd, bwd) = self.microbatches, block_ms
        return [
            LayerCost(fwd_time_s=m * (f + fwd) / 1e3, bwd_time_s=m * (2 * f + bwd) / 1e3) for f in self.fwd_ms
        ]

    def model(self) -> DemoGPT:
        """The job's DemoGPT (tiny real blocks, each followed by its sleep)."""
        return DemoGPT(
            num_layers=len(self.fwd_ms), sleep_ms=list(self.fwd_ms), d_model=16, vocab_size=32, seq_len=8
        )


def block_compute_ms(job: StepModelJob, repeats: int = 200) -> tuple[float, float]:
    """One block's own forward and backward on one micro-batch, ms (medians, in this process): its compute
    and its sleep's code (an autograd function, a sleep call), with the sleep itself set aside."""
    torch.set_num_threads(1)
    block = job.model().layers["0"]
    block.cost.fwd_ms = block.cost.bwd_ms = TINY_MS  # type: ignore[union-attr]  # its sleep's code, no sleep
    x = torch.randn(1, 8, 16, requires_grad=True)
    fwd, both = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = block(x)
        middle = time.perf_counter()
        out.sum().backward()
        fwd.append(middle - start)
        both.append(time.perf_counter() - start)
    f, t = statistics.median(fwd), statistics.median(both)
    return 1e3 * f, 1e3 * (t - f)


def job_for(schedule: str, ranks: int, options: Options, layers_per_stage: int = 2) -> StepModelJob:
    """The job of ``ranks`` ranks under ``schedule``, candidates: uniform, min-max, model, skewed."""
    stages = ranks * resolve_schedule(schedule).stages_per_rank
    num_layers = layers_per_stage * stages
    fwd = tuple(options.scale * PATTERN_MS[i % len(PATTERN_MS)] for i in range(num_layers))
    job = StepModelJob(schedule, ranks, fwd, (), options)
    problem, order = BalanceProblem(job.costs()), _order(schedule)
    minmax = partition(problem, stages)
    best = refine(problem, minmax, lambda p: predict_step(problem, p, order, job.microbatches).step_s)
    sizes = [1] * (stages - 1) + [num_layers - stages + 1]  # everything on the last stage: far off
    skewed = Placement.from_sizes([*sizes[: stages // 2], *sorted(sizes[stages // 2 :])])
    names = dict.fromkeys(str(p) for p in (uniform(num_layers, stages), minmax, best.placement, skewed))
    return dataclasses.replace(job, candidates=tuple(names))


def _order(schedule: str) -> ScheduleOrder:
    order = schedule_order(schedule)
    # An emulated block sleeps on the input-gradient path only: its weight gradient is the tiny real one.
    return dataclasses.replace(order, weight_grad_share=0.0)


class _SleepsOfEveryRank(pl.Callback):
    """At the end of training, every rank's sleep overshoot, by global rank (the group is still up)."""

    def __init__(self) -> None:
        self.overshoot: list[float] = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, SLEEPS.overshoot)
        self.overshoot = [float(v) for v in gathered]


def run_job(job: StepModelJob) -> dict[str, Any]:
    """Body of one rank (started by ``benchmarks.common.launch``)."""
    torch.set_num_threads(1)
    o = job.options
    sweep = visit_schedule(job.candidates, o.warm, o.measure, o.rounds, lead_steps=1)
    schedule = [(job.candidates[0], False)] * o.calibrate_steps + sweep
    timer = StepTimer()
    strategy = DynMoStrategy(
        num_microbatches=job.microbatches, schedule=job.schedule, placement=job.candidates[0]
    )
    sleeps = _SleepsOfEveryRank()
    callbacks = [timer, PlacementSweep(schedule), sleeps]
    trainer = benchmark_trainer(strategy, callbacks, len(schedule), devices=job.ranks)
    model = job.model()
    m = job.microbatches
    trainer.fit(
        model, RandomTokenDataModule(batch_size=m, num_samples=m * len(schedule), seq_len=8, vocab_size=32)
    )
    calibration = timer.step_s[1 : o.calibrate_steps]  # the first step builds the pipeline
    timed: dict[str, list[float]] = {}
    for (placement, is_timed), step_s in zip(sweep, timer.step_s[o.calibrate_steps :], strict=True):
        if is_timed:
            timed.setdefault(placement, []).append(step_s)
    return {"calibration_s": calibration, "timed_s": timed, "overshoot": sleeps.overshoot}


def per_op_overhead(
    job: StepModelJob, calibration_step_s: float, overshoot: Sequence[float], block_ms: tuple[float, float]
) -> float:
    """Seconds per action: the one at which the schedule model reproduces the calibration's median step
    at the first candidate (its sleeps as they took, its blocks' own compute)."""
    problem, placement, order, workers = _prediction_inputs(job, job.candidates[0], overshoot, block_ms)
    return fit_per_op(problem, placement, order, job.microbatches, calibration_step_s, workers)


def _prediction_inputs(
    job: StepModelJob,
    placement: str,
    overshoot: Sequence[float] | None,
    block_ms: tuple[float, float],
) -> tuple[BalanceProblem, Placement, ScheduleOrder, list[int]]:
    p, order = Placement.from_string(placement), _order(job.schedule)
    actions = order.actions(p.num_stages, job.microbatches)
    workers = [
        next(r for r, acts in enumerate(actions) if any(a[0] == s for a in acts)) for s in range(p.num_stages)
    ]
    problem = BalanceProblem(
        job.costs(block_ms), hardware=Hardware(worker_slowdown=list(overshoot) if overshoot else None)
    )
    return problem, p, order, workers


def predicted_ms(
    job: StepModelJob,
    placement: str,
    per_op_s: float,
    overshoot: Sequence[float] | None = None,
    block_ms: tuple[float, float] = (0.0, 0.0),
) -> float:
    """The schedule model's step of ``placement``, ms: each layer costs its sleep plus ``block_ms`` (its
    block's own compute), rank ``r``'s time ``overshoot[r]`` times as long (its sleeps woke that late: a
    worker slowdown), ``per_op_s`` added to every action."""
    problem, p, order, workers = _prediction_inputs(job, placement, overshoot, block_ms)
    step = predict_step(problem, p, order, job.microbatches, stage_workers=workers, per_op_s=per_op_s)
    return 1e3 * step.step_s


def job_section(job: StepModelJob, result: dict[str, Any]) -> tuple[list[str], list[float], list[float]]:
    """The table of one job; its errors (fractions) over every candidate and over the candidates other
    than the calibration's placement."""
    calibration, overshoot, block_ms = (
        statistics.median(result["calibration_s"]),
        result["overshoot"],
        result["block_ms"],
    )
    per_op = per_op_overhead(job, calibration, overshoot, block_ms)
    lines = [
        f"### {job.ranks} ranks, {job.schedule} ({job.num_stages} stages, {len(job.fwd_ms)} layers, "
        f"{job.microbatches} micro-batches)",
        "",
        f"Calibration: `{job.candidates[0]}` stepped {1e3 * calibration:.1f} ms (median of "
        f"{len(result['calibration_s'])}); a block's own compute {block_ms[0]:.2f} + {block_ms[1]:.2f} ms "
        f"a micro-batch; the model matches that step at {1e3 * per_op:.3f} ms per action. Sleeps took "
        f"{min(overshoot):.3f}-{max(overshoot):.3f}x what they asked (per rank).",
        "",
        "| placement | predicted from the asked sleeps, no overhead (ms) | predicted (ms) | measured (ms) "
        "| error |",
        "|---|---|---|---|---|",
    ]
    errors, others, measured, predicted = [], [], {}, {}
    for name in job.candidates:
        measured[name] = 1e3 * statistics.median(result["timed_s"][name])
        predicted[name] = predicted_ms(job, name, per_op, overshoot, block_ms)
        error = (predicted[name] - measured[name]) / measured[name]
        errors.append(error)
        if name != job.candidates[0]:
            others.append(error)
        bare = predicted_ms(job, name, 0.0)
        mark = " (calibration's placement)" if name == job.candidates[0] else ""
        lines.append(
            f"| `{name}`{mark} | {bare:.1f} | {predicted[name]:.1f} | {measured[name]:.1f} | {error:+.1%} |"
        )
    best_p, best_m = min(predicted, key=predicted.__getitem__), min(measured, key=measured.__getitem__)
    lines += ["", f"Predicted best `{best_p}`, measured best `{best_m}`.", ""]
    return lines, errors, others


def main(argv: list[str] | None = None) -> str:
    """Run the jobs, print and write the report; return it."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedule", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--rounds", type=int, default=Options.rounds)
    parser.add_argument("--scale", type=float, default=Options.scale, help="sleep multiplier")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 1F1B, 1 round: a smoke run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    options = Options(rounds=args.rounds, scale=args.scale)
    shapes = [(s, r) for r in args.ranks for s in args.schedule]
    if args.quick:
        options, shapes = Options(calibrate_steps=3, warm=1, measure=1, rounds=1, scale=1.0), [("1F1B", 2)]
    out = results_path("step_model", args.out, args.force)
    torch.set_num_threads(1)
    command = "python -m benchmarks.step_model" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])
    )
    lines = ["# The step model against measured steps (emulated cost)", "", f"Command: `{command}`", ""]
    all_errors, other_errors = [], []
    for schedule, ranks in shapes:
        job = job_for(schedule, ranks, options)
        result = {**launch(run_job, job, nproc=ranks, start_method="fork"), "block_ms": block_compute_ms(job)}
        section, errors, others = job_section(job, result)
        lines += section
        all_errors += [abs(e) for e in errors]
        other_errors += [abs(e) for e in others]
        print("\n".join(section), flush=True)
    lines += [
        f"Over all {len(all_errors)} placements: median |error| {statistics.median(all_errors):.1%}, "
        f"worst {max(all_errors):.1%}"
        + (
            f"; over the {len(other_errors)} other than the calibration's: median "
            f"{statistics.median(other_errors):.1%}, worst {max(other_errors):.1%}."
            if other_errors
            else "."
        ),
        "",
    ]
    report = "\n".join(lines)
    write_report(report, "step_model", out)
    return report


if __name__ == "__main__":
    main()
