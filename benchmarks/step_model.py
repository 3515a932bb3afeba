"""The step model against measured steps where the true costs are known: emulated-cost pipelines.

Issue 19 asks the schedule model (:func:`lightning_dynmo.balancing.step_prediction.predict_step`, torch's
own action lists) to predict a measured step within 2% on emulated pipelines of 4 and 8 ranks under
1F1B, Interleaved1F1B and ZBVZeroBubble. Each block of a :class:`~lightning_dynmo.demos.DemoGPT` sleeps a
known time forward and backward (:class:`~lightning_dynmo.demos.EmulatedCost`, no CPU), so the model's
inputs are exact and only the model, and what it leaves out, can miss.

Per (ranks, schedule), one job of that many gloo ranks:

1. ``warmup_steps`` untimed steps at the first candidate (the uniform split): the first steps of a job
   run slower than its later ones.
2. ``--rounds`` rounds visiting each candidate placement (``--warm`` untimed steps after the migration,
   ``--measure`` timed): the uniform split (the calibration's placement), the exact min-max partition of
   the true costs, the schedule model's best
   (:func:`~lightning_dynmo.balancing.step_prediction.refine`) and a skewed split.
3. What the runtime costs besides the layers' sleeps and the blocks' own compute (timed in this process
   for each stage size, as the schedule runs a stage: :func:`stage_compute_ms`) is found as the cost per
   action (``per_op_s``) at which the schedule model reproduces the uniform split's median step in the
   rounds (:func:`~lightning_dynmo.balancing.step_prediction.fit_per_op`): sends, receives, the
   schedule's bookkeeping, as they cost where the runtime really runs the pipeline, and on the machine
   as it is while the other candidates run. The other candidates are predicted with it and compared;
   DynMo's policy fits it the same way on the placement it runs.

Earlier versions fitted ``per_op_s`` on steps whose blocks slept nothing (every rank then computes at
once and queues for the 2 cores: errors up to +4.4% at 8 ranks, ``results/step_model-2026-11-26.md``),
then on the warm-up steps before the rounds (other steps than the compared ones, under other
conditions: the fit now uses the same rounds, and the report prints the warm-up's median beside it).

For each candidate it prints the predicted step from the sleeps as asked (no overhead), the predicted
step with what the run measured (each layer's sleep as it took, a sleep waking late on a busy machine,
:data:`~lightning_dynmo.demos.cost.SLEEPS` per rank as that worker's slowdown; plus its block's own
compute; plus ``per_op_s`` an action), the measured median and the error, and which candidate each
ranks first; the errors are summarised over the candidates other than the calibration's placement.
ZBVZeroBubble splits backward into input and weight gradients: an emulated block sleeps in
its input gradient only (its sleep sits on the input's path), and its weight gradient costs what torch's
weight-gradient pass measured on the block's real compute (:func:`stage_compute_ms`). Sleeps are
``--scale`` times a fixed pattern (2-8 ms forward per micro-batch at 1.0), so the runtime's own cost is
a small part of a step. **Emulated cost.**

    python -m benchmarks.step_model            # 4 and 8 ranks x 3 schedules: ~15 minutes on 2 cores
    python -m benchmarks.step_model --quick    # smoke run (2 ranks, 1F1B, one round): not figures

The report goes to ``benchmarks/results/step_model-<date>.md``; an existing file is kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# torch's own backward passes under zero-bubble schedules (what its stage calls), to time a stage's
# compute as the schedule runs it; private in torch 2.13.
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from benchmarks._lib.common import (
    SleepsOfEveryRank,
    StepTimer,
    benchmark_trainer,
    command_line,
    launch,
    results_path,
    write_report,
)
from benchmarks._lib.gpt_pipeline import PlacementSweep, visit_schedule
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.balancing import BalanceProblem, LayerCost, Placement, partition, uniform
from lightning_dynmo.balancing.hardware import Hardware
from lightning_dynmo.balancing.step_prediction import ScheduleOrder, fit_per_op, predict_step, refine
from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
from lightning_dynmo.pipeline import schedule_order, stage_to_pipeline_rank
from lightning_dynmo.pipeline.step.schedule import resolve_schedule

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
#: A block timed alone sleeps this: not 0, so it runs the same code (an autograd function and a sleep
#: call) as with its cost, and only the cost is missing.
TINY_MS = 1e-6
#: Forward sleep of each block per micro-batch, ms, cycled over the layers (backward sleeps twice).
PATTERN_MS = (2.0, 3.0, 5.0, 8.0, 3.0, 2.0, 6.0, 4.0)
#: What a block computes before its sleep: one linear (a seventh of a tiny dense block's CPU time). Up
#: to 8 ranks share 2 cores, and a block's real compute, timed alone, is the one input of the model that
#: is not known exactly; the less of it, the less it matters. With dense blocks the skewed splits, one
#: rank holding most blocks, measured 0.5-2.6% slower than predicted (``step_model-2026-11-26-calibrated``);
#: with linear blocks (and each stage size timed) 0.7-1.9% (``results/step_model-2026-11-27.md``).
BLOCK_COMPUTE = "linear"
#: A block's own compute on one micro-batch, ms: forward, backward, the backward's weight-gradient part.
LayerMs = tuple[float, float, float]


@dataclass(frozen=True)
class Options:
    """How long each part of a job runs."""

    warmup_steps: int = 5
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

    def costs(self, compute_ms: Sequence[LayerMs] | None = None) -> list[LayerCost]:
        """Per layer, one step's sleep (all micro-batches) plus ``compute_ms[i]``, its block's own compute
        per micro-batch (forward, backward, the backward's weight-gradient part; none by default), seconds."""
        m = self.microbatches
        compute = compute_ms if compute_ms is not None else [(0.0, 0.0, 0.0)] * len(self.fwd_ms)
        return [
            LayerCost(
                fwd_time_s=m * (f + cf) / 1e3,
                bwd_time_s=m * (2 * f + cb) / 1e3,
                bwd_weight_time_s=m * cw / 1e3,
            )
            for f, (cf, cb, cw) in zip(self.fwd_ms, compute, strict=True)
        ]

    def model(self) -> DemoGPT:
        """The job's DemoGPT (tiny real blocks, each one linear followed by its sleep)."""
        return DemoGPT(
            num_layers=len(self.fwd_ms),
            sleep_ms=list(self.fwd_ms),
            d_model=16,
            vocab_size=32,
            seq_len=8,
            block_compute=BLOCK_COMPUTE,
        )


def stage_compute_ms(job: StepModelJob, layers: int, repeats: int = 40) -> LayerMs:
    """A stage of ``layers`` blocks' own compute on one micro-batch, per layer, ms (medians, in this
    process): forward, backward and the backward's weight-gradient part, with each block's sleep set aside
    (its code runs: an autograd function, a sleep call).

    The backward runs as the job's schedule runs it: one pass for 1F1B and Interleaved1F1B; for
    ZBVZeroBubble torch's own input-gradient pass, then its weight-gradient pass, which calls autograd
    once per parameter group, each call walking the stage's graph: with dense blocks a stage's forward and
    split backward cost 4.0 ms a block at 17 blocks against 2.5 at 4 (one thread, 2026-11-27), so a
    block timed alone understates a long stage under ZBV. Timed per stage size, a block costs what it
    costs in the stages the candidates have.
    """
    torch.set_num_threads(1)
    model = job.model()
    blocks = [model.layers[str(i)] for i in range(layers)]
    for block in blocks:
        block.cost.fwd_ms = block.cost.bwd_ms = TINY_MS  # type: ignore[union-attr]  # its code, no sleep
    params = [p for block in blocks for p in block.parameters()]
    split = _splits_backward(job)
    fwd, bwd, wgrad = [], [], []
    for _ in range(repeats):
        x = torch.randn(1, 8, 16, requires_grad=True)
        start = time.perf_counter()
        out = x
        for block in blocks:
            out = block(out)
        middle = time.perf_counter()
        weight_s = 0.0
        if split:
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
            weight_start = time.perf_counter()
            stage_backward_weight(iter(params), groups)
            weight_s = time.perf_counter() - weight_start
        else:
            out.backward(torch.ones_like(out))
        fwd.append(middle - start)
        bwd.append(time.perf_counter() - middle)
        wgrad.append(weight_s)
    per_layer = 1e3 / layers
    return (
        per_layer * statistics.median(fwd),
        per_layer * statistics.median(bwd),
        per_layer * statistics.median(wgrad),
    )


def _splits_backward(job: StepModelJob) -> bool:
    """Whether the job's schedule runs weight gradients as actions of their own (torch's action lists)."""
    actions = schedule_order(job.schedule).actions(job.num_stages, job.microbatches)
    return any(kind == "W" for rank in actions for _, kind, _ in rank)


def stage_sizes(job: StepModelJob) -> list[int]:
    """Every stage size among the job's candidates (the block compute is timed once for each)."""
    return sorted(
        {len(Placement.from_string(c).layers_of(s)) for c in job.candidates for s in range(job.num_stages)}
    )


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


def run_job(job: StepModelJob) -> dict[str, Any]:
    """Body of one rank (started by ``benchmarks._lib.common.launch``)."""
    torch.set_num_threads(1)
    o = job.options
    sweep = visit_schedule(job.candidates, o.warm, o.measure, o.rounds, lead_steps=1)
    schedule = [(job.candidates[0], False)] * o.warmup_steps + sweep
    timer = StepTimer()
    strategy = DynMoStrategy(
        num_microbatches=job.microbatches, schedule=job.schedule, placement=job.candidates[0]
    )
    sleeps = SleepsOfEveryRank()
    callbacks = [timer, PlacementSweep(schedule), sleeps]
    trainer = benchmark_trainer(strategy, callbacks, len(schedule), devices=job.ranks)
    model = job.model()
    m = job.microbatches
    trainer.fit(
        model, RandomTokenDataModule(batch_size=m, num_samples=m * len(schedule), seq_len=8, vocab_size=32)
    )
    warmup = timer.step_s[1 : o.warmup_steps]  # the first step builds the pipeline
    timed: dict[str, list[float]] = {}
    for (placement, is_timed), step_s in zip(sweep, timer.step_s[o.warmup_steps :], strict=True):
        if is_timed:
            timed.setdefault(placement, []).append(step_s)
    return {"warmup_s": warmup, "timed_s": timed, "overshoot": sleeps.overshoot}


def per_op_overhead(
    job: StepModelJob, calibration_step_s: float, overshoot: Sequence[float], stage_ms: Mapping[int, LayerMs]
) -> float:
    """Seconds per action: the one at which the schedule model reproduces the calibration's median step
    at the first candidate (its sleeps as they took, its stages' own compute)."""
    problem, placement, order, workers = _prediction_inputs(job, job.candidates[0], overshoot, stage_ms)
    return fit_per_op(problem, placement, order, job.microbatches, calibration_step_s, workers)


def _prediction_inputs(
    job: StepModelJob,
    placement: str,
    overshoot: Sequence[float] | None,
    stage_ms: Mapping[int, LayerMs] | None,
) -> tuple[BalanceProblem, Placement, ScheduleOrder, list[int]]:
    p, order = Placement.from_string(placement), _order(job.schedule)
    style = resolve_schedule(job.schedule).style
    workers = [stage_to_pipeline_rank(s, p.num_stages, job.ranks, style) for s in range(p.num_stages)]
    compute = None
    if stage_ms is not None:  # each layer costs what a block costs in a stage of its stage's size
        compute = [stage_ms[len(p.layers_of(s))] for s in range(p.num_stages) for _ in p.layers_of(s)]
    problem = BalanceProblem(
        job.costs(compute), hardware=Hardware(worker_slowdown=list(overshoot) if overshoot else None)
    )
    return problem, p, order, workers


def predicted_ms(
    job: StepModelJob,
    placement: str,
    per_op_s: float,
    overshoot: Sequence[float] | None = None,
    stage_ms: Mapping[int, LayerMs] | None = None,
) -> float:
    """The schedule model's step of ``placement``, ms: each layer costs its sleep plus its block's own
    compute in a stage of its stage's size (``stage_ms``, from :func:`stage_compute_ms`; none by
    default), rank ``r``'s time ``overshoot[r]`` times as long (its sleeps woke that late: a worker
    slowdown), ``per_op_s`` added to every action."""
    problem, p, order, workers = _prediction_inputs(job, placement, overshoot, stage_ms)
    step = predict_step(problem, p, order, job.microbatches, stage_workers=workers, per_op_s=per_op_s)
    return 1e3 * step.step_s


def job_section(job: StepModelJob, result: dict[str, Any]) -> tuple[list[str], list[float]]:
    """The table of one job and its errors (fractions) over the candidates other than the calibration's
    placement (whose measured steps the cost per action is fitted on)."""
    calibration, overshoot, stage_ms = (
        statistics.median(result["timed_s"][job.candidates[0]]),
        result["overshoot"],
        result["stage_ms"],
    )
    per_op = per_op_overhead(job, calibration, overshoot, stage_ms)
    warmup = statistics.median(result["warmup_s"])
    compute = "; ".join(
        f"{k} block(s) {f:.2f} + {b:.2f}" + (f" (weight gradient {w:.2f})" if w > 0 else "")
        for k, (f, b, w) in sorted(stage_ms.items())
    )
    lines = [
        f"### {job.ranks} ranks, {job.schedule} ({job.num_stages} stages, {len(job.fwd_ms)} layers, "
        f"{job.microbatches} micro-batches)",
        "",
        f"Calibration: `{job.candidates[0]}` stepped {1e3 * calibration:.1f} ms in the rounds (median of "
        f"{len(result['timed_s'][job.candidates[0]])}; its warm-up steps before the rounds: "
        f"{1e3 * warmup:.1f} ms); a block's own compute a micro-batch, forward + backward ms per "
        f"block in a stage of: {compute}; the model matches that step at {1e3 * per_op:.3f} ms per action. "
        "Sleeps took "
        f"{min(overshoot):.3f}-{max(overshoot):.3f}x what they asked (per rank).",
        "",
        "| placement | predicted from the asked sleeps, no overhead (ms) | predicted (ms) | measured (ms) "
        "| error |",
        "|---|---|---|---|---|",
    ]
    others, measured, predicted = [], {}, {}
    for name in job.candidates:
        measured[name] = 1e3 * statistics.median(result["timed_s"][name])
        predicted[name] = predicted_ms(job, name, per_op, overshoot, stage_ms)
        error = (predicted[name] - measured[name]) / measured[name]
        if name != job.candidates[0]:
            others.append(error)
        bare = predicted_ms(job, name, 0.0)
        mark = " (calibration's placement: fitted)" if name == job.candidates[0] else ""
        lines.append(
            f"| `{name}`{mark} | {bare:.1f} | {predicted[name]:.1f} | {measured[name]:.1f} | {error:+.1%} |"
        )
    best_p, best_m = min(predicted, key=predicted.__getitem__), min(measured, key=measured.__getitem__)
    lines += ["", f"Predicted best `{best_p}`, measured best `{best_m}`.", ""]
    return lines, others


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
        options, shapes = Options(warmup_steps=3, warm=1, measure=1, rounds=1, scale=1.0), [("1F1B", 2)]
    out = results_path("step_model", args.out, args.force)
    torch.set_num_threads(1)
    command = command_line("step_model", argv)
    lines = ["# The step model against measured steps (emulated cost)", "", f"Command: `{command}`", ""]
    errors: list[float] = []
    for schedule, ranks in shapes:
        job = job_for(schedule, ranks, options)
        result = launch(run_job, job, nproc=ranks, start_method="fork")
        result["stage_ms"] = {k: stage_compute_ms(job, k) for k in stage_sizes(job)}
        section, others = job_section(job, result)
        lines += section
        errors += [abs(e) for e in others]
        print("\n".join(section), flush=True)
    lines += [
        f"Over the {len(errors)} placements other than the calibrations': median |error| "
        f"{statistics.median(errors):.1%}, worst {max(errors):.1%}.",
        "",
    ]
    report = "\n".join(lines)
    write_report(report, "step_model", out)
    return report


if __name__ == "__main__":
    main()
