"""What MoE routing does to layer times, and what DynMo makes of it: measured on CPU, projected to 8 stages.

Three parts, all with the ``"moe"`` block of :mod:`lightning_dynmo.dynamism.moe` (real compute, no sleep):

1. **Layer time follows the busiest expert.** One MoE block, one process: the expert bias is set to
   skew the routing towards expert 0 by steps (from the natural routing to every token picking it), and
   the block's forward + backward is timed at each level, levels interleaved, medians over repeats.
   Reported with the rows the experts computed (``num_experts * max load``) and a linear fit
   ``time = a + b * rows``.
2. **Static vs DynMo on a real 2-stage pipeline.** The ready MoE GPT (:func:`moe_gpt_config`) on the
   standard-library corpus trains on 2 gloo ranks (1F1B), each run one job started by torch's elastic
   launcher: the static uniform split, ``DynMoCallback(every_step=True)`` from the uniform split, and every
   fixed contiguous split within ``--spread`` layers of uniform (the candidates). Runs are interleaved
   over ``--rounds`` rounds (:mod:`benchmarks.harness`); a run's step time is the median of its steps
   after ``--skip``; ratios are taken within a round, each round's ideal being the candidate fastest in
   the other rounds.
3. **Projection to 8 stages.** A deeper MoE GPT trains in one process while the repo's layer timer
   (:class:`~lightning_dynmo.profiling.layer_timer.LayerTimer`) records every layer's forward and
   backward time at every step. The pipeline simulator
   (:func:`~lightning_dynmo.balancing.simulate_pipeline`, through ``policy.predict``) then replays the
   measured steps on 8 stages: the static uniform split; DynMo's every-step policy (the callback's
   smoothing and ``decide``, the placement chosen after step t used from step t + 1, migration time not
   counted); the best fixed placement (the partition of the run's mean costs); and the min-max
   partition of each step's own costs (an oracle of the balancer's objective, not of the simulated time,
   so DynMo can come out slightly ahead of it).

    python -m benchmarks.moe            # ~20 minutes on 2 quiet cores
    python -m benchmarks.moe --quick    # a smoke run (tiny sizes, one round): checks it works, not figures

Each part prints a table; the report goes to ``benchmarks/results/moe-<date>.md`` with the command.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import harness
from benchmarks.common import block_fwd_bwd_s, corpus_data, results_path
from lightning_dynmo.balancing import BalanceProblem, LayerCost, partition, uniform
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.policy import BalanceConfig, decide, predict, smooth_costs
from lightning_dynmo.dynamism.moe import MoEBlock, MoEOptions, moe_gpt_config
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.pipeline.step.aux_loss import collect_aux_losses
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.profiling.layer_timer import LayerTimer


@dataclass(frozen=True)
class Sizes(harness.ModelSizes):
    """Model and batch sizes of one benchmark mode (``num_layers``: the 2-stage pipeline's)."""

    num_experts: int
    top_k: int
    expert_width: int
    layers_projection: int

    def options(self, **extra: Any) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "expert_width": self.expert_width,
            **extra,
        }

    def gpt(self, num_layers: int) -> GPTConfig:
        return moe_gpt_config(**{**self.shape, "num_layers": num_layers}, **self.options())


FULL = Sizes.extend(
    harness.FULL_SIZES, seq_len=128, num_experts=8, top_k=2, expert_width=256, layers_projection=32
)
QUICK = Sizes.extend(
    harness.QUICK_SIZES, batch_size=8, num_experts=4, top_k=2, expert_width=64, layers_projection=8
)
PROJECTED_STAGES = 8


# -- 1. layer time vs the busiest expert --------------------------------------------------------


def layer_time_vs_load(sizes: Sizes, repeats: int) -> list[dict[str, float]]:
    """Forward + backward seconds of one MoE block at increasing routing skews (see the module doc)."""
    config = GPTConfig(
        seq_len=sizes.seq_len, num_layers=1, d_model=sizes.d_model, num_heads=sizes.num_heads, seed=0
    )
    torch.manual_seed(0)
    block = MoEBlock(config, MoEOptions(**sizes.options(bias_update_rate=1e-3)))
    block.init_weights(config)
    assert block.expert_bias is not None
    x = torch.randn(sizes.batch_size, sizes.seq_len, sizes.d_model)
    skews = [0.0, 0.02, 0.05, 0.1, 0.2, 10.0]
    times: dict[float, list[float]] = {s: [] for s in skews}
    rows: dict[float, int] = {}
    for rep in range(repeats + 1):  # the first round warms up
        for skew in skews:
            block.expert_bias.zero_()
            block.expert_bias[0] = skew
            elapsed = block_fwd_bwd_s(block, x)
            if rep:
                times[skew].append(elapsed)
            rows[skew] = block.rows_computed
    tokens = sizes.batch_size * sizes.seq_len
    out = []
    for skew in skews:
        out.append(
            {
                "skew": skew,
                "max_share": rows[skew] / sizes.num_experts / (tokens * sizes.top_k),
                "rows": rows[skew],
                "ms": 1e3 * statistics.median(times[skew]),
            }
        )
    return out


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x``: ``(a, b, r^2)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    syy = sum((y - my) ** 2 for y in ys)
    b = sxy / sxx if sxx else 0.0
    r2 = sxy * sxy / (sxx * syy) if sxx and syy else 0.0
    return my - b * mx, b, r2


