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
   candidates. Runs are interleaved over ``--rounds`` rounds (:mod:`benchmarks._lib.harness`); a run's step
   time is the median of its steps after the freeze plus ``--settle``; ratios are taken within a round,
   each round's ideal being the candidate fastest in the other rounds. Every fixed split also runs with
   ``DynMoCallback(balancer="static")`` attached (measuring only), so the report can say whether DynMo's
   steps after its move match the same placement run fixed (:func:`benchmarks._lib.harness.after_move_lines`).
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

import functools
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks._lib import harness
from benchmarks._lib import levels as study
from benchmarks._lib.common import results_path
from lightning_dynmo.balancing import LayerCost, Placement, uniform
from lightning_dynmo.dynamism.freezing import FreezingConfig
from lightning_dynmo.dynamism_callbacks import FreezingCallback
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig

FRACTIONS = (0.0, 0.25, 0.5, 0.75)
STATES = ("trainable", "frozen behind a trainable layer", "frozen prefix")


@dataclass(frozen=True)
class Sizes(harness.ModelSizes):
    """Model and batch sizes of one benchmark mode: a dense GPT over bytes."""

    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab_size=256, blocks="dense", **self.shape)


FULL = Sizes.extend(harness.FULL_SIZES, num_layers=16)
QUICK = Sizes.extend(harness.QUICK_SIZES, seq_len=16)


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
            samples[STATES[0]].append(study.fwd_bwd_s(lambda: block(x), [x, *params]))  # noqa: B023
            for p in params:
                p.requires_grad_(False)
            samples[STATES[1]].append(study.fwd_bwd_s(lambda: block(x), [x]))  # noqa: B023
            samples[STATES[2]].append(forward_s(lambda: block(x.detach())))  # noqa: B023
            for p in params:
                p.requires_grad_(True)
        for state in STATES:
            out[state].append(study.fastest(samples[state][1:]))
    return out


def part_times(
    model: GPT, sizes: Sizes, repeats: int
) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
    """The first-stage parts trainable and frozen (forward only), and the last-stage parts plus the loss."""
    vocab = sizes.gpt().vocab_size
    parts = study.end_parts(
        model, vocab, sizes.batch_size // sizes.microbatches, sizes.seq_len, sizes.d_model
    )
    with torch.no_grad():
        frozen = [forward_s(parts.first) for _ in range(repeats + 1)][1:]
    first = {
        "trainable": study.fastest_of(parts.first, parts.first_inputs, repeats),
        "frozen": study.fastest(frozen),
    }
    return first, study.fastest_of(parts.last, parts.last_inputs, repeats)


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


def level_of(times: Times, fraction: float) -> study.LevelCosts:
    """Per-micro-batch costs with the first ``fraction`` of the blocks frozen (a frozen prefix)."""
    frozen = round(fraction * len(times.params))
    costs = [
        LayerCost(fwd_time_s=f, bwd_time_s=b, num_params=p)
        for i, p in enumerate(times.params)
        for f, b in [times.blocks[STATES[2] if i < frozen else STATES[0]][i]]
    ]
    first = times.first["frozen" if frozen else "trainable"]
    return study.LevelCosts(f"{fraction:.0%} frozen", costs, first, times.last)


def imbalance_table(levels: list[study.LevelCosts], splits: dict[int, dict[str, Placement]]) -> str:
    lines = [
        "| stages | split | placement | " + " | ".join(lv.label for lv in levels) + " |",
        "|---:|---|---|" + "---:|" * len(levels),
    ]
    for n, named in splits.items():
        for name, placement in named.items():
            values = [study.stage_imbalance(lv, placement) for lv in levels]
            lines.append(f"| {n} | {name} | `{placement}` | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines)


# -- part 3: real 2-stage pipeline -----------------------------------------------------------------------


def compare_pipeline(sizes: Sizes, steps: int, freeze_at: int, rounds: int, spread: int, skip: int) -> str:
    """Static uniform split, DynMo partition/time and the candidates, in rounds (the harness)."""
    config = FreezingConfig(criterion="schedule", schedule=((freeze_at, sizes.num_layers // 2),))
    optimizer = OptimizerConfig(lr=3e-3, weight_decay=0.1)
    callbacks = (functools.partial(FreezingCallback, config),)
    base = harness.fixed_job(sizes, sizes.gpt(), steps, optimizer, callbacks=callbacks)
    static = str(uniform(sizes.num_layers, 2))
    # Freezing the front makes the first stage light: the good splits give it more layers.
    splits = harness.two_stage_splits(sizes.num_layers, spread, below=1)
    return harness.compare_placements(  # after_move: does DynMo's move deliver its placement's speed?
        base, static, splits, harness.PARTITION_TIME, rounds, skip, "freezing", after_move=True
    )


# -- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(
        __doc__, "tiny sizes, one round", "repeats", "rounds", "spread", "settle", "measure"
    )
    parser.add_argument("--skip-pipeline", action="store_true", help="parts 1, 2 and 4 only")
    args = parser.parse_args(argv)
    out = results_path("freezing", args.out, args.force)
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
    splits = {n: study.static_splits(levels[0].costs, n, embed, head) for n in stage_counts}
    sections = [
        "### 1. Per-layer forward + backward time of one micro-batch, frozen vs trainable",
        time_table(times),
        "### 2. Stage-load imbalance (max - min) / mean under static splits after freezing a prefix",
        imbalance_table(levels, splits),
    ]
    if not args.skip_pipeline:
        freeze_at = 2
        skip = freeze_at + 1 + settle
        sections += [
            f"### 3. Static vs DynMo on a real 2-stage CPU pipeline (the first {sizes.num_layers // 2} of "
            f"{sizes.num_layers} blocks frozen at step {freeze_at}, measured from step {skip}, median of "
            f"{rounds} round(s))",
            compare_pipeline(sizes, skip + measure, freeze_at, rounds, spread, skip),
        ]
    n = max(stage_counts)
    sections += [
        f"### 4. Projection to {n} stages (simulated 1F1B, {sizes.microbatches} micro-batches, part 1's "
        "costs)",
        "\n".join(study.projection_table(levels, study.project(levels, n, sizes.microbatches, splits[n]))),
    ]
    harness.finish(
        "freezing",
        out,
        [
            harness.header(
                "Layer freezing: layer times and DynMo", "freezing", argv, [harness.REAL, harness.PROJECTED]
            ),
            f"Setup: dense GPT (num_layers={sizes.num_layers}, d_model={sizes.d_model}, "
            f"num_heads={sizes.num_heads}, seq_len={sizes.seq_len}), batch {sizes.batch_size} in "
            f"{sizes.microbatches} micro-batches; one torch thread per process; times are the fastest of "
            f"{repeats} repeat(s). Parts 1-3 are measured, part 4 is simulated from part 1's measurements.",
            *sections,
        ],
        started,
    )


if __name__ == "__main__":
    main()
