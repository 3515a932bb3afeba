"""What freezing a prefix of layers does to layer times, and what DynMo makes of it: measured, projected.

Four parts, with a dense GPT (``GPTConfig(blocks="dense")``; freezing does not depend on the weights, so
the model is not trained first):

1. **Per-layer time, frozen vs trainable.** Every block's forward and backward on one micro-batch in
   three states, alternating within each repeat (the fastest repeat counts): ``trainable`` (input and
   weight gradients), ``frozen behind a trainable layer`` (input gradient only: a frozen layer that is
   not in the prefix) and ``frozen prefix`` (forward only: nothing before it trains, so no backward);
   the first-stage parts (embeddings) trainable and frozen, the last-stage parts (norm, head, loss).
2. **Imbalance under static splits.** From part 1's times, with the first 0%, 25%, 50% and 75% of the
   blocks frozen (a frozen prefix: forward only, embeddings frozen with block 0): each stage's load and
   the imbalance ``(max - min) / mean`` under Megatron's uniform split and DeepSpeed's parameter split
   (decided on the unfrozen model, as before training), on 2 and 8 stages.
3. **Static vs DynMo on a real 2-stage pipeline.** 2 gloo ranks (1F1B), each run one job started by
   torch's elastic launcher, with ``FreezingCallback(criterion="schedule")`` freezing the first half of
   the blocks at step 2 (a schedule, so every run freezes alike): the static uniform split,
   ``DynMoCallback(partition, time)`` from the uniform split (it rebalances on the ``frozen`` event) and
   every fixed contiguous split from one layer below uniform to ``--spread`` layers above it (freezing
   the front makes the first stage light, so the good splits give it more layers): the measured
   candidates. Runs are interleaved over ``--rounds`` rounds; a run's step time is the median of its
   steps after the freeze plus ``--settle``; a configuration's figure is the median over rounds.
   ``best fixed`` is the fastest measured candidate.
4. **Projection to 8 stages.** The pipeline simulator (:func:`~lightning_dynmo.balancing.simulate_pipeline`,
   1F1B) replays part 1's per-micro-batch costs at each frozen fraction on ``min(8, layers)`` stages:
   the static uniform and parameter splits; DynMo re-partitioning after each freeze (the exact min-max
   partition of that level's costs, first/last parts pinned, as its ``partition`` balancer computes;
   migration time not counted); and the best single placement for the whole run (the fastest, averaged
   over the levels, among every level's partition and the static splits).

    python -m benchmarks.freezing            # ~15 minutes on 2 quiet cores
    python -m benchmarks.freezing --quick    # a smoke run (tiny sizes, one round): not figures

Each part prints a table; the report goes to ``benchmarks/results/freezing-<date>.md`` with the command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from benchmarks.common import StepTimer, benchmark_trainer, job_report, launch, write_report
from benchmarks.pruning import fastest, fwd_bwd_s
from lightning_dynmo.balancing import (
    BalanceProblem,
    Hardware,
    LayerCost,
    Placement,
    imbalance,
    partition,
    simulate_pipeline,
    uniform,
)
from lightning_dynmo.callback import DynMoCallback
from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.dynamism.freezing import FreezingConfig
from lightning_dynmo.dynamism_callbacks import FreezingCallback
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.strategy import DynMoStrategy

FRACTIONS = (0.0, 0.25, 0.5, 0.75)
STATES = ("trainable", "frozen behind a trainable layer", "frozen prefix")


@dataclass(frozen=True)
class Sizes:
    """Model, batch and run sizes of one benchmark mode."""

    num_layers: int
    d_model: int
    num_heads: int
    seq_len: int
    batch_size: int
    microbatches: int

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=256,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            d_model=self.d_model,
            num_heads=self.num_heads,
            blocks="dense",
        )


FULL = Sizes(num_layers=16, d_model=128, num_heads=4, seq_len=64, batch_size=8, microbatches=4)
QUICK = Sizes(num_layers=4, d_model=32, num_heads=2, seq_len=16, batch_size=4, microbatches=2)


# -- part 1: per-layer time ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Times:
    """Part 1's measurements: (forward, backward) seconds of one micro-batch."""

    blocks: dict[str, list[tuple[float, float]]]  # per state, per block
    first: dict[str, tuple[float, float]]  # "trainable", "frozen"
    last: tuple[float, float]
    params: list[int]  # per block


