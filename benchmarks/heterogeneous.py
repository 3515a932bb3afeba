"""Heterogeneous workers and links, and re-tuning micro-batches after a re-pack: measured on 2 CPU ranks.

1. **An emulated slow worker and an emulated slow link.** :class:`~lightning_dynmo.demos.DemoGPT`, whose
   blocks sleep a fixed time (:class:`~lightning_dynmo.demos.EmulatedCost`: no CPU used, so 2 shared
   cores give clean ratios), trains on 2 gloo ranks (1F1B, batches of 8, 4 micro-batches). Slow worker:
   rank 1's sleeps, and the reference workload the callback times there, are ``--slowdown`` times longer
   (:func:`~lightning_dynmo.demos.hardware.set_emulated_slowdown`). Slow link: every send of rank 0 to
   rank 1 waits ``--link-ms`` (:func:`~lightning_dynmo.demos.hardware.emulate_slow_link`). Per scenario,
   runs interleaved over ``--rounds`` rounds: the static uniform split, ``DynMoCallback`` from it (slow
   worker: ``ProfilingConfig(measure_speed=True)`` with the emulated probe; slow link: the default link
   measurement), and every fixed contiguous split (the candidates: the best of them is the placement that
   knows the slowdown, found by measuring). A run's figure is the median of its
   steps after ``--skip``; ratios are taken within a round (:mod:`benchmarks._lib.harness`), each round's
   ideal being the candidate fastest in the other rounds.
2. **Step time after a re-pack, with and without the re-tune.** The GPT of :mod:`lightning_dynmo.models`
   (real compute) trains on 2 ranks; ``DynMoCallback(repack=RepackConfig(target_num_stages=1, ...))``
   re-packs it onto rank 0 after its first window (rank 1 leaves), once with ``retune_microbatches=True`` (the
   callback picks the micro-batch count of the 1-stage pipeline with the simulator and the measured
   fixed cost per op) and once without (the count stays). Step times of rank 0 after the re-pack,
   interleaved rounds, medians.

    python -m benchmarks.heterogeneous            # ~10 minutes on 2 quiet cores
    python -m benchmarks.heterogeneous --quick    # a smoke run (tiny sizes, one round): checks it works

The report goes to ``benchmarks/results/heterogeneous-<date>.md`` with the command (``--out`` elsewhere;
an existing dated file is kept unless ``--force``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from benchmarks._lib import harness
from benchmarks._lib.common import StepTimer, benchmark_trainer, fit_demo_gpt, results_path
from lightning_dynmo.balancing.placement import Placement

BLOCK_MS = 5.0  # forward sleep of every DemoGPT block per micro-batch (backward: twice that)
MICROBATCHES = 4


@dataclass(frozen=True)
class Job:
    """One 2-rank training job of part 1."""

    label: str
    scenario: str  # "slow_worker" or "slow_link"
    num_layers: int
    steps: int
    placement: str
    slowdown: float
    link_ms: float
    window_at: int
    dynmo: bool = False


def train_emulated(job: Job) -> dict[str, Any]:
    """Body of one rank of part 1: emulate the scenario on this rank, fit, report rank 0's step times."""
    import os

    from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
    from lightning_dynmo.demos.hardware import emulate_slow_link, emulated_speed_probe, set_emulated_slowdown
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if job.scenario == "slow_worker" and rank == 1:
        set_emulated_slowdown(job.slowdown)
    if job.scenario == "slow_link" and rank == 0:
        emulate_slow_link(to_rank=1, s_per_byte=0.0, latency_s=job.link_ms / 1e3)
    timer = StepTimer()
    callbacks: list[Any] = [timer]
    dynmo = None
    if job.dynmo:
        speed = ProfilingConfig(measure_speed=True, speed_probe=emulated_speed_probe, measure_comm=False)
        profiling = speed if job.scenario == "slow_worker" else ProfilingConfig()
        dynmo = DynMoCallback(every_n_steps=job.window_at, profiling=profiling)
        callbacks.append(dynmo)
    strategy = DynMoStrategy(num_microbatches=MICROBATCHES, schedule="1F1B", placement=job.placement)
    fit_demo_gpt(strategy, callbacks, job.steps, [BLOCK_MS] * job.num_layers)
    return {"step_s": timer.step_s, "placement": str(strategy.placement)}


def candidates(num_layers: int) -> list[str]:
    """Every contiguous 2-stage split of ``num_layers`` blocks (at least one block per stage)."""
    return [str(Placement.from_sizes([n, num_layers - n])) for n in range(1, num_layers)]


def compare_scenario(base: Job, skip: int, rounds: int) -> str:
    """Static, DynMo and every candidate of one scenario in rounds (``_lib.harness``), compared."""
    static = "static (uniform)"
    jobs = {
        static: replace(base, label=static),
        "DynMoCallback": replace(base, label="DynMoCallback", dynmo=True),
    }
    jobs |= {
        f"fixed {p}": replace(base, label=f"fixed {p}", placement=p)
        for p in candidates(base.num_layers)
        if p != base.placement
    }
    runs = harness.run_rounds(
        jobs, train_emulated, rounds, f"heterogeneous {base.scenario}", start_method="fork"
    )
    per_round = {name: harness.step_ms(reports, skip) for name, reports in runs.items()}
    fixed = [name for name, job in jobs.items() if not job.dynmo]
    comparison = harness.compare_runs(per_round, [static], ["DynMoCallback"], fixed)
    return harness.comparison_section(runs, per_round, comparison)


# -- 2. re-tune after a re-pack ---------------------------------------------------------------------


@dataclass(frozen=True)
class RetuneJob:
    """One 2-rank job of part 2: re-packed onto rank 0 after the first window, re-tuned or not."""

    label: str
    steps: int
    d_model: int
    seq_len: int
    num_layers: int
    window_at: int
    retune: bool


