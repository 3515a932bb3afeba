"""What DynMo itself costs: profiling + decision + migration as a fraction of training time.

Two 2-process CPU jobs (DemoGPT with emulated block costs, 1F1B, 4 micro-batches) train for ``--steps``
steps with ``DynMoCallback``:

- ``every_n_steps=100``: the periodic mode of the paper's coarse-grained cases (pruning, freezing); the
  cost profile is uneven from the start, so the first rebalance migrates layers;
- ``every_step=True``: the fine-grained mode (MoE, MoD), with every block's cost redrawn each step
  (``RoutingNoise``, +-50%), so the callback profiles, decides and often migrates at every step.

For each it prints the callback's own overhead (the seconds it spent profiling, deciding and migrating,
as it reports them in ``dynmo/overhead_s``) over the wall time of ``fit``, and writes
``benchmarks/results/overhead-<date>.md``. Targets from the issue: <= 2 % and <= 10 %.

A third table is what the callback costs on every step when it does nothing else: a balanced pipeline
(all blocks alike, nothing to gain) with ``DynMoCallback`` attached but no window in the run, against the
same job without it, alternating over ``--rounds`` rounds; each job's step time is the median of its
steps after the first fifth, and the ratio is taken within a round. That cost is the per-step exchange
(one all-gather, which also carries the strategy's SIGTERM agreement) and the hooks' own Python.

    python -m benchmarks.overhead            # 300 steps each, ~4 minutes
    python -m benchmarks.overhead --quick    # 120 steps and every_n_steps=40
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks import harness
from benchmarks.common import StepTimer, fit_demo_gpt, launch, results_path, write_report
from lightning_dynmo.callback import DynMoCallback
from lightning_dynmo.demos.dynamics import RoutingNoise
from lightning_dynmo.strategy import DynMoStrategy


@dataclass(frozen=True)
class OverheadSpec:
    """One job: which trigger mode, how many steps, which emulated costs."""

    label: str
    steps: int
    every_n_steps: int | None
    every_step: bool
    noise: float
    sleep_ms: tuple[float, ...]
    with_dynmo: bool = True


class FitClock(pl.Callback):
    """Wall time of the training loop, from ``on_train_start`` to ``on_train_end``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def on_train_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_end(self, *args: Any) -> None:
        self.seconds = time.perf_counter() - self._t0


def train(spec: OverheadSpec) -> dict[str, Any]:
    """Body of one rank: fit with DynMoCallback and report its overhead and the fit's wall time."""
    torch.set_num_threads(1)
    clock, steps = FitClock(), StepTimer()
    dynmo = DynMoCallback(balancer="partition", every_n_steps=spec.every_n_steps, every_step=spec.every_step)
    callbacks: list[pl.Callback] = [clock, steps] + ([dynmo] if spec.with_dynmo else [])
    if spec.noise:
        callbacks.insert(0, RoutingNoise(amplitude=spec.noise))
    strategy = DynMoStrategy(num_microbatches=4, schedule="1F1B")
    trainer = fit_demo_gpt(strategy, callbacks, spec.steps, spec.sleep_ms)
    return {
        "fit_s": clock.seconds,
        "overhead_s": dynmo.overhead_s if spec.with_dynmo else 0.0,
        "decisions": len(dynmo.rebalances) if spec.with_dynmo else 0,
        "migrations": sum(r.applied for r in dynmo.rebalances) if spec.with_dynmo else 0,
        "placement": str(trainer.strategy.placement),
        "step_ms": 1e3 * statistics.median(steps.step_s[len(steps.step_s) // 5 :]),
    }


def idle_rows(steps: int, rounds: int) -> list[str]:
    """The idle callback's per-step cost: with and without it, alternating, one row per round + median."""
    idle = OverheadSpec("idle", steps, steps + 1, False, 0.0, (1.0,) * 8)  # no window in the run
    rows, ratios = [], []
    for i in range(rounds):
        print(f"idle callback, round {i + 1}/{rounds} ...", file=sys.stderr, flush=True)
        with_it = launch(train, idle, start_method="fork")["step_ms"]
        without = launch(train, replace(idle, with_dynmo=False), start_method="fork")["step_ms"]
        ratios.append(with_it / without)
        rows.append(
            f"| {i + 1} | {without:.2f} | {with_it:.2f} | {with_it - without:+.2f} | {ratios[-1]:.3f} |"
        )
    rows.append(f"| median | | | | **{statistics.median(ratios):.3f}** |")
    return rows


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)  # the ranks are forked from this process (common.launch)
    parser = harness.argument_parser(__doc__, "120 steps, every_n_steps=40, 1 idle round", "steps", "rounds")
    args = parser.parse_args(argv)
    out = results_path("overhead", args.out, args.force)
    steps = args.steps or (120 if args.quick else 300)
    rounds = args.rounds or (1 if args.quick else 5)
    period = 40 if args.quick else 100
    # Eight blocks, the last four with a tenth of the work (an early exit): uniform is imbalanced.
    uneven = (1.0,) * 4 + (0.1,) * 4
    specs = [
        OverheadSpec(f"every_n_steps={period}", steps, period, False, 0.0, uneven),
        OverheadSpec("every_step (routing noise +-50%)", steps, None, True, 0.5, (1.0,) * 8),
    ]
    targets = {specs[0].label: 0.02, specs[1].label: 0.10}
    rows = []
    for spec in specs:
        print(f"running {spec.label} with and without DynMoCallback ...", file=sys.stderr, flush=True)
        r = launch(train, spec, start_method="fork")
        static = launch(train, replace(spec, with_dynmo=False), start_method="fork")
        frac = r["overhead_s"] / r["fit_s"]
        rows.append(
            f"| {spec.label} | {steps} | {r['decisions']} | {r['migrations']} | {r['fit_s']:.2f} "
            f"| {static['fit_s']:.2f} "
            f"| {r['overhead_s']:.3f} | {100 * frac:.2f} % | {100 * targets[spec.label]:.0f} % "
            f"| {r['fit_s'] / static['fit_s']:.3f} | `{r['placement']}` |"
        )
    report = "\n".join(
        [
            harness.header(
                "DynMo overhead on a 2-process CPU pipeline", "overhead", argv, [harness.EMULATED]
            ),
            "",
            "Setup: DemoGPT, 8 blocks with emulated cost (1 ms forward, 2 ms backward per block and "
            "micro-batch; the every_n_steps run has the last 4 blocks at a tenth), 1F1B, 4 micro-batches, "
            "2 gloo ranks. Overhead = the seconds DynMoCallback reports for profiling + decision + "
            "migration (dynmo/overhead_s), over the wall time of the training loop. 'fit / static fit' "
            "compares the same job without DynMoCallback (same costs, same noise, uniform placement): it "
            "includes what DynMo gains by rebalancing as well as every cost it adds, per-step timers "
            "included.",
            "",
            "| trigger | steps | decisions | migrations | fit (s) | static fit (s) | DynMo overhead (s) "
            "| overhead / fit | target | fit / static fit | final placement |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            *rows,
            "",
            f"**The idle callback, per step.** 8 blocks alike (1 ms forward, 2 ms backward per micro-batch), "
            f"{steps} steps a job, `DynMoCallback` with no window in the run against no callback, "
            f"alternating over {rounds} round(s); step = the median of a job's steps after the first fifth.",
            "",
            "| round | no callback (ms) | idle DynMoCallback (ms) | difference (ms) | ratio |",
            "|---:|---:|---:|---:|---:|",
            *idle_rows(steps, rounds),
        ]
    )
    write_report(report, "overhead", out)


if __name__ == "__main__":
    main()