def forward_s(fn: Any) -> tuple[float, float]:
    """Seconds of a forward that builds no graph (a frozen prefix): backward costs nothing."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, 0.0


def block_times(model: GPT, sizes: Sizes, repeats: int) -> dict[str, list[tuple[float, float]]]:
    per_mb = sizes.batch_size // sizes.microbatches
    out: dict[str, list[tuple[float, float]]] = {s: [] for s in STATES}
    for _, block in sorted((int(k), b) for k, b in model.layers.items()):
        x = torch.randn(per_mb, sizes.seq_len, sizes.d_model, requires_grad=True)
        params = list(block.parameters())
        samples: dict[str, list[tuple[float, float]]] = {s: [] for s in STATES}
        for _ in range(repeats + 1):  # the first round warms up
            samples[STATES[0]].append(fwd_bwd_s(lambda: block(x), [x, *params]))  # noqa: B023
            for p in params:
                p.requires_grad_(False)
            samples[STATES[1]].append(fwd_bwd_s(lambda: block(x), [x]))  # noqa: B023
            samples[STATES[2]].append(forward_s(lambda: block(x.detach())))  # noqa: B023
            for p in params:
                p.requires_grad_(True)
        for state in STATES:
            out[state].append(fastest(samples[state][1:]))
    return out


def part_times(
    model: GPT, sizes: Sizes, repeats: int
) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
    per_mb = sizes.batch_size // sizes.microbatches
    idx = torch.randint(0, sizes.gpt().vocab_size, (per_mb, sizes.seq_len))
    hidden = torch.randn(per_mb, sizes.seq_len, sizes.d_model, requires_grad=True)
    first_params = [*model.tok_emb.parameters(), *model.pos_emb.parameters()]
    last_params = [hidden, *model.ln_f.parameters(), *model.head.parameters()]

    def first() -> Tensor:
        out: Tensor = model.pipeline_first(idx)
        return out

    def last() -> Tensor:
        return model.pipeline_loss(model.pipeline_last(hidden), idx)

    trainable = [fwd_bwd_s(first, first_params) for _ in range(repeats + 1)][1:]
    with torch.no_grad():
        frozen = [forward_s(first) for _ in range(repeats + 1)][1:]
    last_s = [fwd_bwd_s(last, last_params) for _ in range(repeats + 1)][1:]
    return {"trainable": fastest(trainable), "frozen": fastest(frozen)}, fastest(last_s)


def measure_times(sizes: Sizes, repeats: int) -> Times:
    model = GPT(sizes.gpt(), OptimizerConfig())
    blocks = block_times(model, sizes, repeats)
    first, last = part_times(model, sizes, repeats)
    params = [
        sum(p.numel() for p in b.parameters())
        for _, b in sorted((int(k), b) for k, b in model.layers.items())
    ]
    return Times(blocks, first, last, params)


def time_table(times: Times) -> str:
    lines = [
        "| layer | " + " | ".join(f"{s} fwd+bwd ms" for s in STATES) + " | frozen prefix / trainable |",
        "|---:|" + "---:|" * (len(STATES) + 1),
    ]
    for i in range(len(times.params)):
        ms = [1e3 * sum(times.blocks[s][i]) for s in STATES]
        lines.append(f"| {i} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {ms[2] / ms[0]:.2f} |")
    first = {k: 1e3 * sum(v) for k, v in times.first.items()}
    lines.append(f"| first parts | {first['trainable']:.2f} | | {first['frozen']:.2f} | |")
    lines.append(f"| last parts + loss | {1e3 * sum(times.last):.2f} | | | |")
    return "\n".join(lines)


# -- part 2: imbalance under static splits ----------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """Per-micro-batch costs with the first ``num_frozen`` blocks frozen."""

    fraction: float
    num_frozen: int
    costs: list[LayerCost]
    first: tuple[float, float]
    last: tuple[float, float]


def level_of(times: Times, fraction: float) -> Level:
    frozen = round(fraction * len(times.params))
    costs = [
        LayerCost(fwd_time_s=f, bwd_time_s=b, num_params=p)
        for i, p in enumerate(times.params)
        for f, b in [times.blocks[STATES[2] if i < frozen else STATES[0]][i]]
    ]
    first = times.first["frozen" if frozen else "trainable"]
    return Level(fraction, frozen, costs, first, times.last)


def stage_loads(level: Level, placement: Placement) -> tuple[list[float], list[float]]:
    stages = range(placement.num_stages)
    fwd = [sum(level.costs[i].fwd_time_s for i in placement.layers_of(s)) for s in stages]
    bwd = [sum(level.costs[i].bwd_time_s for i in placement.layers_of(s)) for s in stages]
    fwd[0] += level.first[0]
    bwd[0] += level.first[1]
    fwd[-1] += level.last[0]
    bwd[-1] += level.last[1]
    return fwd, bwd


def static_splits(
    levels: list[Level], num_stages: int, embed_params: int, head_params: int
) -> dict[str, Placement]:
    by_params = partition(
        BalanceProblem(
            levels[0].costs,
            by="params",
            hardware=Hardware(
                first_stage_extra=LayerCost(num_params=embed_params),
                last_stage_extra=LayerCost(num_params=head_params),
            ),
        ),
        num_stages,
    )
    return {"uniform": uniform(len(levels[0].costs), num_stages), "params": by_params}


def imbalance_table(levels: list[Level], splits: dict[int, dict[str, Placement]]) -> str:
    lines = [
        "| stages | split | placement | " + " | ".join(f"{lv.fraction:.0%} frozen" for lv in levels) + " |",
        "|---:|---|---|" + "---:|" * len(levels),
    ]
    for n, named in splits.items():
        for name, placement in named.items():
            values = []
            for lv in levels:
                fwd, bwd = stage_loads(lv, placement)
                values.append(imbalance([f + b for f, b in zip(fwd, bwd, strict=True)]))
            lines.append(f"| {n} | {name} | `{placement}` | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines)


# -- part 3: real 2-stage pipeline -----------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineRun:
    """One 2-process training job."""

    label: str
    sizes: Sizes
    steps: int
    freeze_at: int
    placement: str
    dynmo: bool = False


def train_pipeline(run: PipelineRun) -> dict[str, Any]:
    """Body of one rank (started by the elastic launcher): fit and report rank 0's step times."""
    torch.set_num_threads(1)
    model = GPT(run.sizes.gpt(), OptimizerConfig(lr=3e-3, weight_decay=0.1))
    timer = StepTimer()
    config = FreezingConfig(criterion="schedule", schedule=((run.freeze_at, run.sizes.num_layers // 2),))
    callbacks: list[pl.Callback] = [FreezingCallback(config), timer]
    dynmo = DynMoCallback(balancer="partition", cost="time") if run.dynmo else None
    if dynmo is not None:
        callbacks.append(dynmo)
    strategy = DynMoStrategy(
        num_microbatches=run.sizes.microbatches, schedule="1F1B", placement=run.placement
    )
    trainer = benchmark_trainer(strategy, callbacks, run.steps)
    sizes = run.sizes
    data = RandomTokenDataModule(
        batch_size=sizes.batch_size,
        num_samples=sizes.batch_size * run.steps,
        seq_len=sizes.seq_len,
        vocab_size=256,
    )
    trainer.fit(model, data)
    return job_report(timer, strategy, dynmo)


def candidates(num_layers: int, spread: int) -> list[str]:
    half = num_layers // 2
    return [
        str(Placement.from_sizes([k, num_layers - k]))
        for k in range(half - 1, half + spread + 1)
        if 0 < k < num_layers
    ]


def compare_pipeline(base: PipelineRun, rounds: int, spread: int, skip: int) -> list[dict[str, Any]]:
    static = str(uniform(base.sizes.num_layers, 2))
    runs = [
        replace(base, label="static uniform", placement=static),
        replace(base, label="DynMo partition/time", placement=static, dynmo=True),
    ]
    runs += [
        replace(base, label=f"fixed {p}", placement=p)
        for p in candidates(base.sizes.num_layers, spread)
        if p != static
    ]
    per_run: dict[str, list[float]] = {r.label: [] for r in runs}
    last: dict[str, dict[str, Any]] = {}
    for round_index in range(rounds):
        for run in runs:
            print(f"[pipeline round {round_index + 1}/{rounds}] {run.label} ...", file=sys.stderr, flush=True)
            report = launch(train_pipeline, run)
            per_run[run.label].append(statistics.median(report["step_s"][skip:]))
            last[run.label] = report
    rows = [
        {
            "label": run.label,
            "step_ms": 1e3 * statistics.median(per_run[run.label]),
            "placement": last[run.label]["placement"],
            "rebalances": last[run.label]["rebalances"],
            "overhead_s": last[run.label]["overhead_s"],
            "candidate": not run.dynmo,
        }
        for run in runs
    ]
    static_ms = rows[0]["step_ms"]
    best_ms = min(r["step_ms"] for r in rows if r["candidate"])
    for row in rows:
        row["speedup"] = static_ms / row["step_ms"]
        row["best_vs_this"] = best_ms / row["step_ms"]
    return rows


def pipeline_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | step after freezing (ms) | static / this | best fixed / this | final placement | migrations "
        "| DynMo overhead (s) |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['step_ms']:.1f} | {r['speedup']:.2f} | {r['best_vs_this']:.2f} "
            f"| `{r['placement']}` | {r['rebalances']} | {r['overhead_s']:.2f} |"
        )
    return "\n".join(lines)


# -- part 4: projection ----------------------------------------------------------------------------------


def simulated_ms(level: Level, placement: Placement, microbatches: int) -> float:
    fwd, bwd = stage_loads(level, placement)
    return 1e3 * simulate_pipeline(fwd, bwd, microbatches, "1f1b").step_time_s


def project(
    levels: list[Level], num_stages: int, microbatches: int, statics: dict[str, Placement]
) -> list[dict[str, Any]]:
    dynmo = [
        partition(
            BalanceProblem(
                lv.costs,
                hardware=Hardware(
                    first_stage_extra=LayerCost(fwd_time_s=lv.first[0], bwd_time_s=lv.first[1]),
                    last_stage_extra=LayerCost(fwd_time_s=lv.last[0], bwd_time_s=lv.last[1]),
                ),
            ),
            num_stages,
        )
        for lv in levels
    ]
    pool = {**{str(p): p for p in dynmo}, **{str(p): p for p in statics.values()}}
    best = min(
        pool.values(), key=lambda p: statistics.mean(simulated_ms(lv, p, microbatches) for lv in levels)
    )
    rows = [
        {
            "label": f"static {name}",
            "per_level": [simulated_ms(lv, p, microbatches) for lv in levels],
            "placement": str(p),
        }
        for name, p in statics.items()
    ]
    rows.append(
        {
            "label": "DynMo (re-partition per level)",
            "per_level": [simulated_ms(lv, p, microbatches) for lv, p in zip(levels, dynmo, strict=True)],
            "placement": " → ".join(dict.fromkeys(str(p) for p in dynmo)),
        }
    )
    rows.append(
        {
            "label": "best fixed for the run",
            "per_level": [simulated_ms(lv, best, microbatches) for lv in levels],
            "placement": str(best),
        }
    )
    dynmo_mean = statistics.mean(rows[-2]["per_level"])
    for row in rows:
        row["mean"] = statistics.mean(row["per_level"])
        row["vs_dynmo"] = row["mean"] / dynmo_mean
    return rows


def projection_table(levels: list[Level], rows: list[dict[str, Any]]) -> str:
    head = " | ".join(f"{lv.fraction:.0%} frozen (ms)" for lv in levels)
    lines = [
        f"| placement | {head} | mean (ms) | this / DynMo | placements |",
        "|---|" + "---:|" * (len(levels) + 2) + "---|",
    ]
    for r in rows:
        cells = " | ".join(f"{v:.2f}" for v in r["per_level"])
        lines.append(
            f"| {r['label']} | {cells} | {r['mean']:.2f} | {r['vs_dynmo']:.2f} | `{r['placement']}` |"
        )
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per state and layer")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds of the pipeline runs")
    parser.add_argument(
        "--spread", type=int, default=None, help="fixed candidates up to this many layers above uniform"
    )
    parser.add_argument("--settle", type=int, default=None, help="steps after the freeze not measured")
    parser.add_argument("--measure", type=int, default=None, help="measured steps per pipeline run")
    parser.add_argument("--skip-pipeline", action="store_true", help="parts 1, 2 and 4 only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or (1 if args.quick else 5)
    rounds = args.rounds or (1 if args.quick else 2)
    spread = args.spread if args.spread is not None else (1 if args.quick else 4)
    settle = args.settle if args.settle is not None else (1 if args.quick else 3)
    measure = args.measure or (2 if args.quick else 8)
    torch.set_num_threads(1)
    started = time.perf_counter()
    print("timing layers ...", file=sys.stderr, flush=True)
    times = measure_times(sizes, repeats)
    levels = [level_of(times, f) for f in FRACTIONS]
    model = GPT(sizes.gpt())
    embed = sum(p.numel() for p in (*model.tok_emb.parameters(), *model.pos_emb.parameters()))
    head = sum(p.numel() for p in (*model.ln_f.parameters(), *model.head.parameters()))
    stage_counts = sorted({2, min(8, sizes.num_layers)})
    splits = {n: static_splits(levels, n, embed, head) for n in stage_counts}
    sections = [
        "### 1. Per-layer forward + backward time of one micro-batch, frozen vs trainable",
        time_table(times),
        "### 2. Stage-load imbalance (max - min) / mean under static splits after freezing a prefix",
        imbalance_table(levels, splits),
    ]
    if not args.skip_pipeline:
        freeze_at = 2
        skip = freeze_at + 1 + settle
        base = PipelineRun(label="", sizes=sizes, steps=skip + measure, freeze_at=freeze_at, placement="")
        rows = compare_pipeline(base, rounds, spread, skip=skip)
        sections += [
            f"### 3. Static vs DynMo on a real 2-stage CPU pipeline (the first {sizes.num_layers // 2} of "
            f"{sizes.num_layers} blocks frozen at step {freeze_at}, measured from step {skip}, median of "
            f"{rounds} round(s))",
            pipeline_table(rows),
        ]
    n = max(stage_counts)
    sections += [
        f"### 4. Projection to {n} stages (simulated 1F1B, {sizes.microbatches} micro-batches, part 1's "
        "costs)",
        projection_table(levels, project(levels, n, sizes.microbatches, splits[n])),
    ]
    command = "python -m benchmarks.freezing " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = "\n\n".join(
        [
            f"## Layer freezing: layer times and DynMo ({dt.date.today().isoformat()})",
            f"Command: `{command.strip()}`  ",
            f"Setup: dense GPT (num_layers={sizes.num_layers}, d_model={sizes.d_model}, "
            f"num_heads={sizes.num_heads}, seq_len={sizes.seq_len}), batch {sizes.batch_size} in "
            f"{sizes.microbatches} micro-batches; one torch thread per process; times are the fastest of "
            f"{repeats} repeat(s). Parts 1-3 are measured, part 4 is simulated from part 1's measurements.",
            *sections,
            f"Wall time of the whole benchmark: {time.perf_counter() - started:.0f} s.",
        ]
    )
    write_report(report, "freezing", args.out)


if __name__ == "__main__":
    main()
