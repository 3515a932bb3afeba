"""What hash-based sparse attention does to layer times, and what DynMo makes of it: measured on CPU.

Four parts, all with the ``"sparse_attention"`` block of :mod:`lightning_dynmo.dynamism.sparse_attention`
(real compute, no sleep):

1. **Layer time follows the active tiles.** One block, one process, the same weights and input hashed
   into 1 (dense causal), 2, 4, ... buckets; forward + backward timed per bucket count, counts
   interleaved, medians over repeats. Reported with the active fraction of the tiles and a linear fit
   ``time = a + b * active tiles``, next to the dense block (torch's fused causal attention).
2. **Per-layer work and the static splits.** A deeper sparse GPT trains in one process on the
   standard-library corpus while the repo's layer timer
   (:class:`~lightning_dynmo.profiling.layer_timer.LayerTimer`) records every layer's forward and
   backward time at every step, and each block its active fraction. Per layer: the mean active
   fraction and time, the step-to-step spread and the lag-1 autocorrelation of the fraction (how much
   of a step's deviation persists into the next: this decides the trigger). Then the stage-load
   imbalance ``(max - min) / mean`` of each measured step under the static uniform split and the
   parameter split, on 2 and 8 stages.
3. **Projection to 8 stages.** The measured steps of part 2 replayed with the pipeline simulator
   (:func:`~lightning_dynmo.balancing.simulate_pipeline`, through ``policy.predict``): the static
   uniform and parameter splits; DynMo every step (the callback's smoothing and ``decide``, the placement
   chosen after step t used from step t + 1); DynMo periodic (every ``--period`` steps, on the median of
   the last 3 steps, as a profiling window measures); the best fixed placement (the partition of the
   run's mean costs) and the min-max partition of each step's own costs (an oracle of the balancer's
   objective, not of the simulated time). Migration time is not counted.
4. **Static vs DynMo on a real 2-stage pipeline.** The ready sparse GPT
   (:func:`sparse_attention_gpt_config`) trains on 2 gloo ranks (1F1B), each run one job started by
   torch's elastic launcher: the static uniform split, DynMo periodic (``every_n_steps=--period``), DynMo
   every step, and every fixed contiguous split within ``--spread`` layers of uniform (the candidates).
   Runs are interleaved over ``--rounds`` rounds (:mod:`benchmarks.harness`); a run's step time is the
   median of its steps after ``--skip``; ratios are taken within a round, each round's ideal being the
   candidate fastest in the other rounds.

    python -m benchmarks.sparse_attention            # ~30 minutes on 2 quiet cores
    python -m benchmarks.sparse_attention --quick    # a smoke run (tiny sizes, one round): not figures

Each part prints a table; the report goes to ``benchmarks/results/sparse_attention-<date>.md`` with the
command.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import harness
from benchmarks.common import block_fwd_bwd_s, corpus_data, results_path
from benchmarks.moe import linear_fit
from lightning_dynmo.balancing import BalanceProblem, LayerCost, by_parameters, imbalance, partition, uniform
from lightning_dynmo.balancing.policy import BalanceConfig, decide, predict, smooth_costs
from lightning_dynmo.dynamism.sparse_attention import (
    SparseAttentionBlock,
    SparseAttentionOptions,
    sparse_attention_gpt_config,
)
from lightning_dynmo.models import GPT, DenseBlock, GPTConfig, OptimizerConfig
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.profiling.layer_timer import LayerTimer


@dataclass(frozen=True)
class Sizes(harness.ModelSizes):
    """Model and batch sizes of one benchmark mode (``num_layers``: the 2-stage pipeline's)."""

    num_buckets: int
    block_size: int
    layers_projection: int

    def gpt(self, num_layers: int) -> GPTConfig:
        return sparse_attention_gpt_config(
            **{**self.shape, "num_layers": num_layers},
            num_buckets=self.num_buckets,
            block_size=self.block_size,
        )


FULL = Sizes.extend(
    harness.FULL_SIZES,
    d_model=64,
    num_heads=2,
    seq_len=512,
    num_buckets=8,
    block_size=16,
    layers_projection=16,
)
QUICK = Sizes.extend(harness.QUICK_SIZES, seq_len=64, num_buckets=4, block_size=8, layers_projection=4)
PROJECTED_STAGES = 8
PERIODIC_WINDOW = 3  # steps a periodic profiling window measures (DynMoCallback's default)


# -- 1. layer time vs active tiles ----------------------------------------------------------------------


def layer_time_vs_tiles(sizes: Sizes, repeats: int) -> list[dict[str, Any]]:
    """Forward + backward ms of one block per bucket count, and of the dense block (see the module doc)."""
    config = GPTConfig(
        seq_len=sizes.seq_len, num_layers=1, d_model=sizes.d_model, num_heads=sizes.num_heads, seed=0
    )
    torch.manual_seed(0)
    dense = DenseBlock(config)
    counts = [b for b in (1, 2, 4, 8, 16, 32) if b * sizes.block_size <= 4 * sizes.seq_len]
    blocks: dict[Any, Any] = {"dense": dense}
    for count in counts:
        block = SparseAttentionBlock(
            config, SparseAttentionOptions(num_buckets=count, block_size=sizes.block_size)
        )
        block.load_state_dict(dense.state_dict(), strict=False)  # same weights; the count stays 0
        blocks[count] = block.train()
    x = torch.randn(sizes.batch_size // sizes.microbatches, sizes.seq_len, sizes.d_model)
    times: dict[Any, list[float]] = {key: [] for key in blocks}
    active: dict[Any, list[float]] = {key: [] for key in counts}
    for rep in range(repeats + 1):  # the first round warms up
        for key, block in blocks.items():
            elapsed = block_fwd_bwd_s(block, x)
            if rep:
                times[key].append(elapsed)
                if key != "dense":
                    active[key].append(block.active_blocks / block.causal_blocks)
    causal = blocks[counts[0]].causal_blocks
    rows = [
        {
            "buckets": "dense (SDPA)",
            "fraction": 1.0,
            "tiles": None,
            "ms": 1e3 * statistics.median(times["dense"]),
        }
    ]
    for count in counts:
        fraction = statistics.fmean(active[count])
        rows.append(
            {
                "buckets": count,
                "fraction": fraction,
                "tiles": fraction * causal,
                "ms": 1e3 * statistics.median(times[count]),
            }
        )
    return rows


def tiles_table(rows: list[dict[str, Any]]) -> str:
    sparse = [r for r in rows if r["tiles"] is not None]
    a, b, r2 = linear_fit([r["tiles"] for r in sparse], [r["ms"] for r in sparse])
    lines = ["| buckets | active tiles / causal tiles | fwd+bwd (ms) |", "|---|---:|---:|"]
    lines += [f"| {r['buckets']} | {r['fraction']:.3f} | {r['ms']:.2f} |" for r in rows]
    lines.append("")
    lines.append(
        f"Linear fit over the hashed rows: time = {a:.2f} ms + {1e3 * b:.2f} us x active tiles, "
        f"r^2 = {r2:.3f}."
    )
    return "\n".join(lines)


# -- 2. measured per-layer work, the static splits ------------------------------------------------------


@dataclass
class Measured:
    """Per step, every layer's cost and active fraction (single process)."""

    costs: list[list[LayerCost]]
    fractions: list[list[float]]


def measure_layers(sizes: Sizes, steps: int, cache_dir: str) -> Measured:
    """Train ``steps`` steps in one process, recording layer costs and active fractions per step."""
    torch.manual_seed(0)
    model = GPT(sizes.gpt(sizes.layers_projection))
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    blocks = {int(k): b for k, b in model.layers.items()}
    params = {i: sum(p.numel() for p in b.parameters()) for i, b in blocks.items()}
    timer = LayerTimer(blocks, StepClock("cpu"))
    data = corpus_data(sizes.seq_len, sizes.batch_size, cache_dir)
    data.prepare_data()
    data.setup("fit")
    batches = iter(data.train_dataloader())
    measured = Measured([], [])
    n = sizes.microbatches
    timer.attach()
    try:
        for _ in range(steps):
            batch = next(batches)
            timer.begin_step()
            for piece in batch.chunk(n):
                loss = model.pipeline_loss(model(piece[:, :-1]), piece[:, 1:])
                (loss / n).backward()
            times = timer.end_step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for block in blocks.values():
                block.after_optimizer_step()
            measured.fractions.append([blocks[i].active_fraction for i in sorted(blocks)])
            measured.costs.append(
                [
                    LayerCost(fwd_time_s=t.fwd_time_s, bwd_time_s=t.bwd_time_s, num_params=params[i])
                    for i, t in sorted(times.items())
                ]
            )
    finally:
        timer.detach()
    return measured


def _lag1(values: list[float]) -> float:
    mean = statistics.fmean(values)
    dev = [v - mean for v in values]
    denominator = sum(d * d for d in dev)
    return sum(a * b for a, b in itertools.pairwise(dev)) / denominator if denominator else 0.0


def layers_table(measured: Measured, skip: int) -> str:
    fractions, costs = measured.fractions[skip:], measured.costs[skip:]
    lines = [
        "| layer | mean active fraction | step-to-step sd | lag-1 autocorrelation | mean fwd+bwd (ms) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for i in range(len(fractions[0])):
        series = [f[i] for f in fractions]
        ms = 1e3 * statistics.fmean(c[i].time_s for c in costs)
        lines.append(
            f"| {i} | {statistics.fmean(series):.3f} | {statistics.pstdev(series):.3f} "
            f"| {_lag1(series):+.2f} | {ms:.1f} |"
        )
    flat_f = [f for step in fractions for f in step]
    flat_t = [c.time_s for step in costs for c in step]
    _, _, r2 = linear_fit(flat_f, flat_t)
    lines.append("")
    lines.append(f"Per-layer time vs active fraction, over every layer and step: r^2 = {r2:.3f}.")
    return "\n".join(lines)


def static_imbalance_table(measured: Measured, skip: int) -> str:
    costs = measured.costs[skip:]
    num_layers = len(costs[0])
    lines = [
        "| stages | split | placement | mean stage-load imbalance (max - min) / mean |",
        "|---:|---|---|---:|",
    ]
    for stages in sorted({2, min(PROJECTED_STAGES, num_layers)}):
        for label, placement in (
            ("static uniform", uniform(num_layers, stages)),
            ("parameters", by_parameters(costs[0], stages)),
            (
                "best fixed (partition of the mean costs)",
                partition(BalanceProblem(_mean_costs(costs)), stages),
            ),
        ):
            loads = [
                imbalance([sum(step[i].time_s for i in placement.layers_of(s)) for s in range(stages)])
                for step in costs
            ]
            lines.append(f"| {stages} | {label} | `{placement}` | {statistics.fmean(loads):.1%} |")
    return "\n".join(lines)


def _mean_costs(costs: list[list[LayerCost]]) -> list[LayerCost]:
    return [
        LayerCost(
            fwd_time_s=statistics.fmean(c[i].fwd_time_s for c in costs),
            bwd_time_s=statistics.fmean(c[i].bwd_time_s for c in costs),
            num_params=costs[0][i].num_params,
        )
        for i in range(len(costs[0]))
    ]


# -- 3. projection to 8 stages --------------------------------------------------------------------------


def project(
    costs: list[list[LayerCost]], num_stages: int, microbatches: int, skip: int, period: int
) -> dict[str, Any]:
    """Mean simulated step time (1F1B) of each placement policy over the measured steps after ``skip``."""
    num_layers = len(costs[0])
    static = uniform(num_layers, num_stages)
    params = by_parameters(costs[0], num_stages)
    fixed = partition(BalanceProblem(_mean_costs(costs[skip:])), num_stages)
    config = BalanceConfig(balancer="partition", cost="time")
    every, periodic, smoothed = static, static, None
    totals = dict.fromkeys(("static", "params", "every_step", "periodic", "best_fixed", "oracle"), 0.0)
    moves = {"every_step": 0, "periodic": 0}
    for t, step in enumerate(costs):
        if t >= skip:
            for key, placement in (
                ("static", static),
                ("params", params),
                ("every_step", every),
                ("periodic", periodic),
                ("best_fixed", fixed),
                ("oracle", partition(BalanceProblem(step), num_stages)),
            ):
                totals[key] += predict(BalanceProblem(step), placement, microbatches, "1F1B")[0]
        smoothed = smooth_costs(smoothed, step, 0.8)  # DynMoCallback's every-step default
        decision = decide(config.problem(smoothed), every, config, microbatches, "1F1B")
        if decision.apply:
            every, moves["every_step"] = decision.proposed, moves["every_step"] + 1
        if (t + 1) % period == 0 and t + 1 >= PERIODIC_WINDOW:
            window = costs[t + 1 - PERIODIC_WINDOW : t + 1]
            median = [
                LayerCost(
                    fwd_time_s=statistics.median(c[i].fwd_time_s for c in window),
                    bwd_time_s=statistics.median(c[i].bwd_time_s for c in window),
                )
                for i in range(num_layers)
            ]
            decision = decide(config.problem(median), periodic, config, microbatches, "1F1B")
            if decision.apply:
                periodic, moves["periodic"] = decision.proposed, moves["periodic"] + 1
    count = len(costs) - skip
    return {
        **{k: v / count for k, v in totals.items()},
        "moves": moves,
        "fixed": str(fixed),
        "params_split": str(params),
    }


def projection_table(sim: dict[str, Any], period: int) -> str:
    lines = [
        "| policy (simulated 1F1B, measured layer times) | mean step (ms) | static / this "
        "| best fixed / this |",
        "|---|---:|---:|---:|",
    ]
    for key, label in (
        ("static", "static uniform split"),
        ("params", f"parameter split `{sim['params_split']}`"),
        ("every_step", f"DynMo every_step ({sim['moves']['every_step']} moves)"),
        ("periodic", f"DynMo every {period} steps ({sim['moves']['periodic']} moves)"),
        ("best_fixed", f"best fixed placement `{sim['fixed']}`"),
        ("oracle", "per-step min-max partition (knows each step's costs)"),
    ):
        ms = 1e3 * sim[key]
        lines.append(
            f"| {label} | {ms:.2f} | {sim['static'] / sim[key]:.3f}x | {sim['best_fixed'] / sim[key]:.3f} |"
        )
    return "\n".join(lines)


# -- 4. static vs DynMo on a real 2-stage pipeline ------------------------------------------------------


def compare_pipeline(
    sizes: Sizes, steps: int, skip: int, rounds: int, spread: int, period: int, cache: str
) -> str:
    """Static uniform split, DynMo (periodic, every step), every candidate, in rounds (the harness)."""
    layers = sizes.num_layers
    base = harness.fixed_job(sizes, sizes.gpt(layers), steps, OptimizerConfig(), corpus_cache=cache)
    dynmo = {
        f"DynMo every_n_steps={period}": {"every_n_steps": period},
        "DynMo every_step": {"every_step": True},
    }
    static = str(uniform(layers, 2))
    splits = harness.two_stage_splits(layers, spread)
    return harness.compare_placements(
        base, static, splits, dynmo, rounds, skip, "sparse_attention", static_label="static (uniform)"
    )


# -- the report -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(
        __doc__, "tiny sizes and one round", "repeats", "steps", "skip", "rounds", "spread"
    )
    parser.add_argument("--measure-steps", type=int, default=None, help="parts 2-3: measured training steps")
    parser.add_argument("--period", type=int, default=None, help="parts 3-4: DynMo's every_n_steps")
    args = parser.parse_args(argv)
    out = results_path("sparse_attention", args.out, args.force)
    quick = args.quick
    torch.set_num_threads(1)  # as each pipeline rank: parts 1-2 time what one rank's core does
    sizes = QUICK if quick else FULL
    repeats = args.repeats or (2 if quick else 10)
    measure_steps = args.measure_steps or (6 if quick else 80)
    period = args.period or (2 if quick else 10)
    steps = args.steps or (8 if quick else 60)
    skip = args.skip if args.skip is not None else (2 if quick else 20)
    rounds = args.rounds or (1 if quick else 3)
    spread = args.spread if args.spread is not None else (1 if quick else 2)
    if skip + 3 > min(steps, measure_steps):
        parser.error("--steps and --measure-steps must leave at least 3 measured steps after --skip")
    started = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="dynmo-sparse-bench-")
    tiles = tiles_table(layer_time_vs_tiles(sizes, repeats))
    measured = measure_layers(sizes, measure_steps, cache)
    layers = layers_table(measured, skip)
    static = static_imbalance_table(measured, skip)
    stages = min(PROJECTED_STAGES, sizes.layers_projection)
    projection = projection_table(project(measured.costs, stages, sizes.microbatches, skip, period), period)
    pipeline = compare_pipeline(sizes, steps, skip, rounds, spread, period, cache)
    setup = (
        f"Sparse-attention GPT: d_model {sizes.d_model}, {sizes.num_heads} heads, seq_len {sizes.seq_len}, "
        f"batch {sizes.batch_size}, {sizes.num_buckets} buckets, tiles of {sizes.block_size}, every block "
        f"sparse; {sizes.microbatches} micro-batches, 1F1B; byte tokens of the standard library's sources."
    )
    harness.finish(
        "sparse_attention",
        out,
        [
            harness.header(
                "Sparse attention: layer time, imbalance, projection, static vs DynMo",
                "sparse_attention",
                argv,
                [harness.REAL, harness.PROJECTED],
            ),
            setup,
            f"### 1. One block: time follows the active tiles ({repeats} repeats, medians)",
            tiles,
            f"### 2. {sizes.layers_projection} blocks measured per layer in one process over {measure_steps} "
            f"steps (statistics of steps {skip}+)",
            layers,
            static,
            f"### 3. The measured steps replayed on {stages} stages",
            projection,
            f"### 4. {sizes.num_layers} blocks on a real 2-stage CPU pipeline "
            f"({harness.rounds_note(rounds, steps, skip)})",
            pipeline,
        ],
        started,
    )


if __name__ == "__main__":
    main()