def load_table(rows: list[dict[str, float]]) -> str:
    a, b, r2 = linear_fit([r["rows"] for r in rows], [r["ms"] for r in rows])
    lines = [
        "| expert-0 bias | busiest expert's share of slots | rows computed (E x max load) | fwd+bwd (ms) |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['skew']:g} | {r['max_share']:.2f} | {r['rows']:.0f} | {r['ms']:.2f} |" for r in rows]
    lines.append("")
    lines.append(f"Linear fit: time = {a:.2f} ms + {1e3 * b:.3f} us x rows, r^2 = {r2:.3f}.")
    return "\n".join(lines)


# -- 2. static vs DynMo on a real 2-stage pipeline ------------------------------------------------


def compare_pipeline(sizes: Sizes, steps: int, skip: int, rounds: int, spread: int) -> str:
    """Static uniform split, DynMo every step and every candidate, in rounds (:mod:`benchmarks.harness`)."""
    cache = tempfile.mkdtemp(prefix="dynmo-moe-bench-")
    corpus_data(sizes.seq_len, sizes.batch_size, cache).prepare_data()  # the ranks share a warm cache
    layers = sizes.num_layers
    base = harness.fixed_job(sizes, sizes.gpt(layers), steps, OptimizerConfig(), corpus_cache=cache)
    return harness.compare_placements(
        base,
        str(uniform(layers, 2)),
        harness.two_stage_splits(layers, spread),
        {"DynMo every_step": {"every_step": True}},
        rounds,
        skip,
        "moe",
        static_label="static (uniform)",
    )


# -- 3. measured per-layer times, replayed on 8 stages ------------------------------------------


def measure_layer_costs(sizes: Sizes, steps: int) -> tuple[list[list[LayerCost]], list[list[int]]]:
    """Per step, every layer's measured cost and computed expert rows (single process, 1F1B-like order)."""
    torch.manual_seed(0)
    model = GPT(sizes.gpt(sizes.layers_projection))
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    blocks = {int(k): b for k, b in model.layers.items()}
    timer = LayerTimer(blocks, StepClock("cpu"))
    generator = torch.Generator().manual_seed(1)
    costs, rows = [], []
    n = sizes.microbatches
    timer.attach()
    try:
        for _ in range(steps):
            batch = torch.randint(0, 256, (sizes.batch_size, sizes.seq_len + 1), generator=generator)
            timer.begin_step()
            for piece in batch.chunk(n):
                with collect_aux_losses(scale=1.0 / n, allowed=model.pipeline_aux_losses):
                    loss = model.pipeline_loss(model(piece[:, :-1]), piece[:, 1:])
                (loss / n).backward()
            times = timer.end_step()
            rows.append([b.step_rows for b in blocks.values() if isinstance(b, MoEBlock)])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for block in blocks.values():
                if isinstance(block, MoEBlock):
                    block.after_optimizer_step()
            costs.append(
                [
                    LayerCost(fwd_time_s=t.fwd_time_s, bwd_time_s=t.bwd_time_s)
                    for _, t in sorted(times.items())
                ]
            )
    finally:
        timer.detach()
    return costs, rows


