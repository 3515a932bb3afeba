"""Calibration inside one job: each placement's predicted step against the step measured in the same job.

The retired fixed-job calibration compared a profile job's prediction with other jobs' measurements. On this
2-core VM one process can run a whole step 15-30% slower than the next (the repeat control there: two
jobs of the same placement in one round differ by up to 31%), and that noise is as large as what the
model is judged on. DynMo never predicts for another process: it profiles a job and moves that job. This
benchmark asks that question. In each job (2 ranks, pinned, one torch thread each):

1. the uniform split runs ``PROFILE_FROM`` steps and one profile window (``DynMoCallback(min_gain=0.99)``,
   the profile of :mod:`benchmarks._lib.calibration`: it decides and moves nothing); its costs predict
   every candidate (:func:`benchmarks._lib.calibration.predicted_ms`, the runtime's cost per action fitted on
   this job's own steps before the window);
2. the callback is then detached (no hooks, no windows), and :class:`PlacementSweep` visits every
   candidate in turn with :meth:`~lightning_dynmo.strategy.DynMoStrategy.apply_placement`: ``settle``
   steps it does not count (the step that migrates and the ones right after), then ``measure`` steps
   it times. The candidates are every 2-stage split under 1F1B; under ZBV the uniform split, its
   one-move neighbours and the callback's own choice. ``cycles`` passes over them, each in a rotated
   order, so no placement always runs early or late in the job.

A placement's measured step is the median over a job's visits of each visit's median step; the tables
give the medians over jobs of the predicted and measured steps. A move delivers the fixed placement's
speed (``benchmarks/results/freezing-2026-11-27-after-move.md``,
``head_cost-2026-11-27-after-move.md``: within 2%), so a visit measures what a fixed job would, in the
same process as the profile. The callback's choice in each job is judged twice: against that job's
visits alone, and over every job's visits (each placement's step over its job's uniform split, median
over the jobs; the issue's reading: a run's choice against the best placement measured in interleaved
rounds). **Real compute.**

    python -m benchmarks.calibration_sweep              # both models x both schedules, 3 jobs each: ~22 min
    python -m benchmarks.calibration_sweep --model gpt2 --schedule 1F1B --rounds 3
    python -m benchmarks.calibration_sweep --quick      # smoke run (tiny, one job): not figures
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks._lib import harness
from benchmarks._lib.calibration import (
    FULL,
    MODELS,
    PROFILE_FROM,
    PROFILE_STEPS,
    QUICK,
    SCHEDULES,
    CalibrationJob,
    Sizes,
    batches,
    build_model,
    candidates,
    parts_line,
    predicted_ms,
)
from benchmarks._lib.common import StepTimer, benchmark_trainer, results_path
from lightning_dynmo.balancing import uniform
from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.pipeline.step.schedule import resolve_schedule
from lightning_dynmo.strategy import DynMoStrategy


@dataclass(frozen=True)
class Sweep:
    """How a job visits the placements: ``cycles`` passes; a visit: ``settle`` steps, ``measure`` timed."""

    cycles: int = 8
    settle: int = 2
    measure: int = 3


FULL_SWEEP = Sweep()
QUICK_SWEEP = Sweep(cycles=1, settle=1, measure=1)


@dataclass(frozen=True)
class SweepJob:
    """One 2-rank job: profile ``base`` at its uniform split, then visit ``placements`` (and the choice)."""

    base: CalibrationJob
    placements: tuple[str, ...]
    sweep: Sweep

    def steps(self) -> int:
        """Steps the job may need: the profile, every visit (with the callback's choice) and a margin."""
        visits = self.sweep.cycles * (len(self.placements) + 1)
        return PROFILE_FROM + 2 * PROFILE_STEPS + visits * (self.sweep.settle + self.sweep.measure + 1) + 8


class PlacementSweep(pl.Callback):
    """After ``dynmo``'s first decision, detach it and visit each placement in turn; then stop training.

    A move happens at a batch end, so the step it ends (from that batch's start to the next one's) carries
    the migration: it counts as the first of the ``settle`` steps of the new placement's visit. Records
    ``visits``: per visit, the placement and the indices (into the :class:`StepTimer`'s list) of its
    timed steps.
    """

    def __init__(self, dynmo: DynMoCallback, placements: tuple[str, ...], sweep: Sweep) -> None:
        self.dynmo, self.placements, self.sweep = dynmo, placements, sweep
        self.visits: list[tuple[str, list[int]]] = []
        self._plan: list[str] = []
        self._left = 0  # steps of the current visit still to run

    @property
    def done(self) -> bool:
        """Whether every planned visit has run."""
        return bool(self.visits) and not self._plan and self._left == 0

    def check_done(self, steps: int) -> None:
        """Raise unless every planned visit ran within the job's ``steps``.

        Raises:
            RuntimeError: if the callback never decided or visits were left when training stopped.
        """
        if not self.done:
            raise RuntimeError(
                f"the sweep did not finish its visits in {steps} steps ({len(self.visits)} run, "
                f"{len(self._plan)} left): raise SweepJob.steps"
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._plan and not self.visits:
            if not self.dynmo.rebalances:
                return
            trainer.callbacks.remove(self.dynmo)  # no more windows or hooks: the visits time bare steps
            names = list(self.placements)
            choice = str(self.dynmo.rebalances[-1].new)
            names += [choice] if choice not in names else []
            self._plan = [p for c in range(self.sweep.cycles) for p in harness.rotated(names, c)]
        elif self._left > 1:
            self._left -= 1
            return
        self._left = 0
        if not self._plan:
            trainer.should_stop = True
            return
        placement = self._plan.pop(0)
        trainer.strategy.apply_placement(placement)  # type: ignore[attr-defined]
        # This step's interval carries the move: the visit's first settle step. The next move waits
        # for the end of the step after the last timed one, so no timed step carries a migration.
        first = batch_idx + self.sweep.settle
        self.visits.append((placement, list(range(first, first + self.sweep.measure))))
        self._left = self.sweep.settle + self.sweep.measure


def run_sweep_job(job: SweepJob) -> dict[str, Any]:
    """Body of one rank (started by :func:`benchmarks._lib.common.launch`)."""
    torch.set_num_threads(1)
    timer = StepTimer()
    window = ProfilingConfig(steps=PROFILE_STEPS, measure_comm=True)
    dynmo = DynMoCallback(min_gain=0.99, every_n_steps=PROFILE_FROM, profiling=window)
    sweep = PlacementSweep(dynmo, job.placements, job.sweep)
    strategy = DynMoStrategy(
        num_microbatches=job.base.sizes.microbatches, schedule=job.base.schedule, placement=job.base.placement
    )
    steps = job.steps()
    trainer = benchmark_trainer(strategy, [timer, dynmo, sweep], steps)
    trainer.fit(build_model(job.base), batches(job.base, steps))
    sweep.check_done(steps)
    decision = dynmo.rebalances[0]
    measured: dict[str, list[float]] = {}
    for placement, indices in sweep.visits:
        measured.setdefault(placement, []).append(statistics.median(timer.step_s[i] for i in indices))
    return {
        "step_s": timer.step_s,
        "placement": job.base.placement,
        "costs": dynmo.last_costs,
        "hardware": dynmo.last_hardware,
        "choice": str(decision.new),
        "predicted_gain": decision.predicted_gain,
        "per_op_s": decision.per_op_s,
        "visits_ms": {p: [1e3 * s for s in v] for p, v in measured.items()},
    }


def section(
    model: str, schedule: str, sizes: Sizes, sweep: Sweep
) -> tuple[str, list[float], list[float], bool]:
    """One (model, schedule) in ``sizes.rounds`` jobs: its table, |errors| (of the predicted ratios, of the
    predicted steps) and whether the predicted best measures within 5% of the measured best."""
    stages = 2 * resolve_schedule(schedule).stages_per_rank
    base = CalibrationJob(model, schedule, str(uniform(sizes.num_layers, stages)), sizes, profile=True)
    job = SweepJob(base, tuple(candidates(schedule, sizes.num_layers)), sweep)
    runs = harness.run_rounds(
        {"sweep": job},
        run_sweep_job,
        sizes.rounds,
        f"calibration sweep {model} {schedule}",
        start_method="fork",
    )["sweep"]
    names = list(dict.fromkeys(p for r in runs for p in r["visits_ms"]))
    # Per job: each placement's measured step (median of its visits), and its predicted step from the
    # job's own profile (the cost per action fitted on the steps before the window, as the callback
    # does). What a decision rests on is the ratio of a candidate's step to the profiled placement's:
    # that ratio times the profiled placement's measured step is the second prediction, free of how much
    # faster or slower the whole machine ran while profiling than during the visits.
    measured: dict[str, list[float]] = {p: [] for p in names}
    early: dict[str, list[float]] = {p: [] for p in names}
    fitted: dict[str, list[float]] = {p: [] for p in names}
    job_measured: list[dict[str, float]] = []
    job_predicted: list[dict[str, float]] = []
    for r in runs:
        visits = {p: statistics.median(v) for p, v in r["visits_ms"].items()}
        predicted_ = {p: predicted_ms(r, schedule, p, sizes.microbatches, sizes.skip) for p in visits}
        scale = visits[base.placement] / predicted_[base.placement]
        for p in visits:
            measured[p].append(visits[p])
            early[p].append(predicted_[p])
            # The reference's fitted step is its measured step by construction; say so exactly, as
            # predicted * (measured / predicted) can round a hair either side (and print as -0.0%).
            fitted[p].append(visits[p] if p == base.placement else predicted_[p] * scale)
        job_measured.append(visits)
        job_predicted.append(predicted_)
    lines = [
        f"### {model}, {schedule} ({len(runs)} jobs x {sweep.cycles} visits per placement, "
        f"{sweep.measure} timed steps a visit after {sweep.settle})",
        "",
        "| placement | measured (ms) | predicted (ms) | error | predicted ratio to the uniform split x "
        "its measured step (ms) | error | error per job | measured, jobs' range |",
        "|---|---|---|---|---|---|---|---|",
    ]
    errors, early_errors = [], []
    for p in names:
        meas, pred, fit = (statistics.median(v[p]) for v in (measured, early, fitted))
        early_errors.append(abs(pred - meas) / meas)
        if p != base.placement:  # the reference predicts its own visits: no error to count
            errors.append(abs(fit - meas) / meas)
        per_job = ", ".join(f"{(a - b) / b:+.0%}" for a, b in zip(fitted[p], measured[p], strict=True))
        spread = (max(measured[p]) - min(measured[p])) / meas
        lines.append(
            f"| `{p}` | {meas:.1f} | {pred:.1f} | {(pred - meas) / meas:+.1%} | {fit:.1f} | "
            f"{(fit - meas) / meas:+.1%} | {per_job} | {spread:.0%} |"
        )
    # Which placement is fastest, and what a choice gains, over all jobs (see pooled_steps).
    pooled = pooled_steps(job_measured, base.placement)
    pooled_predicted = pooled_steps(job_predicted, base.placement)
    best_predicted = min(names, key=pooled_predicted.__getitem__)
    best_measured = min(names, key=pooled.__getitem__)
    of_best = pooled[best_predicted] / pooled[best_measured]
    agree = of_best <= 1.05
    lines += [
        "",
        f"Predicted ratios to the uniform split: median |error| {statistics.median(errors):.1%}, worst "
        f"{max(errors):.1%} (the {len(errors)} other placements). Predicted steps: median "
        f"{statistics.median(early_errors):.1%}, worst {max(early_errors):.1%}. Predicted best "
        f"`{best_predicted}`, measured best `{best_measured}` (each job's steps over its uniform split's, "
        f"medians over the jobs): the predicted best measures {of_best:.2f}x the measured best "
        f"({'within' if agree else 'NOT within'} 5%).",
        "",
        parts_line(runs),
        "",
        *choice_lines(runs, base.placement, pooled),
    ]
    return "\n".join(lines), errors, early_errors, agree


def pooled_steps(jobs: list[dict[str, float]], reference: str) -> dict[str, float]:
    """Each placement's step over all jobs, as a ratio to each job's own ``reference`` step.

    ``jobs`` holds per job its step per placement it ran (every job runs ``reference``). A placement's
    pooled step is the median over the jobs that ran it of its step over that job's reference step,
    times the reference's median over all jobs. A callback's choice is visited only in the jobs that
    chose it, and one job can run every placement 10-20% faster or slower than the next: raw medians
    over different sets of jobs would rank the jobs, not the placements.
    """
    scale = statistics.median(job[reference] for job in jobs)
    names = dict.fromkeys(p for job in jobs for p in job)
    return {p: scale * statistics.median(job[p] / job[reference] for job in jobs if p in job) for p in names}


def choice_lines(runs: list[dict[str, Any]], uniform_split: str, pooled: dict[str, float]) -> list[str]:
    """Per job, the callback's choice: its predicted gain against the gain measured, two ways.

    In its own job: the uniform split's visits against the choice's, and the choice against the job's
    fastest placement. Over all jobs (``pooled``: :func:`pooled_steps` of the visits), as the issue
    measured its runs: each run's choice against the best placement measured in every job's
    interleaved visits, and its predicted gain against the gain those give.
    """
    best = min(pooled.values())
    lines = [
        "The callback's own choice from the uniform split, judged in its own job (measured gain: the "
        "uniform split's visits against the choice's) and against every job's visits (each placement's "
        "step over its job's uniform split, median over the jobs):",
        "",
        "| job | choice | predicted gain | measured gain | choice / job's measured best "
        "| measured gain, all jobs | choice / measured best, all jobs |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    close = within = close_all = within_all = 0
    for j, run in enumerate(runs):
        steps = {p: statistics.median(v) for p, v in run["visits_ms"].items()}
        gain = 1 - steps[run["choice"]] / steps[uniform_split]
        of_best = steps[run["choice"]] / min(steps.values())
        gain_all = 1 - pooled[run["choice"]] / pooled[uniform_split]
        of_best_all = pooled[run["choice"]] / best
        close += abs(run["predicted_gain"] - gain) <= 0.05
        within += of_best <= 1.05
        close_all += abs(run["predicted_gain"] - gain_all) <= 0.05
        within_all += of_best_all <= 1.05
        lines.append(
            f"| {j + 1} | `{run['choice']}` | {run['predicted_gain']:+.1%} | {gain:+.1%} | {of_best:.3f} "
            f"| {gain_all:+.1%} | {of_best_all:.3f} |"
        )
    n = len(runs)
    lines += [
        "",
        f"In its own job: choice within 5% of the job's measured best in {within} of {n} jobs; predicted "
        f"gain within 5 points of the measured in {close} of {n}. Against every job's visits: choice "
        f"within 5% of the measured best in {within_all} of {n}; predicted gain within 5 points in "
        f"{close_all} of {n}.",
    ]
    return lines


def main(argv: list[str] | None = None) -> str:
    """Run the sweeps, print and write the report; return it."""
    parser = harness.argument_parser(__doc__, "tiny models, one job", "rounds")
    parser.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    args = parser.parse_args(argv)
    sizes, sweep = (QUICK, QUICK_SWEEP) if args.quick else (replace(FULL, rounds=3), FULL_SWEEP)
    if args.rounds is not None:
        sizes = replace(sizes, rounds=args.rounds)
    out = results_path("calibration_sweep", args.out, args.force)
    started = time.perf_counter()
    sections = [
        harness.header("Step model calibration inside one job", "calibration_sweep", argv, [harness.REAL])
    ]
    all_errors: list[float] = []
    all_early: list[float] = []
    agreements = []
    for model in args.model:
        for schedule in args.schedule:
            text, errors, early, agree = section(model, schedule, sizes, sweep)
            sections.append(text)
            all_errors += errors
            all_early += early
            agreements.append(agree)
    sections.append(
        f"Predicted ratios to the uniform split, over the {len(all_errors)} other placements: median "
        f"|error| {statistics.median(all_errors):.1%}, worst {max(all_errors):.1%}. Predicted steps, over "
        f"all {len(all_early)}: median {statistics.median(all_early):.1%}, worst {max(all_early):.1%}. "
        f"The predicted best within 5% of the measured best in "
        f"{sum(agreements)} of {len(agreements)} (model, schedule) pairs."
    )
    report = "\n\n".join(sections)
    harness.finish("calibration_sweep", out, sections, started)
    return report


if __name__ == "__main__":
    main()
