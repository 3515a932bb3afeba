"""What attaching DynMoCallback costs a real-compute pipeline that never moves, against no callback.

One fixed 2-stage split of a dense GPT (the harness's full sizes) on 2 gloo CPU ranks, 1F1B, real
compute, four jobs per round, interleaved over ``--rounds`` rounds (order rotated every round,
:mod:`benchmarks._lib.harness`):

- ``no callback``: the placement alone;
- ``DynMo idle``: ``DynMoCallback(every_n_steps=10_000)``: its always-on parts only (the busy timer, one
  small all-gather a step), no profiling window in the run;
- ``DynMo every step``: ``DynMoCallback(every_step=True, min_gain=0.1)``, by measured time as the MoE,
  MoD and sparse-attention cases run it, with its default ``skip_balanced``: a step opens a profiling
  window and decides only while the averaged stage loads leave ``min_gain`` to gain;
- ``DynMo every step, no skipping``: the same with ``skip_balanced=False``: a profiling window and a
  decision at every step, whatever the loads. ``min_gain`` 0.1 keeps both from moving a layer of the
  balanced split on step-to-step noise, so what they add is the profiling and the decisions.

A job's figure is the median of its steps after ``--skip``; a configuration's, the median over rounds;
its ratio to no callback, the median of the ratios within a round. The
report also gives the callback's own account (``overhead_s`` per measured step) beside the measured
difference, since the two can disagree. Real compute; no emulated cost.

    python -m benchmarks.callback_cost             # 5 rounds, ~4 minutes on 2 quiet cores
    python -m benchmarks.callback_cost --quick     # a smoke run (tiny model, one round): not figures

The report goes to ``benchmarks/results/callback_cost-<date>.md`` with the command (``--out`` elsewhere;
an existing dated file is kept unless ``--force``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from benchmarks._lib import harness
from benchmarks._lib.common import results_path
from benchmarks._lib.gpt_pipeline import JobSpec, run_job
from lightning_dynmo.models import GPTConfig

PLACEMENT = "0-3|4-7"  # 8 blocks, the uniform split
# By measured time, as the every-step cases run it; min_gain 0.1 so that step-to-step noise on a balanced
# split never moves a layer (the comparison needs a fixed split).
MIN_GAIN = 0.1
EVERY_STEP: dict[str, Any] = {"every_step": True, "cost": "time", "min_gain": MIN_GAIN}
QUICK_MIN_GAIN = 0.5  # the smoke run's tiny blocks are mostly fixed cost: a wide margin against moving
QUICK_PLACEMENT = "0-1|2-3"  # 4 blocks


def jobs(
    config: GPTConfig,
    placement: str,
    steps: int,
    skip: int,
    sizes: harness.ModelSizes,
    min_gain: float,
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
        "no callback": replace(base, kind="fixed"),
        "DynMo idle": replace(base, callback={"every_n_steps": 10_000}),
        "DynMo every step": replace(base, callback=every_step),
        "DynMo every step, no skipping": replace(base, callback={**every_step, "skip_balanced": False}),
    }


def _moved_none(run: dict[str, Any]) -> list[str]:
    if run.get("moved_to"):
        raise RuntimeError(f"a job moved layers (to {run['moved_to']}): the comparison needs a fixed split")
    return []


def measure(specs: dict[str, JobSpec], skip: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Per configuration: the median step (ms) over rounds, each round's, and the callback's own account."""
    runs = harness.run_rounds(
        specs,
        run_job,
        rounds,
        "callback_cost",
        start_method="fork",
        log=_moved_none,
    )
    per_round = {name: harness.step_ms(reports, skip) for name, reports in runs.items()}
    base = per_round["no callback"]
    return {
        name: {
            "ms": statistics.median(values),
            "rounds": values,
            "vs_base": statistics.median(t / b for t, b in zip(values, base, strict=True)),
            # the callback's overhead_s covers the whole run: per step
            "own_ms": statistics.median(
                1e3 * r.get("overhead_s", 0.0) / len(r["step_s"]) for r in runs[name]
            ),
            "decisions": statistics.median(r.get("decisions", 0) for r in runs[name]),
        }
        for name, values in per_round.items()
    }


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    out = [
        "| run | step (ms) | this / no callback (paired) | per round (ms) "
        "| the callback's own account (ms a step) | decisions a job |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, row in rows.items():
        rounds = ", ".join(f"{v:.1f}" for v in row["rounds"])
        own = "-" if name == "no callback" else f"{row['own_ms']:.2f}"
        made = "-" if name == "no callback" else f"{row['decisions']:g}"
        out.append(f"| {name} | {row['ms']:.1f} | {row['vs_base']:.3f} | {rounds} | {own} | {made} |")
    return out


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)  # the ranks are forked from this process (common.launch)
    parser = harness.argument_parser(__doc__, "tiny model and one round", "rounds", "steps", "skip")
    args = parser.parse_args(argv)
    sizes = harness.QUICK_SIZES if args.quick else harness.FULL_SIZES
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
    rows = measure(jobs(config, placement, steps, skip, sizes, min_gain), skip, rounds)
    harness.finish(
        "callback_cost",
        out,
        [
            harness.header(
                "What DynMoCallback costs a pipeline that never moves", "callback_cost", argv, [harness.REAL]
            ),
            f"Dense GPT: {sizes.num_layers} blocks, d_model {sizes.d_model}, {sizes.num_heads} heads, "
            f"seq_len {sizes.seq_len}; batch {sizes.batch_size} in {sizes.microbatches} micro-batches; "
            f"fixed split `{placement}`, 1F1B on 2 CPU ranks (gloo, one thread each, pinned to their "
            f"cores). {rounds} interleaved round(s) of {steps} steps per job, medians of "
            f"steps {skip}+. The every-step jobs decide by measured time with min_gain {min_gain:g}.",
            "\n".join(table(rows)),
        ],
        started,
    )


if __name__ == "__main__":
    main()