def project(costs: list[list[LayerCost]], num_stages: int, microbatches: int, skip: int) -> dict[str, Any]:
    """Mean simulated step time (1F1B) of each placement policy over the measured steps after ``skip``."""
    num_layers = len(costs[0])
    uniform = Placement.from_sizes(
        [num_layers // num_stages + (s < num_layers % num_stages) for s in range(num_stages)]
    )
    measured = costs[skip:]
    mean = [
        LayerCost(
            fwd_time_s=statistics.fmean(c[i].fwd_time_s for c in measured),
            bwd_time_s=statistics.fmean(c[i].bwd_time_s for c in measured),
        )
        for i in range(num_layers)
    ]
    fixed = partition(BalanceProblem(mean), num_stages)
    config = BalanceConfig(balancer="partition", cost="time")
    current, smoothed = uniform, None
    totals = {"static": 0.0, "dynmo": 0.0, "best_fixed": 0.0, "oracle": 0.0}
    moves = 0
    for t, step in enumerate(costs):
        if t >= skip:
            totals["static"] += predict(BalanceProblem(step), uniform, microbatches, "1F1B")[0]
            totals["dynmo"] += predict(BalanceProblem(step), current, microbatches, "1F1B")[0]
            totals["best_fixed"] += predict(BalanceProblem(step), fixed, microbatches, "1F1B")[0]
            totals["oracle"] += predict(
                BalanceProblem(step), partition(BalanceProblem(step), num_stages), microbatches, "1F1B"
            )[0]
        smoothed = smooth_costs(smoothed, step, 0.8)  # DynMoCallback's every-step default
        decision = decide(config.problem(smoothed), current, config, microbatches, "1F1B")
        if decision.apply:
            current, moves = decision.proposed, moves + 1
    count = len(measured)
    return {**{k: v / count for k, v in totals.items()}, "moves": moves, "fixed": str(fixed)}


def projection_table(
    sim: dict[str, Any], costs: list[list[LayerCost]], rows: list[list[int]], skip: int
) -> str:
    times = [c.time_s for step in costs[skip:] for c in step]
    flat_rows = [float(r) for step in rows[skip:] for r in step]
    _, _, r2 = linear_fit(flat_rows, times)
    per_layer = [statistics.fmean(step[i].time_s for step in costs[skip:]) for i in range(len(costs[0]))]
    spread = (max(per_layer) - min(per_layer)) / statistics.fmean(per_layer)
    lines = [
        "| policy (simulated 1F1B, measured layer times) | mean step (ms) | static / this | this / DynMo |",
        "|---|---:|---:|---:|",
    ]
    for key, label in (
        ("static", "static uniform split"),
        ("dynmo", f"DynMo every_step ({sim['moves']} moves)"),
        ("best_fixed", f"best fixed placement `{sim['fixed']}`"),
        ("oracle", "per-step min-max partition (knows each step's costs)"),
    ):
        ms, vs_static, vs_dynmo = 1e3 * sim[key], sim["static"] / sim[key], sim[key] / sim["dynmo"]
        lines.append(f"| {label} | {ms:.2f} | {vs_static:.3f}x | {vs_dynmo:.3f} |")
    lines.append("")
    lines.append(
        f"Per-layer time vs expert rows computed, over every layer and step: r^2 = {r2:.3f}. Spread of the "
        f"layers' mean times (max - min) / mean = {spread:.1%}."
    )
    return "\n".join(lines)


# -- the report --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(
        __doc__, "tiny sizes and one round", "repeats", "steps", "skip", "rounds", "spread"
    )
    parser.add_argument("--projection-steps", type=int, default=None, help="part 3: measured training steps")
    args = parser.parse_args(argv)
    out = results_path("moe", args.out, args.force)
    quick = args.quick
    torch.set_num_threads(1)  # as each pipeline rank: parts 1 and 3 time what one rank's core does
    sizes = QUICK if quick else FULL
    repeats = args.repeats or (2 if quick else 15)
    steps = args.steps or (8 if quick else 40)
    skip = args.skip if args.skip is not None else (3 if quick else 10)
    rounds = args.rounds or (1 if quick else 3)
    spread = args.spread if args.spread is not None else (1 if quick else 2)
    projection_steps = args.projection_steps or (6 if quick else 40)
    if skip + 3 > steps or projection_steps < 2:
        parser.error("--steps must leave at least 3 measured steps after --skip; --projection-steps >= 2")
    started = time.perf_counter()
    labels = [harness.REAL, harness.PROJECTED]
    opening = harness.header("MoE: layer time, static vs DynMo, projection", "moe", argv, labels)
    load = load_table(layer_time_vs_load(sizes, repeats))
    pipeline = compare_pipeline(sizes, steps, skip, rounds, spread)
    projection_skip = min(skip, projection_steps // 2)
    costs, rows = measure_layer_costs(sizes, projection_steps)
    sim = project(costs, min(PROJECTED_STAGES, sizes.layers_projection), sizes.microbatches, projection_skip)
    projection = projection_table(sim, costs, rows, projection_skip)
    setup = (
        f"MoE GPT: d_model {sizes.d_model}, {sizes.num_heads} heads, seq_len {sizes.seq_len}, batch "
        f"{sizes.batch_size}, {sizes.num_experts} experts top-{sizes.top_k} of width {sizes.expert_width}, "
        f"dropless, softmax scores, every block MoE; {sizes.microbatches} micro-batches, 1F1B."
    )
    harness.finish(
        "moe",
        out,
        [
            opening,
            setup,
            f"### 1. One MoE block: time follows the busiest expert ({repeats} repeats, medians)",
            load,
            f"### 2. {sizes.num_layers} MoE blocks on a real 2-stage CPU pipeline "
            f"({harness.rounds_note(rounds, steps, skip)})",
            pipeline,
            f"### 3. {sizes.layers_projection} MoE blocks, measured per layer in one process over "
            f"{projection_steps} steps, replayed on {min(PROJECTED_STAGES, sizes.layers_projection)} stages",
            projection,
        ],
        started,
    )


if __name__ == "__main__":
    main()
