"""Calibration on real compute: the step DynMo predicts for each fixed placement against the step it measures.

Issue 19's first check. Two models whose head and loss cost several blocks (what makes the first
placement DynMo trusts matter): our GPT with a large vocabulary (``gpt``) and a Hugging Face GPT-2 with an
untied head (``gpt2``), 8 blocks each, on a real 2-rank gloo CPU pipeline, one torch thread per rank.
Two schedules: ``1F1B`` (2 stages: every split of the blocks) and ``ZBVZeroBubble`` (4 stages, two per
rank: the uniform split, every split one boundary-move from it and the callback's own choice, found by
one profile job before the rounds).

Per (model, schedule), interleaved rounds (:func:`benchmarks.harness.run_rounds`, the job order rotated):

- a **profile** job at the uniform split: ``DynMoCallback(min_gain=0.99)`` profiles one window (its
  blocks, first and last parts, links) and moves nothing; its costs give each placement's prediction
  (:func:`lightning_dynmo.balancing.step_prediction.predict_step` on torch's action lists). The runtime's
  own cost per action (``per_op_s``) is what the profile job's steady steps before its window (from
  ``skip``: the first steps run slower, and the compared jobs are measured from ``skip`` too) took
  beyond their prediction, spread over the actions
  (:func:`~lightning_dynmo.balancing.step_prediction.per_action_s`): fitted on the profile job's own
  run of the uniform split, never on the compared jobs. A fresh profile in each round: the prediction
  is a median over rounds, as the measurement is;
- one **fixed** job per candidate placement: its median step after ``--skip``;
- the **repeat control**: the uniform split again, as its own job. How far its median lies from the
  first one's is what two measurements of one placement disagree by on this machine: the noise floor
  under the errors.

The report prints per placement the predicted and measured steps, the error and the measured step's
range over the rounds, then the median and the worst |error|, the repeat control, and which placement
each ranks first (the measured best held out of the round it judges,
:func:`benchmarks.paired.held_out_best`). **Real compute.**

    python -m benchmarks.calibration                  # both models x both schedules: ~40 min, 2 quiet cores
    python -m benchmarks.calibration --model gpt --schedule 1F1B
    python -m benchmarks.calibration --quick          # smoke run (tiny, one round): not figures
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from benchmarks import harness, paired
from benchmarks.common import StepTimer, benchmark_trainer, launch, results_path
from lightning_dynmo.balancing import BalanceProblem, Placement, uniform
from lightning_dynmo.balancing.hardware import whole_backward_ratio
from lightning_dynmo.balancing.step_prediction import per_action_s, predict_step
from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.pipeline import schedule_order
from lightning_dynmo.pipeline.step.schedule import resolve_schedule
from lightning_dynmo.strategy import DynMoStrategy

MODELS = ("gpt", "gpt2")
PROFILE_FROM = 11  # a profile job's steps from ``skip`` to 10 (no hooks yet) measure the runtime's own cost
PROFILE_STEPS = 3  # then one window of this many profiled steps
SCHEDULES = ("1F1B", "ZBVZeroBubble")
REPEAT = "uniform (repeat)"  # the repeat control's job name


@dataclass(frozen=True)
class Sizes:
    """A mode's sizes: the models' shape, the batches and how long jobs run."""

    num_layers: int = 8
    d_model: int = 128
    num_heads: int = 4
    seq_len: int = 64
    vocab_size: int = 8192
    batch_size: int = 8
    microbatches: int = 4
    steps: int = 16
    skip: int = 4  # steps before the steady state (also before a profile job's per-action fit)
    rounds: int = 3


FULL = Sizes()
QUICK = Sizes(num_layers=4, d_model=16, num_heads=2, seq_len=8, vocab_size=256, steps=16, skip=2, rounds=1)


@dataclass(frozen=True)
class CalibrationJob:
    """One 2-rank job: ``model`` under ``schedule`` at ``placement``; ``profile`` runs the static callback."""

    model: str
    schedule: str
    placement: str
    sizes: Sizes
    profile: bool = False
    lr: float = 1e-3  # a rate that learns; the times should not depend on it
    seed: int = 0


def build_model(job: CalibrationJob) -> pl.LightningModule:
    """The job's model, fresh weights from ``job.seed``."""
    s = job.sizes
    if job.model == "gpt":
        torch.manual_seed(job.seed)
        config = GPTConfig(
            vocab_size=s.vocab_size,
            seq_len=s.seq_len,
            num_layers=s.num_layers,
            d_model=s.d_model,
            num_heads=s.num_heads,
        )
        return GPT(config, OptimizerConfig(lr=job.lr))
    # The Hugging Face adapter is an optional extra: imported only for this model.
    from transformers import GPT2Config

    from lightning_dynmo.models.huggingface import HuggingFaceCausalLM

    config = GPT2Config(
        vocab_size=s.vocab_size,
        n_positions=s.seq_len,
        n_embd=s.d_model,
        n_layer=s.num_layers,
        n_head=s.num_heads,
        tie_word_embeddings=False,
    )
    return HuggingFaceCausalLM(config, attn_implementation="sdpa", seed=job.seed, lr=job.lr)


