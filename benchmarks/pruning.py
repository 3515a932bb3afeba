"""What gradual global pruning does to layer times, and what DynMo makes of it: measured on CPU, projected.

Four parts, all with the ready pruning GPT (:func:`~lightning_dynmo.dynamism.pruning.pruning_gpt_config`),
first trained ``--train-steps`` steps in one process on the standard-library corpus so that its layers'
magnitudes differ as in a real run (a global threshold then prunes them unevenly):

1. **Per-layer time after pruning.** The trained model is pruned globally to 50%, 80% and 90% in turn
   (:class:`~lightning_dynmo.dynamism.pruning.GlobalMagnitudePruner`). At each level every block's
   forward and backward on one micro-batch is timed with its Linear layers on the dense kernel, on the
   CSR kernel, and on the kernels the pruner's measurement picked (``auto``: what training runs); the
   kernels alternate within each repeat and the fastest repeat counts. The first-stage parts (embeddings)
   and last-stage parts (norm, head, loss) are timed the same way. ``ideal`` is an emulated cost, not a
   measurement: the block's dense time with each Linear's dense time scaled by its kept fraction, i.e. a
   sparse kernel whose time is proportional to the non-zeros (what the paper's GPU kernels approach
   above ~75% sparsity), attention and norms unchanged.
2. **Imbalance under static splits.** From part 1's per-layer times (``auto`` and ``ideal``) plus the
   first/last parts: each stage's load and the imbalance ``(max - min) / mean`` under Megatron's uniform
   split and DeepSpeed's parameter split (decided on the dense model), on 2 and 8 stages.
3. **Static vs DynMo on a real 2-stage pipeline.** The trained model continues on 2 gloo ranks (1F1B),
   each run one job started by torch's elastic launcher, with ``PruningCallback`` (kernel ``auto``)
   pruning to 90% over ``--prune-steps`` steps: the static uniform split, ``DynMoCallback(partition,
   time)`` from the uniform split (it rebalances on the ``pruned`` events), and every fixed contiguous
   split within ``--spread`` layers of uniform (the candidates). Runs are interleaved over ``--rounds``
   rounds; a run's step time is the median of its steps after the last pruning step plus ``--settle``;
   a configuration's figure is the median over rounds. ``best fixed`` is the fastest measured candidate.
4. **Projection to 8 stages.** The pipeline simulator (:func:`~lightning_dynmo.balancing.simulate_pipeline`,
   1F1B) replays part 1's per-micro-batch costs (``auto`` and ``ideal``) at each level on
   ``min(8, layers)`` stages: the static uniform and parameter splits; DynMo re-partitioning after each
   pruning step (the exact min-max partition of that level's block costs, first/last parts pinned, as its
   ``partition`` balancer computes; migration time not counted); and the best single placement for the
   whole run (the fastest, averaged over the levels, among every level's partition and the static splits).

    python -m benchmarks.pruning            # ~15 minutes on 2 quiet cores
    python -m benchmarks.pruning --quick    # a smoke run (tiny sizes, one round): not figures

Each part prints a table; the report goes to ``benchmarks/results/pruning-<date>.md`` with the command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from benchmarks.common import StepTimer, benchmark_trainer, corpus_data, job_report, launch, write_report
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
from lightning_dynmo.data import TextDataModule
from lightning_dynmo.dynamism.pruning import (
    GlobalMagnitudePruner,
    PruningConfig,
    PruningScope,
    prunable_linears,
    pruning_gpt_config,
)
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_linear import time_kernels
from lightning_dynmo.dynamism_callbacks import PruningCallback
from lightning_dynmo.events import EventBus
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.strategy import DynMoStrategy

LEVELS = (0.0, 0.5, 0.8, 0.9)
SETTINGS = ("dense", "csr", "auto")
CORPUS_BYTES = 400_000


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
        return pruning_gpt_config(
            num_layers=self.num_layers, d_model=self.d_model, num_heads=self.num_heads, seq_len=self.seq_len
        )

    @property
    def rows(self) -> int:
        """Tokens of one micro-batch: what a Linear multiplies per call."""
        return self.batch_size // self.microbatches * self.seq_len


FULL = Sizes(num_layers=16, d_model=128, num_heads=4, seq_len=64, batch_size=8, microbatches=4)
QUICK = Sizes(num_layers=4, d_model=32, num_heads=2, seq_len=16, batch_size=4, microbatches=2)


def datamodule(sizes: Sizes, cache_dir: str) -> TextDataModule:
    return corpus_data(sizes.seq_len, sizes.batch_size, cache_dir, max_bytes=CORPUS_BYTES)


def optimizer_config() -> OptimizerConfig:
    return OptimizerConfig(lr=3e-3, weight_decay=0.1)


# -- part 1: per-layer time --------------------------------------------------------------------------


def train_briefly(sizes: Sizes, steps: int, cache_dir: str) -> GPT:
    """The ready GPT after ``steps`` AdamW steps in this process (layers' magnitudes drift apart)."""
    model = GPT(sizes.gpt(), optimizer_config())
    optimizer = model.configure_optimizers()
    dm = datamodule(sizes, cache_dir)
    dm.setup("fit")
    for step, batch in enumerate(dm.train_dataloader()):
        if step == steps:
            break
        inputs, target = model.pipeline_batch(batch)[:2]
        optimizer.zero_grad()
        model.pipeline_loss(model(inputs), target).backward()
        optimizer.step()
    return model


def fwd_bwd_s(fn: Callable[[], Tensor], inputs: Sequence[Tensor]) -> tuple[float, float]:
    """Seconds of one forward and of its backward (gradients w.r.t. ``inputs``, ``.grad`` untouched)."""
    start = time.perf_counter()
    out = fn()
    mid = time.perf_counter()
    torch.autograd.grad(out, list(inputs), torch.ones_like(out))
    return mid - start, time.perf_counter() - mid


def fastest(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """The least disturbed (forward, backward) pair: the repeat with the smallest total."""
    return min(samples, key=sum)


def block_times(model: GPT, sizes: Sizes, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """Per setting (dense, csr, auto), every block's (forward, backward) seconds on one micro-batch."""
    per_mb = sizes.batch_size // sizes.microbatches
    out: dict[str, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
    for _, block in sorted((int(k), b) for k, b in model.layers.items()):
        linears = [m for _, _, m in prunable_linears({0: block})]
        chosen = [m.kernel for m in linears]
        x = torch.randn(per_mb, sizes.seq_len, sizes.d_model, requires_grad=True)
        inputs = [x, *(p for p in block.parameters() if p.requires_grad)]
        samples: dict[str, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
        for _ in range(repeats + 1):  # the first round warms up
            for setting in SETTINGS:
                for m, auto in zip(linears, chosen, strict=True):
                    m.set_kernel(auto if setting == "auto" else setting)
                samples[setting].append(fwd_bwd_s(lambda: block(x), inputs))  # noqa: B023
        for m, auto in zip(linears, chosen, strict=True):
            m.set_kernel(auto)
        for setting in SETTINGS:
            out[setting].append(fastest(samples[setting][1:]))
    return out


def linear_dense_s(model: GPT, sizes: Sizes, repeats: int) -> list[list[float]]:
    """Per block, each Linear's forward + backward seconds on the dense kernel (measured once, unpruned).

    As many repeats as the blocks' dense time gets over all levels, so both minima are comparably clean.
    """
    return [
        [
            time_kernels(m, sizes.rows, repeats=repeats * len(LEVELS))["dense"]
            for _, _, m in prunable_linears({0: block})
        ]
        for _, block in sorted((int(k), b) for k, b in model.layers.items())
    ]


def add_ideal_times(levels: list[Level], linear_s: list[list[float]]) -> None:
    """Emulated: the block's dense time less each Linear's dense time times the Linear's sparsity.

    The block's dense time is the fastest of its dense measurements over all levels (the dense kernel
    does the same work at every sparsity), so the emulated costs differ between levels and layers only
    through the measured sparsities.
    """
    for i, linears in enumerate(linear_s):
        fwd, bwd = fastest([lv.times["dense"][i] for lv in levels])
        for lv in levels:
            saved = sum(t * s for t, s in zip(linears, lv.linear_sparsity[i], strict=True))
            scale = max(0.0, fwd + bwd - saved) / (fwd + bwd)
            lv.times.setdefault("ideal", []).append((fwd * scale, bwd * scale))


def part_times(model: GPT, sizes: Sizes, repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(forward, backward) seconds of the first-stage parts and of the last-stage parts plus the loss."""
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

    first_s = [fwd_bwd_s(first, first_params) for _ in range(repeats + 1)][1:]
    last_s = [fwd_bwd_s(last, last_params) for _ in range(repeats + 1)][1:]
    return fastest(first_s), fastest(last_s)


@dataclass(frozen=True)
class Level:
    """Part 1's measurements at one global sparsity."""

    sparsity: float
    layer_sparsity: tuple[float, ...]
    times: dict[str, list[tuple[float, float]]]  # dense, csr, auto, ideal
    linear_sparsity: list[list[float]]  # per block, per Linear
    kernels: list[str]  # per block: the auto choices, e.g. "2/4 csr"
    first: tuple[float, float]
    last: tuple[float, float]
    params: list[int]  # non-zero parameters per block


def measure_levels(model: GPT, sizes: Sizes, repeats: int) -> list[Level]:
    layers = {int(k): b for k, b in model.layers.items()}
    GlobalMagnitudePruner.prepare(layers)
    linear_s = linear_dense_s(model, sizes, repeats)
    config = PruningConfig(kernel="auto", timing_rows=sizes.rows, timing_repeats=max(repeats, 1))
    pruner = GlobalMagnitudePruner(config, event_bus=EventBus())
    levels = []
    for sparsity in LEVELS:
        report = pruner.prune_to(sparsity, PruningScope(layers, sizes.num_layers))
        times = block_times(model, sizes, repeats)
        first, last = part_times(model, sizes, repeats)
        linears = [[m for _, _, m in prunable_linears({i: layers[i]})] for i in sorted(layers)]
        kernels = [f"{[m.kernel for m in ms].count('csr')}/{len(ms)} csr" for ms in linears]
        params = [sum(int((p != 0).sum()) for p in layers[i].parameters()) for i in sorted(layers)]
        sparsity_of = [[m.sparsity for m in ms] for ms in linears]
        levels.append(
            Level(sparsity, report.layer_sparsity, times, sparsity_of, kernels, first, last, params)
        )
    add_ideal_times(levels, linear_s)
    return levels


def level_table(levels: list[Level]) -> str:
    lines = [
        "| global sparsity | layer | layer sparsity | dense ms | CSR ms | auto ms (kernels) "
        "| ideal ms (emulated) |",
        "|---:|---:|---:|---:|---:|---|---:|",
    ]
    for lv in levels:
        for i, s in enumerate(lv.layer_sparsity):
            ms = {k: 1e3 * sum(lv.times[k][i]) for k in (*SETTINGS, "ideal")}
            lines.append(
                f"| {lv.sparsity:.0%} | {i} | {s:.3f} | {ms['dense']:.2f} | {ms['csr']:.2f} "
                f"| {ms['auto']:.2f} ({lv.kernels[i]}) | {ms['ideal']:.2f} |"
            )
        lines.append(
            f"| {lv.sparsity:.0%} | first / last parts | | "
            f"{1e3 * sum(lv.first):.2f} / {1e3 * sum(lv.last):.2f} | | | |"
        )
    return "\n".join(lines)


# -- part 2: imbalance under static splits ----------------------------------------------------------


def costs_of(level: Level, view: str) -> list[LayerCost]:
    return [
        LayerCost(fwd_time_s=f, bwd_time_s=b, num_params=p)
        for (f, b), p in zip(level.times[view], level.params, strict=True)
    ]


def stage_loads(level: Level, view: str, placement: Placement) -> tuple[list[float], list[float]]:
    """Per stage (forward, backward) seconds of one micro-batch: its blocks, plus the pinned parts."""
    costs = costs_of(level, view)
    fwd = [sum(costs[i].fwd_time_s for i in placement.layers_of(s)) for s in range(placement.num_stages)]
    bwd = [sum(costs[i].bwd_time_s for i in placement.layers_of(s)) for s in range(placement.num_stages)]
    fwd[0] += level.first[0]
    bwd[0] += level.first[1]
    fwd[-1] += level.last[0]
    bwd[-1] += level.last[1]
    return fwd, bwd


def static_splits(
    levels: list[Level], num_stages: int, embed_params: int, head_params: int
) -> dict[str, Placement]:
    dense = costs_of(levels[0], "dense")
    by_params = partition(
        BalanceProblem(
            dense,
            by="params",
            hardware=Hardware(
                first_stage_extra=LayerCost(num_params=embed_params),
                last_stage_extra=LayerCost(num_params=head_params),
            ),
        ),
        num_stages,
    )
    return {"uniform": uniform(len(dense), num_stages), "params": by_params}


def imbalance_table(
    levels: list[Level], stage_counts: list[int], splits: dict[int, dict[str, Placement]]
) -> str:
    lines = [
        "| stages | split | placement | cost | " + " | ".join(f"{lv.sparsity:.0%}" for lv in levels) + " |",
        "|---:|---|---|---|" + "---:|" * len(levels),
    ]
    for n in stage_counts:
        for name, placement in splits[n].items():
            for view in ("auto", "ideal"):
                values = []
                for lv in levels:
                    fwd, bwd = stage_loads(lv, view, placement)
                    values.append(imbalance([f + b for f, b in zip(fwd, bwd, strict=True)]))
                cells = " | ".join(f"{v:.2f}" for v in values)
                lines.append(f"| {n} | {name} | `{placement}` | {view} | {cells} |")
    return "\n".join(lines)


# -- part 3: real 2-stage pipeline ------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineRun:
    """One 2-process training job."""

    label: str
    sizes: Sizes
    weights: str
    cache_dir: str
    steps: int
    prune_start: int
    prune_every: int
    placement: str
    dynmo: bool = False

    @property
    def schedule(self) -> PruningSchedule:
        return PruningSchedule(
            final_sparsity=0.9, start_step=self.prune_start, frequency=self.prune_every, num_steps=3
        )


def train_pipeline(run: PipelineRun) -> dict[str, Any]:
    """Body of one rank (started by the elastic launcher): fit and report rank 0's step times."""
    torch.set_num_threads(1)
    model = GPT(run.sizes.gpt(), optimizer_config())
    model.load_state_dict(torch.load(run.weights, weights_only=True))
    timer = StepTimer()
    config = PruningConfig(schedule=run.schedule, kernel="auto", timing_rows=run.sizes.rows)
    callbacks: list[pl.Callback] = [PruningCallback(config), timer]
    dynmo = DynMoCallback(balancer="partition", cost="time") if run.dynmo else None
    if dynmo is not None:
        callbacks.append(dynmo)
    strategy = DynMoStrategy(
        num_microbatches=run.sizes.microbatches, schedule="1F1B", placement=run.placement
    )
    trainer = benchmark_trainer(strategy, callbacks, run.steps)
    trainer.fit(model, datamodule(run.sizes, run.cache_dir))
    return job_report(timer, strategy, dynmo)


def candidates(num_layers: int, spread: int) -> list[str]:
    half = num_layers // 2
    return [
        str(Placement.from_sizes([k, num_layers - k]))
        for k in range(half - spread, half + spread + 1)
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
    per_run: dict[str, list[dict[str, Any]]] = {r.label: [] for r in runs}
    for round_index in range(rounds):
        for run in runs:
            print(f"[pipeline round {round_index + 1}/{rounds}] {run.label} ...", file=sys.stderr, flush=True)
            report = launch(train_pipeline, run)
            report["median_s"] = statistics.median(report["step_s"][skip:])
            per_run[run.label].append(report)
    rows = []
    for run in runs:
        reports = per_run[run.label]
        rows.append(
            {
                "label": run.label,
                "step_ms": 1e3 * statistics.median(r["median_s"] for r in reports),
                "placement": reports[-1]["placement"],
                "rebalances": reports[-1]["rebalances"],
                "overhead_s": reports[-1]["overhead_s"],
                "candidate": not run.dynmo,
            }
        )
    static_ms = rows[0]["step_ms"]
    best_ms = min(r["step_ms"] for r in rows if r["candidate"])
    for row in rows:
        row["speedup"] = static_ms / row["step_ms"]
        row["best_vs_this"] = best_ms / row["step_ms"]
    return rows


def pipeline_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | step after pruning (ms) | static / this | best fixed / this | final placement | migrations "
        "| DynMo overhead (s) |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['step_ms']:.1f} | {r['speedup']:.2f} | {r['best_vs_this']:.2f} "
            f"| `{r['placement']}` | {r['rebalances']} | {r['overhead_s']:.2f} |"
        )
    return "\n".join(lines)


# -- part 4: projection --------------------------------------------------------------------------------


def simulated_ms(level: Level, view: str, placement: Placement, microbatches: int) -> float:
    fwd, bwd = stage_loads(level, view, placement)
    return 1e3 * simulate_pipeline(fwd, bwd, microbatches, "1f1b").step_time_s


def dynmo_placement(level: Level, view: str, num_stages: int) -> Placement:
    return partition(
        BalanceProblem(
            costs_of(level, view),
            hardware=Hardware(
                first_stage_extra=LayerCost(fwd_time_s=level.first[0], bwd_time_s=level.first[1]),
                last_stage_extra=LayerCost(fwd_time_s=level.last[0], bwd_time_s=level.last[1]),
            ),
        ),
        num_stages,
    )


def project(
    levels: list[Level], view: str, num_stages: int, microbatches: int, statics: dict[str, Placement]
) -> list[dict[str, Any]]:
    dynmo = [dynmo_placement(lv, view, num_stages) for lv in levels]
    pool = {**{str(p): p for p in dynmo}, **{str(p): p for p in statics.values()}}

    def mean_ms(placement: Placement) -> float:
        return statistics.mean(simulated_ms(lv, view, placement, microbatches) for lv in levels)

    best = min(pool.values(), key=mean_ms)
    rows = []
    for name, placement in statics.items():
        rows.append(
            {
                "label": f"static {name}",
                "per_level": [simulated_ms(lv, view, placement, microbatches) for lv in levels],
                "placement": str(placement),
            }
        )
    rows.append(
        {
            "label": "DynMo (re-partition per level)",
            "per_level": [
                simulated_ms(lv, view, p, microbatches) for lv, p in zip(levels, dynmo, strict=True)
            ],
            "placement": " → ".join(dict.fromkeys(str(p) for p in dynmo)),
        }
    )
    rows.append(
        {
            "label": "best fixed for the run",
            "per_level": [simulated_ms(lv, view, best, microbatches) for lv in levels],
            "placement": str(best),
        }
    )
    dynmo_mean = statistics.mean(rows[-2]["per_level"])
    for row in rows:
        row["mean"] = statistics.mean(row["per_level"])
        row["vs_dynmo"] = row["mean"] / dynmo_mean
    return rows


def projection_table(levels: list[Level], view: str, num_stages: int, rows: list[dict[str, Any]]) -> str:
    head = " | ".join(f"{lv.sparsity:.0%} (ms)" for lv in levels)
    lines = [
        f"#### {num_stages} stages, {view} costs",
        "",
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
    parser.add_argument("--train-steps", type=int, default=None, help="single-process steps before pruning")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per kernel and layer")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds of the pipeline runs")
    parser.add_argument(
        "--spread", type=int, default=None, help="fixed candidates within this many layers of uniform"
    )
    parser.add_argument(
        "--prune-every", type=int, default=None, help="steps between pruning steps (4 of them)"
    )
    parser.add_argument(
        "--settle", type=int, default=None, help="steps after the last pruning step not measured"
    )
    parser.add_argument("--measure", type=int, default=None, help="measured steps per pipeline run")
    parser.add_argument("--skip-pipeline", action="store_true", help="parts 1, 2 and 4 only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    train_steps = args.train_steps if args.train_steps is not None else (3 if args.quick else 150)
    repeats = args.repeats or (1 if args.quick else 5)
    rounds = args.rounds or (1 if args.quick else 2)
    spread = args.spread if args.spread is not None else (0 if args.quick else 2)
    prune_every = args.prune_every or (1 if args.quick else 2)
    settle = args.settle if args.settle is not None else (1 if args.quick else 3)
    measure = args.measure or (2 if args.quick else 8)
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        datamodule(sizes, tmp).prepare_data()
        print(f"training {train_steps} steps ...", file=sys.stderr, flush=True)
        model = train_briefly(sizes, train_steps, tmp)
        weights = str(Path(tmp) / "trained.pt")
        torch.save(model.state_dict(), weights)
        print("timing layers ...", file=sys.stderr, flush=True)
        levels = measure_levels(model, sizes, repeats)
        embed = sum(p.numel() for p in (*model.tok_emb.parameters(), *model.pos_emb.parameters()))
        head = sum(p.numel() for p in (*model.ln_f.parameters(), *model.head.parameters()))
        stage_counts = sorted({2, min(8, sizes.num_layers)})
        splits = {n: static_splits(levels, n, embed, head) for n in stage_counts}
        sections = [
            "### 1. Per-layer forward + backward time of one micro-batch after global pruning",
            level_table(levels),
            "### 2. Stage-load imbalance (max - min) / mean under static splits",
            imbalance_table(levels, stage_counts, splits),
        ]
        if not args.skip_pipeline:
            prune_start = 2
            last_prune = prune_start + 3 * prune_every
            base = PipelineRun(
                label="",
                sizes=sizes,
                weights=weights,
                cache_dir=tmp,
                steps=last_prune + 1 + settle + measure,
                prune_start=prune_start,
                prune_every=prune_every,
                placement="",
            )
            rows = compare_pipeline(base, rounds, spread, skip=last_prune + 1 + settle)
            sections += [
                "### 3. Static vs DynMo on a real 2-stage CPU pipeline (pruning at steps "
                f"{list(base.schedule.steps)} to 90%, measured from step {last_prune + 1 + settle}, "
                f"median of {rounds} round(s))",
                pipeline_table(rows),
            ]
        n = max(stage_counts)
        sections.append(
            f"### 4. Projection to {n} stages (simulated 1F1B, {sizes.microbatches} micro-batches)"
        )
        for view in ("auto", "ideal"):
            sections.append(
                projection_table(levels, view, n, project(levels, view, n, sizes.microbatches, splits[n]))
            )
    command = "python -m benchmarks.pruning " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = "\n\n".join(
        [
            f"## Gradual global pruning: layer times and DynMo ({dt.date.today().isoformat()})",
            f"Command: `{command.strip()}`  ",
            f"Setup: pruning_gpt_config(num_layers={sizes.num_layers}, d_model={sizes.d_model}, "
            f"num_heads={sizes.num_heads}, seq_len={sizes.seq_len}), batch {sizes.batch_size} in "
            f"{sizes.microbatches} micro-batches ({sizes.rows} rows per Linear call), trained {train_steps} "
            f"steps on the stdlib corpus before pruning; one torch thread per process; times are the fastest "
            f"of {repeats} repeat(s). 'ideal' is emulated (module docstring), everything else is measured.",
            *sections,
            f"Wall time of the whole benchmark: {time.perf_counter() - started:.0f} s.",
        ]
    )
    write_report(report, "pruning", args.out)


if __name__ == "__main__":
    main()
