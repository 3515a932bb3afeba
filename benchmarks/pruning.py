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
   rounds (:mod:`benchmarks._lib.harness`); a run's step time is the median of its steps after the last
   pruning step plus ``--settle``; ratios are taken within a round, each round's ideal being the
   candidate fastest in the other rounds. Every fixed split also runs with
   ``DynMoCallback(balancer="static")`` attached (measuring only): whether DynMo's steps after its
   moves match the same placement run fixed (:func:`benchmarks._lib.harness.after_move_lines`).
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

import functools
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._lib import harness
from benchmarks._lib.common import corpus_data, results_path
from benchmarks._lib.levels import (
    LevelCosts,
    end_parts,
    fastest,
    fastest_of,
    fwd_bwd_s,
    project,
    projection_table,
    stage_imbalance,
    static_splits,
)
from lightning_dynmo.balancing import LayerCost, Placement, uniform
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

LEVELS = (0.0, 0.5, 0.8, 0.9)
SETTINGS = ("dense", "csr", "auto")
CORPUS_BYTES = 400_000


@dataclass(frozen=True)
class Sizes(harness.ModelSizes):
    """Model and batch sizes of one benchmark mode: the ready pruning GPT."""

    def gpt(self) -> GPTConfig:
        return pruning_gpt_config(**self.shape)


FULL = Sizes.extend(harness.FULL_SIZES, num_layers=16)
QUICK = Sizes.extend(harness.QUICK_SIZES, seq_len=16)


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
    vocab = sizes.gpt().vocab_size
    parts = end_parts(model, vocab, sizes.batch_size // sizes.microbatches, sizes.seq_len, sizes.d_model)
    return fastest_of(parts.first, parts.first_inputs, repeats), fastest_of(
        parts.last, parts.last_inputs, repeats
    )


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


def at(level: Level, view: str) -> LevelCosts:
    """The level's per-micro-batch costs on one view (``dense``, ``csr``, ``auto`` or ``ideal``)."""
    costs = [
        LayerCost(fwd_time_s=f, bwd_time_s=b, num_params=p)
        for (f, b), p in zip(level.times[view], level.params, strict=True)
    ]
    return LevelCosts(f"{level.sparsity:.0%}", costs, level.first, level.last)


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
                values = [stage_imbalance(at(lv, view), placement) for lv in levels]
                cells = " | ".join(f"{v:.2f}" for v in values)
                lines.append(f"| {n} | {name} | `{placement}` | {view} | {cells} |")
    return "\n".join(lines)


# -- part 3: real 2-stage pipeline ------------------------------------------------------------------


PRUNE_START = 2  # the pipeline runs' first pruning step (4 of them, to 90%)


def pruning_schedule(prune_every: int) -> PruningSchedule:
    """The pipeline runs' schedule: 4 pruning steps from :data:`PRUNE_START`, ``prune_every`` apart."""
    return PruningSchedule(final_sparsity=0.9, start_step=PRUNE_START, frequency=prune_every, num_steps=3)


def compare_pipeline(
    sizes: Sizes,
    weights: str,
    cache_dir: str,
    steps: int,
    prune_every: int,
    rounds: int,
    spread: int,
    skip: int,
) -> str:
    """Static uniform split, DynMo partition/time and the candidates, from trained weights, in rounds."""
    config = PruningConfig(schedule=pruning_schedule(prune_every), kernel="auto", timing_rows=sizes.rows)
    base = harness.fixed_job(
        sizes,
        sizes.gpt(),
        steps,
        optimizer_config(),
        callbacks=(functools.partial(PruningCallback, config),),
        corpus_cache=cache_dir,
        corpus_bytes=CORPUS_BYTES,
        weights=weights,
    )
    static = str(uniform(sizes.num_layers, 2))
    splits = harness.two_stage_splits(sizes.num_layers, spread)
    return harness.compare_placements(  # after_move: does DynMo's move deliver its placement's speed?
        base, static, splits, harness.PARTITION_TIME, rounds, skip, "pruning", after_move=True
    )


# -- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(
        __doc__, "tiny sizes, one round", "repeats", "rounds", "spread", "settle", "measure"
    )
    parser.add_argument("--train-steps", type=int, default=None, help="single-process steps before pruning")
    parser.add_argument(
        "--prune-every", type=int, default=None, help="steps between pruning steps (4 of them)"
    )
    parser.add_argument("--skip-pipeline", action="store_true", help="parts 1, 2 and 4 only")
    args = parser.parse_args(argv)
    out = results_path("pruning", args.out, args.force)
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
        splits = {n: static_splits(at(levels[0], "dense").costs, n, embed, head) for n in stage_counts}
        sections = [
            "### 1. Per-layer forward + backward time of one micro-batch after global pruning",
            level_table(levels),
            "### 2. Stage-load imbalance (max - min) / mean under static splits",
            imbalance_table(levels, stage_counts, splits),
        ]
        if not args.skip_pipeline:
            skip = PRUNE_START + 3 * prune_every + 1 + settle
            steps = list(pruning_schedule(prune_every).steps)
            sections += [
                "### 3. Static vs DynMo on a real 2-stage CPU pipeline (pruning at steps "
                f"{steps} to 90%, measured from step {skip}, median of {rounds} round(s))",
                compare_pipeline(sizes, weights, tmp, skip + measure, prune_every, rounds, spread, skip),
            ]
        n = max(stage_counts)
        sections.append(
            f"### 4. Projection to {n} stages (simulated 1F1B, {sizes.microbatches} micro-batches)"
        )
        for view in ("auto", "ideal"):
            viewed = [at(lv, view) for lv in levels]
            rows = project(viewed, n, sizes.microbatches, splits[n])
            sections.append(
                "\n".join([f"#### {n} stages, {view} costs", "", *projection_table(viewed, rows)])
            )
    harness.finish(
        "pruning",
        out,
        [
            harness.header(
                "Gradual global pruning: layer times and DynMo",
                "pruning",
                argv,
                [harness.REAL, harness.EMULATED, harness.PROJECTED],
            ),
            f"Setup: pruning_gpt_config(num_layers={sizes.num_layers}, d_model={sizes.d_model}, "
            f"num_heads={sizes.num_heads}, seq_len={sizes.seq_len}), batch {sizes.batch_size} in "
            f"{sizes.microbatches} micro-batches ({sizes.rows} rows per Linear call), trained {train_steps} "
            f"steps on the stdlib corpus before pruning; one torch thread per process; times are the fastest "
            f"of {repeats} repeat(s). 'ideal' is emulated (module docstring), everything else is measured.",
            *sections,
        ],
        started,
    )


if __name__ == "__main__":
    main()