def batches(job: CalibrationJob, steps: int) -> DataLoader[Any]:
    """``steps`` batches of random tokens from ``job.seed``, in the shape ``job.model`` takes."""
    s = job.sizes
    gen = torch.Generator().manual_seed(job.seed)
    rows = torch.randint(0, s.vocab_size, (steps * s.batch_size, s.seq_len + 1), generator=gen)
    if job.model == "gpt":
        return DataLoader(list(rows), batch_size=s.batch_size)
    items = [{"input_ids": r[:-1], "labels": r[1:]} for r in rows]
    return DataLoader(items, batch_size=s.batch_size)  # type: ignore[arg-type]


def run_calibration_job(job: CalibrationJob) -> dict[str, Any]:
    """Body of one rank (started by :func:`benchmarks.harness.run_rounds`)."""
    torch.set_num_threads(1)
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    dynmo = None
    if job.profile:  # one window after PROFILE_FROM steps; static: it decides, never moves
        window = ProfilingConfig(steps=PROFILE_STEPS, measure_comm=True)
        # It profiles and decides; a 99% minimum gain keeps the placement (a static balancer never profiles).
        dynmo = DynMoCallback(min_gain=0.99, every_n_steps=PROFILE_FROM, profiling=window)
        callbacks.append(dynmo)
    strategy = DynMoStrategy(
        num_microbatches=job.sizes.microbatches, schedule=job.schedule, placement=job.placement
    )
    trainer = benchmark_trainer(strategy, callbacks, job.sizes.steps)
    trainer.fit(build_model(job), batches(job, job.sizes.steps))
    report: dict[str, Any] = {"step_s": timer.step_s, "placement": str(strategy.placement)}
    if dynmo is not None:
        report["costs"], report["hardware"] = dynmo.last_costs, dynmo.last_hardware
        decision = dynmo.rebalances[-1]  # decided from the uniform split, never applied (min_gain 0.99)
        report["choice"], report["predicted_gain"] = decision.new, decision.predicted_gain
        report["per_op_s"] = decision.per_op_s  # the runtime's cost per action the decision measured
    return report


def candidates(schedule: str, num_layers: int) -> list[str]:
    """Every 2-stage split under a one-stage-per-rank schedule; else uniform and its one-move neighbours."""
    stages = 2 * resolve_schedule(schedule).stages_per_rank
    base = uniform(num_layers, stages)
    if stages == 2:
        return [str(Placement((0, k, num_layers))) for k in range(1, num_layers)]
    out = [str(base)]
    bounds = base.boundaries
    for i in range(1, stages):
        for delta in (-1, 1):
            moved = (*bounds[:i], bounds[i] + delta, *bounds[i + 1 :])
            if moved[i - 1] < moved[i] < moved[i + 1]:
                out.append(str(Placement(moved)))
    return out


def predicted_ms(
    report: dict[str, Any], schedule: str, placement: str, microbatches: int, skip: int
) -> float:
    """The step a profile job's costs predict for ``placement``, ms.

    The runtime's own cost per action is fitted on the profile job's steady steps before its window
    (``skip`` to ``PROFILE_FROM``): the first steps run slower (allocations, the optimizer's first
    state), and the compared jobs are measured after ``skip`` too.
    """
    problem, order = BalanceProblem(report["costs"], hardware=report["hardware"]), schedule_order(schedule)
    profiled = Placement.from_string(report["placement"])
    bare = predict_step(problem, profiled, order, microbatches, per_op_s=0.0).step_s  # not the callback's
    before_window = statistics.median(report["step_s"][skip:PROFILE_FROM])
    per_op = per_action_s(order, profiled.num_stages, microbatches, before_window - bare)
    step = predict_step(problem, Placement.from_string(placement), order, microbatches, per_op_s=per_op)
    return 1e3 * step.step_s


