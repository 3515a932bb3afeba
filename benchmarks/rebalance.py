"""Static vs DynMo on a 2-process CPU pipeline whose layer costs change during training.

A DemoGPT whose blocks have an emulated cost (they sleep, so timings mean something on 2 cores) trains
with ``DynMoStrategy`` (1F1B, 2 stages, uniform start). At ``--change-at`` the cost profile changes the way
a dynamic model's does (``early_exit``: the last half of the blocks keep a tenth of their work;
``freezing``: the first half loses its backward pass) and announces it with ``notify_dynamism``. Each run
is one real 2-process job started by torch's elastic launcher (what ``torchrun`` uses):

- ``static``: no rebalancing (Megatron-LM's uniform split), the baseline;
- ``partition/time``, ``diffusion/time``, ``partition/params``: ``DynMoCallback`` with that balancer and
  cost view, rebalancing on the dynamism event;
- ``ideal``: the exact min-max placement of the post-change costs, fixed from the start (no
  rebalancing cost at all): the best any contiguous placement can do. It is computed from the known
  emulated costs, not picked by measurement, so it carries no winner's curse.

It prints, for each run, the median step time before and after the change, the speedup over static and
achieved / ideal, and writes the table to ``benchmarks/results/rebalance-<date>.md``.

    python -m benchmarks.rebalance            # both scenarios, ~3 minutes
    python -m benchmarks.rebalance --quick    # early exit only, fewer steps, ~1 minute
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks import harness
from benchmarks.common import StepTimer, fit_demo_gpt, results_path
from lightning_dynmo.balancing import BalanceProblem, LayerCost, partition
from lightning_dynmo.callback import DynMoCallback
from lightning_dynmo.demos.dynamics import ScheduledCostChange
from lightning_dynmo.strategy import DynMoStrategy


@dataclass(frozen=True)
class Scenario:
    """A cost profile change: per-block factors applied at the change step."""

    name: str
    scale: dict[int, float]
    bwd_scale: dict[int, float] = field(default_factory=dict)
    kind: str = "custom"


def scenarios(num_layers: int) -> dict[str, Scenario]:
    half = num_layers // 2
    return {
        "early_exit": Scenario("early_exit", {i: 0.1 for i in range(half, num_layers)}),
        "freezing": Scenario("freezing", {}, {i: 0.0 for i in range(half)}, kind="frozen"),
    }


@dataclass(frozen=True)
class RunSpec:
    """One training job of the comparison."""

    label: str
    scenario: Scenario
    num_layers: int
    fwd_ms: float
    steps: int
    change_at: int
    num_microbatches: int
    balancer: str | None = None  # None: no DynMoCallback
    cost: str = "time"
    placement: str = "uniform"


def post_change_costs(spec: RunSpec) -> list[LayerCost]:
    """The emulated per-layer costs after the change, as the balancer would see them ideally."""
    costs = []
    for i in range(spec.num_layers):
        fwd = spec.fwd_ms * spec.scenario.scale.get(i, 1.0)
        bwd = 2 * spec.fwd_ms * spec.scenario.bwd_scale.get(i, spec.scenario.scale.get(i, 1.0))
        costs.append(LayerCost(fwd_time_s=fwd / 1e3, bwd_time_s=bwd / 1e3))
    return costs


def train(spec: RunSpec) -> dict[str, Any]:
    """Body of one rank (started by the elastic launcher): fit and report rank 0's step times."""
    torch.set_num_threads(1)
    timer = StepTimer()
    change = ScheduledCostChange(
        spec.change_at, spec.scenario.scale, spec.scenario.bwd_scale, kind=spec.scenario.kind
    )
    callbacks: list[pl.Callback] = [change, timer]
    dynmo = None
    if spec.balancer is not None:
        dynmo = DynMoCallback(balancer=spec.balancer, cost=spec.cost)
        callbacks.append(dynmo)
    strategy = DynMoStrategy(
        num_microbatches=spec.num_microbatches, schedule="1F1B", placement=spec.placement
    )
    fit_demo_gpt(strategy, callbacks, spec.steps, [spec.fwd_ms] * spec.num_layers)
    return {
        "step_s": timer.step_s,
        "placement": str(strategy.placement),
        "rebalances": len(dynmo.rebalances) if dynmo else 0,
        "overhead_s": dynmo.overhead_s if dynmo else 0.0,
    }


