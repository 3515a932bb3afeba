"""What attaching DynMoCallback costs a real-compute pipeline that never moves, against no callback.

One fixed 2-stage split of a dense GPT (the end-to-end benchmark's sizes) on 2 gloo CPU ranks, 1F1B, real
compute, three jobs per round, interleaved over ``--rounds`` rounds (order reversed every other round):

- ``no callback``: the placement alone;
- ``DynMo idle``: ``DynMoCallback(every_n_steps=10_000)``: its always-on parts only (the busy timer, one
  small all-gather a step), no profiling window in the run;
- ``DynMo every step``: ``DynMoCallback(every_step=True, min_gain=0.1)``, by measured time as the MoE,
  MoD and sparse-attention cases run it, with its default ``skip_balanced``: a step opens a profiling
  window and decides only while the averaged stage loads leave ``min_gain`` to gain;
- ``DynMo every step, no skipping``: the same with ``skip_balanced=False``: a profiling window and a
  decision at every step, whatever the loads. ``min_gain`` 0.1 keeps both from moving a layer of the
  balanced split on step-to-step noise, so what they add is the profiling and the decisions.

A job's figure is the median of its steps after ``--skip``; a configuration's, the median over rounds. The
report also gives the callback's own account (``overhead_s`` per measured step) beside the measured
difference, since the two can disagree. Real compute; no emulated cost.

    python -m benchmarks.callback_cost             # 5 rounds, ~4 minutes on 2 quiet cores
    python -m benchmarks.callback_cost --quick     # a smoke run (tiny model, one round): not figures

The report goes to ``benchmarks/results/callback_cost-<date>.md`` with the command (``--out`` elsewhere;
an existing dated file is kept unless ``--force``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import launch, results_path, write_report
from benchmarks.e2e import FULL, QUICK, Sizes, interleaved
from benchmarks.gpt_pipeline import JobSpec, median_ms, run_job
from lightning_dynmo.models import GPTConfig

PLACEMENT = "0-3|4-7"  # 8 blocks, the uniform split
# By measured time, as the every-step cases run it; min_gain 0.1 so that step-to-step noise on a balanced
# split never moves a layer (the comparison needs a fixed split).
MIN_GAIN = 0.1
EVERY_STEP: dict[str, Any] = {"every_step": True, "cost": "time", "min_gain": MIN_GAIN}
QUICK_MIN_GAIN = 0.5  # the smoke run's tiny blocks are mostly fixed cost: a wide margin against moving
QUICK_PLACEMENT = "0-1|2-3"  # 4 blocks


def jobs(
    config: GPTConfig, placement: str, steps: int, skip: int, sizes: Sizes, min_gain: float
) -> dict[str, JobSpec]:
    """The four configurations, each one job of ``steps`` steps at ``placement``."""
    every_step = {**EVERY_STEP, "min_gain": min_gain}
    base = JobSpec(
        kind="dynmo",
        config=config,
        steps=steps,
        batch_size=sizes.batch_size,
        num_microbatches=sizes.microbatches,
        placement=placement,
    )
    return {
        "no callback": replace(
            base,
            kind="sweep",
            candidates=(placement,),
            lead_steps=skip,
            warm_steps=0,
            measure_steps=steps - skip,
            repeats=1,
        ),
        "DynMo idle": replace(base, callback={"every_n_steps": 10_000}),
        "DynMo every step": replace(base, callback=every_step),
        "DynMo every step, no skipping": replace(base, callback={**every_step, "skip_balanced": False}),
    }


def measure(specs: dict[str, JobSpec], placement: str, skip: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Per configuration: the median step (ms) over rounds, each round's, and the callback's own account."""
    per_round: dict[str, list[float]] = {name: [] for name in specs}
    own_ms: dict[str, list[float]] = {name: [] for name in specs}
    decisions: dict[str, list[int]] = {name: [] for name in specs}
    for r in range(rounds):
        for name in interleaved(list(specs), r):
            print(f"[callback_cost] round {r + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
            run = launch(run_job, specs[name], start_method="fork")
            steps = run["sweep_s"][placement] if name == "no callback" else run["step_s"][skip:]
            per_round[name].append(median_ms(steps))
            if name != "no callback":  # the callback's overhead_s covers the whole run: per step
                own_ms[name].append(1e3 * run["overhead_s"] / len(run["step_s"]))
                decisions[name].append(run["decisions"])
            if run.get("moved_to"):
                raise RuntimeError(
                    f"{name} moved layers (to {run['moved_to']}): the comparison needs a fixed split"
                )
    return {
        name: {
            "ms": statistics.median(values),
            "rounds": values,
            "own_ms": statistics.median(own_ms[name]) if own_ms[name] else 0.0,
            "decisions": statistics.median(decisions[name]) if decisions[name] else 0,
        }
        for name, values in per_round.items()
    }


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    base = rows["no callback"]["ms"]
    out = [
        "| run | step (ms) | this / no callback | per round (ms) | the callback's own account (ms a step) "
        "| decisions a job |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, row in rows.items():
        rounds = ", ".join(f"{v:.1f}" for v in row["rounds"])
        own = "-" if name == "no callback" else f"{row['own_ms']:.2f}"
        made = "-" if name == "no callback" else f"{row['decisions']:g}"
        out.append(f"| {name} | {row['ms']:.1f} | {row['ms'] / base:.3f} | {rounds} | {own} | {made} |")
    return out


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)  # the ranks are forked from this process (common.launch)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model and one round: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=None, help="steps per job")
    parser.add_argument("--skip", type=int, default=None, help="first steps of a job not measured")
    parser.add_argument("--out", type=Path, default=None, help="report path (default: dated results file)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing dated results file")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    placement = QUICK_PLACEMENT if args.quick else PLACEMENT
    steps = args.steps or (8 if args.quick else 24)
    skip = args.skip if args.skip is not None else (3 if args.quick else 8)
    rounds = args.rounds or (1 if args.quick else 5)
    if skip < 1 or steps - skip < 2:
        parser.error(f"--steps {steps} --skip {skip}: skip at least 1 step and measure at least 2")
    out = results_path("callback_cost", args.out, args.force)
    started = time.perf_counter()
    config = GPTConfig(vocab_size=256, blocks="dense", **sizes.shape)
    min_gain = QUICK_MIN_GAIN if args.quick else MIN_GAIN
    rows = measure(jobs(config, placement, steps, skip, sizes, min_gain), placement, skip, rounds)
    command = "python -m benchmarks.callback_cost " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = "\n\n".join(
        [
            f"## What DynMoCallback costs a pipeline that never moves ({dt.date.today().isoformat()})",
            f"Command: `{command.strip()}`  ",
            f"Dense GPT: {sizes.num_layers} blocks, d_model {sizes.d_model}, {sizes.num_heads} heads, "
            f"seq_len {sizes.seq_len}; batch {sizes.batch_size} in {sizes.microbatches} micro-batches; "
            f"fixed split `{placement}`, 1F1B on 2 CPU ranks (gloo, one thread each, pinned to their "
            f"cores). Real compute. {rounds} interleaved round(s) of {steps} steps per job, medians of "
            f"steps {skip}+. The every-step jobs decide by measured time with min_gain {min_gain:g}.",
            "\n".join(table(rows)),
            f"Wall time of the whole benchmark: {time.perf_counter() - started:.0f} s.",
        ]
    )
    write_report(report, "callback_cost", out)


if __name__ == "__main__":
    main()