def choice_lines(
    profiles: list[dict[str, Any]], measured: dict[str, list[float]], uniform_split: str
) -> list[str]:
    """Per round, the callback's choice from the uniform split against the measured best and gain.

    The measured gain is the uniform split's step over the choice's, fixed, in the same round; the
    measured best is held out of the round it judges. A choice outside the measured candidates (a
    schedule with more stages than rank pairs: only the uniform split's neighbours are measured) is said.
    A round's measured gain carries the round's noise; the medians over rounds compare what the
    callback predicts with what the move gains on this machine.
    """
    rounds = len(profiles)
    best = paired.held_out_best(measured) if rounds > 1 else [min(measured, key=lambda p: measured[p][0])]
    lines = [
        "The callback's own choice from the uniform split (the profile job's decision, not applied; its "
        "prediction includes the runtime's cost per action the callback measured):",
        "",
        "| round | choice | per action (ms) | predicted gain | measured gain | choice / measured best |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    within = close = 0
    predicted_gains, measured_gains = [], []
    for r, report in enumerate(profiles):
        choice, predicted = report["choice"], report["predicted_gain"]
        per_op = f"{1e3 * report.get('per_op_s', 0.0):.3f}"
        if choice not in measured:
            lines.append(f"| {r + 1} | `{choice}` | {per_op} | {predicted:+.1%} | not measured | - |")
            continue
        gain = 1 - measured[choice][r] / measured[uniform_split][r]
        of_best = measured[choice][r] / measured[best[r]][r]
        within += of_best <= 1.05
        close += abs(predicted - gain) <= 0.05
        predicted_gains.append(predicted)
        measured_gains.append(gain)
        lines.append(f"| {r + 1} | `{choice}` | {per_op} | {predicted:+.1%} | {gain:+.1%} | {of_best:.3f} |")
    judged = len(measured_gains)
    lines += [
        "",
        f"Choice within 5% of the measured best in {within} of {judged} measured round(s); predicted gain "
        f"within 5 points of the measured in {close} of {judged}.",
    ]
    if judged:
        pred, meas = statistics.median(predicted_gains), statistics.median(measured_gains)
        verdict = "within" if abs(pred - meas) <= 0.05 else "NOT within"
        lines.append(
            f"Median over those rounds: predicted gain {pred:+.1%}, measured {meas:+.1%} "
            f"({verdict} 5 points)."
        )
        # The same choices against the placements' medians over every round: less noise than one job
        # against one job.
        base = statistics.median(measured[uniform_split])
        pooled = statistics.median(
            1 - statistics.median(measured[r["choice"]]) / base for r in profiles if r["choice"] in measured
        )
        verdict = "within" if abs(pred - pooled) <= 0.05 else "NOT within"
        lines.append(
            f"Each choice's gain from the placements' medians over all rounds (not one job against one): "
            f"median {pooled:+.1%} against the predicted {pred:+.1%} ({verdict} 5 points)."
        )
    return lines


def section(model: str, schedule: str, sizes: Sizes) -> tuple[str, list[float], bool]:
    """Run one (model, schedule) and write its table; also its |errors| and whether the best agree."""
    names = candidates(schedule, sizes.num_layers)
    stages = 2 * resolve_schedule(schedule).stages_per_rank
    base = CalibrationJob(model, schedule, str(uniform(sizes.num_layers, stages)), sizes)
    if stages > 2:  # only the uniform split's neighbours are candidates: measure the callback's choice too
        first = launch(run_calibration_job, replace(base, profile=True), nproc=2, start_method="fork")
        names += [first["choice"]] if first["choice"] not in names else []
    # The repeat control: the uniform split measured again as its own job in every round.
    jobs = {
        "profile": replace(base, profile=True),
        **{p: replace(base, placement=p) for p in names},
        REPEAT: base,
    }
    runs = harness.run_rounds(
        jobs, run_calibration_job, sizes.rounds, f"calibration {model} {schedule}", start_method="fork"
    )
    measured = {p: harness.step_ms(runs[p], sizes.skip) for p in names}
    repeat = harness.step_ms(runs[REPEAT], sizes.skip)
    predicted = {
        p: [predicted_ms(r, schedule, p, sizes.microbatches, sizes.skip) for r in runs["profile"]]
        for p in names
    }
    lines = [
        f"### {model}, {schedule} ({sizes.rounds} rounds, medians of steps {sizes.skip}+)",
        "",
        "| placement | predicted (ms) | measured (ms) | error | measured, rounds' range |",
        "|---|---|---|---|---|",
    ]
    errors = []
    for p in names:
        pred, meas = statistics.median(predicted[p]), statistics.median(measured[p])
        errors.append(abs(pred - meas) / meas)
        spread = (max(measured[p]) - min(measured[p])) / meas
        lines.append(f"| `{p}` | {pred:.1f} | {meas:.1f} | {(pred - meas) / meas:+.1%} | {spread:.0%} |")
    best_predicted = min(names, key=lambda p: statistics.median(predicted[p]))
    held_out = (
        paired.held_out_best(measured) if sizes.rounds > 1 else [min(names, key=lambda p: measured[p][0])]
    )
    of_best = [measured[best_predicted][r] / measured[held_out[r]][r] for r in range(sizes.rounds)]
    agree = statistics.median(of_best) <= 1.05
    lines += [
        "",
        f"Median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}. Predicted best "
        f"`{best_predicted}`; measured best (held out per round) {', '.join(f'`{p}`' for p in held_out)}; "
        f"the predicted best measures {statistics.median(of_best):.2f}x the measured best "
        f"({'within' if agree else 'NOT within'} 5%).",
        "",
        repeat_line(measured[base.placement], repeat),
        "",
        parts_line(runs["profile"]),
        "",
        *choice_lines(runs["profile"], measured, base.placement),
    ]
    return "\n".join(lines), errors, agree


def parts_line(profiles: list[dict[str, Any]]) -> str:
    """What makes the placements uneven: the head + loss and the embedding in blocks, as profiled.

    Per round, a part's forward + backward over the median block's, from the profile job's window; under
    a split-backward schedule also the whole-to-split backward ratio the step model takes from the profile
    (:func:`~lightning_dynmo.balancing.hardware.whole_backward_ratio`).
    """

    def blocks(part: str) -> list[float]:
        out = []
        for report in profiles:
            extra = getattr(report["hardware"], part)
            block = statistics.median(c.time_s for c in report["costs"])
            out.append(extra.time_s / block if extra is not None and block > 0 else float("nan"))
        return out

    head, emb = blocks("last_stage_extra"), blocks("first_stage_extra")
    line = (
        f"What makes the placements uneven, as profiled: head + loss = {statistics.median(head):.2f} blocks "
        f"(per round {min(head):.2f}-{max(head):.2f}), embedding = {statistics.median(emb):.2f} blocks."
    )
    ratios = [whole_backward_ratio(report["costs"]) for report in profiles]
    if any(r != 1.0 for r in ratios):  # measured both ways: a split-backward schedule
        line += (
            f" A block's backward run whole (the first stage's) costs {statistics.median(ratios):.2f}x its "
            f"split one (per round {min(ratios):.2f}-{max(ratios):.2f}), as the step model charges it."
        )
    return line


def repeat_line(first: list[float], again: list[float]) -> str:
    """How far two measurements of one placement (the uniform split, two jobs a round) disagree.

    The medians' difference is the noise floor of the table's errors: an error within it says nothing
    about the model. Per round, two jobs of one placement differ by more (one job's median of its steps).
    """
    a, b = statistics.median(first), statistics.median(again)
    per_round = [abs(x - y) / x for x, y in zip(first, again, strict=True)]
    typical, worst = statistics.median(per_round), max(per_round)
    return (
        f"Repeat control: the uniform split measured again in every round: median {b:.1f} ms against "
        f"{a:.1f} ({(b - a) / a:+.1%}); two jobs of it in one round differ by {typical:.1%} (median), "
        f"{worst:.1%} (worst)."
    )


def main(argv: list[str] | None = None) -> str:
    """Run the calibration, print and write the report; return it."""
    parser = harness.argument_parser(__doc__, "tiny models, one round", "rounds")
    parser.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.rounds is not None:
        sizes = replace(sizes, rounds=args.rounds)
    out = results_path("calibration", args.out, args.force)
    started = time.perf_counter()
    sections = [harness.header("Step model calibration", "calibration", argv, [harness.REAL])]
    all_errors: list[float] = []
    agreements = []
    for model in args.model:
        for schedule in args.schedule:
            text, errors, agree = section(model, schedule, sizes)
            sections.append(text)
            all_errors += errors
            agreements.append(agree)
    sections.append(
        f"Over all {len(all_errors)} placements: median |error| {statistics.median(all_errors):.1%}, worst "
        f"{max(all_errors):.1%}; the predicted best within 5% of the measured best in "
        f"{sum(agreements)} of {len(agreements)} (model, schedule) pairs."
    )
    report = "\n\n".join(sections)
    harness.finish("calibration", out, sections, started)
    return report


if __name__ == "__main__":
    main()