def summarize(spec: RunSpec, report: dict[str, Any], settle: int) -> dict[str, Any]:
    steps = report["step_s"]
    before = steps[1 : spec.change_at]  # step 0 includes shape inference
    after = steps[spec.change_at + settle :]
    return {
        "label": spec.label,
        "before_ms": 1e3 * statistics.median(before),
        "after_ms": 1e3 * statistics.median(after),
        "placement": report["placement"],
        "rebalances": report["rebalances"],
        "overhead_s": report["overhead_s"],
    }


def compare(scenario: Scenario, args: argparse.Namespace) -> list[dict[str, Any]]:
    base = RunSpec(
        label="static",
        scenario=scenario,
        num_layers=args.layers,
        fwd_ms=args.fwd_ms,
        steps=args.steps,
        change_at=args.change_at,
        num_microbatches=args.microbatches,
    )
    ideal = str(partition(BalanceProblem(post_change_costs(base)), 2))
    specs = [
        base,
        _with(base, label="DynMo partition/time", balancer="partition", cost="time"),
        _with(base, label="DynMo diffusion/time", balancer="diffusion", cost="time"),
        _with(base, label="DynMo partition/params", balancer="partition", cost="params"),
        _with(base, label=f"ideal (fixed {ideal})", placement=ideal),
    ]
    jobs = {spec.label: spec for spec in specs}
    runs = harness.run_rounds(jobs, train, 1, scenario.name, start_method="fork")
    rows = [summarize(spec, runs[spec.label][0], args.settle) for spec in specs]
    static_ms, ideal_ms = rows[0]["after_ms"], rows[-1]["after_ms"]
    for row in rows:
        row["speedup"] = static_ms / row["after_ms"]
        row["achieved_vs_ideal"] = ideal_ms / row["after_ms"]
    return rows


def _with(spec: RunSpec, **changes: Any) -> RunSpec:
    return RunSpec(**{**spec.__dict__, **changes})


def table(scenario: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"### {scenario}",
        "",
        "| run | step before (ms) | step after (ms) | speedup vs static | ideal / achieved "
        "| final placement | rebalances | DynMo overhead (s) |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['before_ms']:.1f} | {r['after_ms']:.1f} | {r['speedup']:.2f}x "
            f"| {r['achieved_vs_ideal']:.2f} | `{r['placement']}` | {r['rebalances']} "
            f"| {r['overhead_s']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)  # the ranks are forked from this process (common.launch)
    parser = harness.argument_parser(__doc__, "early exit only, fewer steps", "steps", "settle")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--fwd-ms", type=float, default=4.0, help="emulated forward ms per block per micro-batch"
    )
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--change-at", type=int, default=None)
    args = parser.parse_args(argv)
    out = results_path("rebalance", args.out, args.force)
    args.steps = args.steps or (24 if args.quick else 40)
    args.change_at = args.change_at or (6 if args.quick else 10)
    args.settle = args.settle if args.settle is not None else (6 if args.quick else 8)
    if args.change_at + args.settle + 3 > args.steps:
        parser.error("--steps must leave at least 3 measured steps after --change-at + --settle")
    names = ["early_exit"] if args.quick else ["early_exit", "freezing"]
    started = time.perf_counter()
    sections = [table(n, compare(scenarios(args.layers)[n], args)) for n in names]
    harness.finish(
        "rebalance",
        out,
        [
            harness.header(
                "DynMo vs static on a 2-process CPU pipeline", "rebalance", argv, [harness.EMULATED]
            ),
            f"Setup: DemoGPT, {args.layers} blocks with emulated cost ({args.fwd_ms} ms forward, "
            f"{2 * args.fwd_ms} ms backward per block and micro-batch), 1F1B, {args.microbatches} "
            f"micro-batches, 2 gloo ranks, {args.steps} steps, cost change at step {args.change_at}; "
            f"'after' = median of the steps from {args.change_at + args.settle} on. "
            f"'ideal / achieved' = step time of the fixed optimal placement / this run's (1.00 = ideal); the "
            "ideal is computed from the known emulated costs (not chosen by measurement).",
            *sections,
        ],
        started,
    )


if __name__ == "__main__":
    main()