def train_repacked(job: RetuneJob) -> dict[str, Any]:
    """Body of one rank of part 2; rank 0 (the one kept) reports its step times and micro-batch count."""
    from lightning_dynmo.callback import DynMoCallback, RepackConfig
    from lightning_dynmo.demos import RandomTokenDataModule
    from lightning_dynmo.models import GPT, GPTConfig
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

    torch.set_num_threads(1)
    timer = StepTimer()
    dynmo = DynMoCallback(
        every_n_steps=job.window_at,
        # max_slowdown: re-pack whatever it costs, the point is the step after it
        repack=RepackConfig(target_num_stages=1, max_slowdown=10.0, retune_microbatches=job.retune),
        memory_capacity_bytes=2**40,  # CPU: no cap (a re-pack needs one)
    )
    strategy = DynMoStrategy(num_microbatches=MICROBATCHES, schedule="1F1B", placement="uniform")
    trainer = benchmark_trainer(strategy, [timer, dynmo], job.steps)
    config = GPTConfig(seq_len=job.seq_len, num_layers=job.num_layers, d_model=job.d_model, num_heads=2)
    data = RandomTokenDataModule(batch_size=8, num_samples=8 * job.steps, seq_len=job.seq_len, vocab_size=256)
    trainer.fit(GPT(config), data)
    applied = [r for r in dynmo.rebalances if r.applied]
    return {
        "step_s": timer.step_s,
        "placement": str(strategy.placement),
        "num_microbatches": strategy.num_microbatches,
        "repacked_at": applied[0].step if applied else None,
    }


def compare_retune(base: RetuneJob, skip: int, rounds: int) -> list[dict[str, Any]]:
    """The re-pack with and without the re-tune, in rounds; ratios to the kept count taken within a round."""
    jobs = {
        "re-pack, micro-batches kept": replace(base, label="re-pack, micro-batches kept"),
        "re-pack + re-tune": replace(base, label="re-pack + re-tune", retune=True),
    }
    runs = harness.run_rounds(jobs, train_repacked, rounds, "heterogeneous re-tune", start_method="fork")
    per_round = {name: harness.step_ms(reports, skip) for name, reports in runs.items()}
    kept = per_round["re-pack, micro-batches kept"]
    return [
        {
            **runs[name][-1],
            "label": name,
            "ms": statistics.median(per_round[name]),
            "vs_kept": statistics.median(k / t for k, t in zip(kept, per_round[name], strict=True)),
        }
        for name in jobs
    ]


def retune_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | step after the re-pack (ms) | kept / this | placement | micro-batches | re-packed at step |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['ms']:.1f} | {r['vs_kept']:.3f}x | `{r['placement']}` | "
            f"{r['num_microbatches']} | {r['repacked_at']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)  # the ranks are forked from this process (common.launch)
    parser = harness.argument_parser(__doc__, "tiny sizes and one round", "steps", "skip", "rounds")
    parser.add_argument("--slowdown", type=float, default=3.0, help="part 1: the slow worker's factor")
    parser.add_argument("--link-ms", type=float, default=30.0, help="part 1: delay of each slow-link send")
    args = parser.parse_args(argv)
    quick = args.quick
    steps = args.steps or (15 if quick else 40)
    # One profiling window in a DynMo run (every_n_steps fires once), then its decision and the gain
    # window: the measured steps all run at the placement it chose.
    window_at = steps // 2 + 1
    skip = args.skip if args.skip is not None else window_at + 5
    rounds = args.rounds or (1 if quick else 3)
    num_layers = 3 if quick else 8  # quick: 2 candidates, so 8 jobs in all
    if skip + 2 > steps or window_at < 2:
        parser.error("--steps must leave at least 2 measured steps after --skip, and be >= 2")
    out = results_path("heterogeneous", args.out, args.force)
    started = time.perf_counter()
    uniform = str(Placement.from_sizes([num_layers // 2, num_layers - num_layers // 2]))
    base = Job("", "slow_worker", num_layers, steps, uniform, args.slowdown, args.link_ms, window_at)
    worker = compare_scenario(base, skip, rounds)
    link = compare_scenario(replace(base, scenario="slow_link"), skip, rounds)
    retune_base = RetuneJob(
        "",
        steps,
        d_model=32 if quick else 64,
        seq_len=16 if quick else 64,
        num_layers=num_layers,
        window_at=window_at,
        retune=False,
    )
    retune = retune_table(compare_retune(retune_base, skip, rounds))
    measured = harness.rounds_note(rounds, steps, skip)
    harness.finish(
        "heterogeneous",
        out,
        [
            harness.header(
                "Heterogeneous workers and links; re-tune after a re-pack",
                "heterogeneous",
                argv,
                [harness.EMULATED, harness.REAL],
            ),
            f"DemoGPT: {num_layers} blocks sleeping {BLOCK_MS:g} ms forward / {2 * BLOCK_MS:g} ms backward "
            f"per micro-batch; batches of 8, {MICROBATCHES} micro-batches, 1F1B on 2 CPU ranks.",
            f"### 1a. Rank 1 an emulated worker {args.slowdown:g}x slower ({measured})",
            worker,
            f"### 1b. Rank 0 -> rank 1 an emulated slow link, {args.link_ms:g} ms per send ({measured})",
            link,
            f"### 2. GPT ({num_layers} blocks, d_model {retune_base.d_model}, seq_len {retune_base.seq_len}) "
            f"re-packed from 2 ranks onto 1 after the first window, {MICROBATCHES} micro-batches before "
            f"({measured})",
            retune,
        ],
        started,
    )


if __name__ == "__main__":
    main()
