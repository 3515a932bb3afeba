"""End to end: every dynamic-model case, static baselines against DynMo's four balancers, three scales.

Read in this order: :data:`CASES` (one entry per case: its model, trigger and own callbacks), then the
three modes, :func:`real_case`, :func:`emulated_case`, :func:`project_case`, then :func:`main`.

For each case it compares, as ratios measured in the same run:

- **static uniform** (Megatron-LM: equal layer counts) and **static params** (DeepSpeed's
  ``partition_method="parameters"``, decided on the model before training);
- **DynMo** ``partition`` and ``diffusion``, each by measured ``time`` and by ``params``, starting
  from the uniform split and rebalancing on the case's trigger (step times include DynMo's profiling
  and migrations);
- **ideal**: at 2 stages the best fixed placement found by *measuring* the 2-stage splits whose first
  stage is within ``SPREAD`` blocks of half (never computed by the balancer under test); beyond 2
  stages the exact min-max partition of the measured per-layer costs, itself run (emulated) or
  simulated (projection) like the others.

How the measured modes judge (:mod:`benchmarks.paired`): every ratio is taken between jobs of the same
round and reported as its median over rounds; at 2 stages each round's ideal is the candidate fastest in
the *other* rounds (the in-sample winner of noisy candidates is biased fast); a case is *imbalanced* only
if its better static split is slower than that ideal in every round and by more than ``IMBALANCE_GAP`` at
the median, and DynMo is *slower beyond noise* only if it is slower than the better static split in every
one of at least 4 rounds.

Three modes (``--mode``, any of them; default all):

- ``real``: the case's real GPT blocks on a 2-rank gloo CPU pipeline (1F1B). Per round: one job per
  fixed 2-stage candidate (the static splits among them) and one per DynMo variant, all with the same
  steps and the same untimed start; ``--rounds`` rounds, the job order rotated every round; each
  figure is the median over rounds of a job's median step after the dynamism settled. **Real compute.**
- ``emulated``: ``--stages`` (4 by default) CPU ranks; each block of a :class:`~lightning_dynmo.demos.DemoGPT`
  sleeps what a block of the case measured inside the real pipeline (forward and backward apart; the
  profile stretched to ``4 * stages`` layers and scaled so the mean block costs ``--emulated-ms`` per
  micro-batch), so balance is measurable with more ranks than cores. One job per fixed placement
  (static uniform, static params, the ideal) and per DynMo variant, as in ``real``; DynMo decides every
  step and skips its window while nothing can be gained (``skip_balanced``): the emulated costs do
  not change, so it settles within the untimed first half of the job. DynMo by params is
  left out: the emulated blocks all have the same parameters (static params uses the real model's counts).
  **Emulated cost.**
- ``projection``: the pipeline simulator (:func:`~lightning_dynmo.balancing.simulate_pipeline`, 1F1B,
  ``4 * stages`` micro-batches) fed the same measured per-layer costs stretched to 24-48 layers on 8-24
  stages, set beside the paper's reported speedups. **Projected** (steady-state costs; migrations not
  counted; diffusion where its repeated rebalances settle, partition in one rebalance).

The measured costs come from the real mode's DynMo ``partition/time`` job (its profiler's last window,
after the dynamism settled); without ``real`` in ``--mode``, from timing each block on one micro-batch
in this process (the pruning case then sees its dense model).

    python -m benchmarks.e2e                       # every case, every mode: ~20 minutes on 2 cores
    python -m benchmarks.e2e --case early_exit     # one case
    python -m benchmarks.e2e --mode projection     # the simulator only (per-layer costs timed here)
    python -m benchmarks.e2e --quick               # smoke run (tiny, early exit, one round): not figures

The report (tables, the exact command, the machine's load) goes to ``benchmarks/results/e2e-<date>.md``;
an existing file is never overwritten unless ``--force``.
"""

from __future__ import annotations

import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_dynmo.dynamism  # noqa: F401  # registers the block kinds
from benchmarks import harness, paired
from benchmarks.common import StepTimer, benchmark_trainer, corpus_data, results_path, write_report
from benchmarks.early_exit_mod import Setup, calibrate_exit_threshold, layer_times, step_time_s
from benchmarks.gpt_pipeline import JobSpec, PlacementSweep, median_ms, run_job, visit_schedule
from lightning_dynmo.balancing import (
    BalanceProblem,
    LayerCost,
    Placement,
    by_parameters,
    diffuse,
    partition,
    uniform,
)
from lightning_dynmo.callback import DynMoCallback
from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
from lightning_dynmo.dynamism.early_exit import early_exit_config
from lightning_dynmo.dynamism.freezing import FreezingConfig
from lightning_dynmo.dynamism.mod import mod_config
from lightning_dynmo.dynamism.moe import moe_gpt_config
from lightning_dynmo.dynamism.pruning import PruningConfig, pruning_gpt_config
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_attention import sparse_attention_gpt_config
from lightning_dynmo.dynamism_callbacks import FreezingCallback, PruningCallback
from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.strategy import DynMoStrategy

MODES = ("real", "emulated", "projection")
VARIANTS = tuple((b, c) for b in ("partition", "diffusion") for c in ("time", "params"))
IMBALANCE_GAP = harness.IMBALANCE_GAP
PROJECTIONS = ((24, 8), (48, 16), (48, 24))  # (layers, stages), the paper's scales
SPREAD = 2  # the measured 2-stage candidates: first stage within 2 blocks of half
START = "fork"  # ranks forked from this process (torch set to one thread first): no re-import per job


@dataclass(frozen=True)
class Sizes(harness.ModelSizes):
    """Model, batch and run sizes of the real-compute mode."""

    steps: int
    settle: int
    rounds: int


FULL = Sizes.extend(harness.FULL_SIZES, steps=16, settle=8, rounds=2)
QUICK = Sizes.extend(harness.QUICK_SIZES, steps=6, settle=3, rounds=1)


# -- the cases --------------------------------------------------------------------------------------


def _no_callbacks(sizes: Sizes) -> tuple[Callable[[], pl.Callback], ...]:
    return ()


@dataclass(frozen=True)
class Case:
    """One dynamic-model case of the benchmark.

    Attributes:
        name: The case (as in ``lightning_dynmo.dynamism``).
        model: The ready GPT configuration at the benchmark's sizes.
        trigger: ``DynMoCallback`` trigger keywords (what the case's dynamism calls for).
        paper: The paper's reported speedup over static Megatron-LM (abstract, up to 720 H100s).
        callbacks: Factories of the case's own callbacks, called in every rank (they must pickle).
        lead_steps: Steps the dynamism needs to settle before a step time means its steady state.
    """

    name: str
    model: Callable[[Sizes], GPTConfig]
    trigger: dict[str, Any]
    paper: float
    callbacks: Callable[[Sizes], tuple[Callable[[], pl.Callback], ...]] = _no_callbacks
    lead_steps: Callable[[Sizes], int] = field(default=lambda sizes: 1)


def _early_exit(sizes: Sizes) -> GPTConfig:
    setup = Setup(
        **{k: v for k, v in sizes.shape.items()},
        batch_size=sizes.batch_size,
        num_microbatches=sizes.microbatches,
        steps=sizes.steps,
        settle=sizes.settle,
        rounds=sizes.rounds,
        sweep_repeats=1,
        timing_repeats=1,
        exit_share=0.3,
        capacity=0.125,
    )
    threshold = calibrate_exit_threshold(setup)
    return early_exit_config(
        first_exit_layer=max(1, sizes.num_layers // 4),
        threshold=threshold,
        position_temperature=4.0,
        **sizes.shape,
    )


def _pruning_schedule(sizes: Sizes) -> PruningSchedule:
    return PruningSchedule(final_sparsity=0.9, start_step=1, frequency=2, num_steps=3)


def _pruning_callbacks(sizes: Sizes) -> tuple[Callable[[], pl.Callback], ...]:
    rows = sizes.batch_size // sizes.microbatches * sizes.seq_len
    config = PruningConfig(schedule=_pruning_schedule(sizes), kernel="auto", timing_rows=rows)
    return (functools.partial(PruningCallback, config),)


FREEZE_AT = 2  # the freezing case freezes the first half of the blocks at this step (a schedule)


def _freezing_callbacks(sizes: Sizes) -> tuple[Callable[[], pl.Callback], ...]:
    config = FreezingConfig(criterion="schedule", schedule=((FREEZE_AT, sizes.num_layers // 2),))
    return (functools.partial(FreezingCallback, config),)


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("moe", lambda s: moe_gpt_config(**s.shape), {"every_step": True}, paper=1.23),
        Case(
            "pruning",
            lambda s: pruning_gpt_config(**s.shape),
            {},  # rebalances on the pruner's events
            paper=3.18,
            callbacks=_pruning_callbacks,
            lead_steps=lambda s: 2 + 2 * 3,
        ),
        Case(
            "freezing",
            lambda s: GPTConfig(vocab_size=256, blocks="dense", **s.shape),
            {},  # rebalances on the freezer's events
            paper=2.23,
            callbacks=_freezing_callbacks,
            lead_steps=lambda s: FREEZE_AT + 2,
        ),
        Case(
            "sparse_attention",
            # >= 16 tiles a row at seq 64 (16-token tiles left 4 a row: every causal tile active, dense).
            lambda s: sparse_attention_gpt_config(
                **s.shape, num_buckets=4, block_size=max(4, s.seq_len // 16)
            ),
            {"every_step": True},
            paper=4.02,
        ),
        # On the blocks' events: each exit layer announces its share of active tokens as its running mean
        # moves from 1.0 to its share (the model learns, so the shares keep moving), within the
        # first steps; the lead steps let DynMo's windows for them end before the measured steps.
        Case("early_exit", _early_exit, {}, paper=4.52, lead_steps=lambda s: 4),
        Case(
            "mod",
            lambda s: mod_config(**s.shape, capacity=0.125, routing="predictor"),
            {"every_step": True},
            paper=1.17,
        ),
    )
}


def block_params(config: GPTConfig) -> list[int]:
    """Parameters of each block of ``config``'s GPT (what DeepSpeed's static split weighs)."""
    model = GPT(config)
    return [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]


def static_placements(params: Sequence[int], num_stages: int) -> dict[str, Placement]:
    """Megatron-LM's uniform split and DeepSpeed's parameter split of ``len(params)`` blocks."""
    return {
        "static uniform": uniform(len(params), num_stages),
        "static params": by_parameters([LayerCost(num_params=n) for n in params], num_stages),
    }


@functools.cache
def _corpus(seq_len: int, batch_size: int) -> str:
    """A folder holding the standard-library corpus as token rows, prepared once per shape in this process
    (every case and job of that shape reads it; the ranks share a warm cache)."""
    cache = tempfile.mkdtemp(prefix="dynmo-e2e-")
    corpus_data(seq_len, batch_size, cache).prepare_data()
    return cache


# -- mode 1: real compute on 2 stages --------------------------------------------------------------


def real_case(case: Case, sizes: Sizes, variants: Sequence[tuple[str, str]] = VARIANTS) -> dict[str, Any]:
    """One job per fixed 2-stage split and one per DynMo variant, interleaved over rounds."""
    config = case.model(sizes)
    params = block_params(config)
    statics = {k: str(p) for k, p in static_placements(params, 2).items()}
    splits = harness.two_stage_splits(sizes.num_layers, SPREAD)
    candidates = tuple(dict.fromkeys([*splits, statics["static params"]]))
    lead = case.lead_steps(sizes)
    # A fixed placement is a job of its own with the DynMo jobs' structure (fresh ranks, the same untimed
    # start): timing placements one after the other inside one job favours the later ones (warm ranks).
    base = JobSpec(
        kind="dynmo",
        config=config,
        steps=sizes.steps + lead,
        batch_size=sizes.batch_size,
        num_microbatches=sizes.microbatches,
        callbacks=case.callbacks(sizes),
        lr=1e-3,  # a rate that learns: routers, exit heads and predictors train as in a real run
        corpus_cache=_corpus(config.seq_len, sizes.batch_size),
    )
    measured = sizes.steps - sizes.settle
    jobs = {
        **{
            p: replace(
                base,
                kind="sweep",
                candidates=(p,),
                lead_steps=lead + sizes.settle,
                warm_steps=0,
                measure_steps=measured,
                repeats=1,
            )
            for p in candidates
        },
        **{
            f"DynMo {b}/{c}": replace(base, callback={"balancer": b, "cost": c, **case.trigger})
            for b, c in variants
        },
    }
    runs = harness.run_rounds(
        jobs,
        run_job,
        sizes.rounds,
        f"{case.name}, real",
        start_method=START,
        log=lambda run: [  # the step time, then each DynMo decision, applied or not, and its reason
            f"{median_ms(run['step_s'][-measured:]):.1f} ms, ends at {run['placement']}",
            *run.get("why", []),
        ],
    )
    per_round = {p: [median_ms(run["sweep_s"][p]) for run in runs[p]] for p in candidates}
    skip = sizes.settle + lead
    dynmo = [name for name in jobs if name.startswith("DynMo")]
    per_round |= {name: [median_ms(run["step_s"][skip:]) for run in runs[name]] for name in dynmo}
    sweep_ms = {p: statistics.median(per_round[p]) for p in candidates}
    rows: dict[str, dict[str, Any]] = {
        name: {"ms": sweep_ms[p], "placement": p, "per_round": per_round[p]} for name, p in statics.items()
    }
    for name in dynmo:
        rows[name] = {
            "ms": statistics.median(per_round[name]),
            "per_round": per_round[name],
            "placement": ", ".join(run["placement"] for run in runs[name]),
            "rebalances": [len(run["moved_to"]) for run in runs[name]],
            "overhead_s": [run["overhead_s"] for run in runs[name]],
        }
    # The ideal of each round is the candidate fastest in the *other* rounds (no winner's curse).
    comparison = paired.compare(
        statics={name: per_round[p] for name, p in statics.items()},
        dynmo={name: per_round[name] for name in dynmo},
        candidates={p: per_round[p] for p in candidates},
        gap=IMBALANCE_GAP,
    )
    # The ideal row: per round, the held-out ideal's time and placement.
    rows["ideal"] = {
        "ms": statistics.median(comparison.ideal_ms),
        "placement": ", ".join(dict.fromkeys(comparison.ideal)),
        "per_round": list(comparison.ideal_ms),
    }
    profiled = next(runs[f"DynMo {b}/{c}"][-1] for b, c in variants if c == "time")
    costs = [
        LayerCost(
            fwd_time_s=f / 1e3 / sizes.microbatches, bwd_time_s=b / 1e3 / sizes.microbatches, num_params=n
        )
        for f, b, n in zip(profiled["layer_fwd_ms"], profiled["layer_bwd_ms"], params, strict=True)
    ]
    # How far one fixed split's figure moves from round to round: the noise a ratio here must beat.
    spread = statistics.median(
        (max(times) - min(times)) / statistics.median(times) for times in (per_round[p] for p in candidates)
    )
    return {
        "rows": rows,
        "comparison": comparison,
        "sweep_ms": sweep_ms,
        "costs": costs,
        "spread": spread,
        "rounds": sizes.rounds,
    }


def timed_costs(case: Case, sizes: Sizes, repeats: int) -> list[LayerCost]:
    """Per-block costs of one micro-batch timed in this process (when the real mode did not run)."""
    config = case.model(sizes)
    gen = torch.Generator().manual_seed(0)
    rows = sizes.batch_size // sizes.microbatches
    microbatch = torch.randint(0, config.vocab_size, (rows, sizes.seq_len + 1), generator=gen)
    layers, _, _ = layer_times(GPT(config), microbatch, repeats)
    return [
        LayerCost(fwd_time_s=t.fwd_ms / 1e3, bwd_time_s=t.bwd_ms / 1e3, num_params=n)
        for t, n in zip(layers, block_params(config), strict=True)
    ]


# -- mode 2: emulated cost on more stages than cores -----------------------------------------------


@dataclass(frozen=True)
class EmulatedJob:
    """One emulated-cost job: a DemoGPT whose blocks sleep ``fwd_ms`` / ``bwd_ms`` per micro-batch."""

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    num_stages: int
    steps: int
    callback: dict[str, Any] | None = None  # DynMoCallback keywords; None: a sweep of ``candidates``
    candidates: tuple[str, ...] = ()
    warmup: int = 0  # untimed steps of a fixed-placement job

    @property
    def microbatches(self) -> int:
        return 2 * self.num_stages


def run_emulated(job: EmulatedJob) -> dict[str, Any]:
    """Body of one rank of an emulated job (started by ``benchmarks.common.launch``)."""
    torch.set_num_threads(1)
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    measured = job.steps - job.warmup
    schedule = visit_schedule(job.candidates, 0, measured, 1, job.warmup) if job.callback is None else []
    dynmo = DynMoCallback(**job.callback) if job.callback is not None else None
    callbacks.append(dynmo if dynmo is not None else PlacementSweep(schedule))
    steps = len(schedule) or job.steps
    strategy = DynMoStrategy(
        num_microbatches=job.microbatches,
        schedule="1F1B",
        placement=schedule[0][0] if schedule else "uniform",
    )
    trainer = benchmark_trainer(strategy, callbacks, steps, devices=job.num_stages)
    model = DemoGPT(
        num_layers=len(job.fwd_ms), sleep_ms=list(job.fwd_ms), d_model=16, vocab_size=32, seq_len=8
    )
    for block, bwd in zip(model.layers.values(), job.bwd_ms, strict=True):
        block.cost.bwd_ms = bwd
    trainer.fit(
        model,
        RandomTokenDataModule(
            batch_size=job.microbatches, num_samples=job.microbatches * steps, seq_len=8, vocab_size=32
        ),
    )
    report: dict[str, Any] = {"step_s": timer.step_s, "placement": str(strategy.placement)}
    if dynmo is not None:
        report["rebalances"] = sum(1 for r in dynmo.rebalances if r.applied)
    timed: dict[str, list[float]] = {}
    for (placement, is_timed), step_s in zip(schedule, timer.step_s if schedule else [], strict=True):
        if is_timed:
            timed.setdefault(placement, []).append(step_s)
    report["sweep_s"] = timed
    return report


def stretch(costs: Sequence[LayerCost], num_layers: int) -> list[LayerCost]:
    """The measured profile over ``num_layers`` layers: layer ``i`` costs ``costs[i * n // num_layers]``."""
    return [costs[i * len(costs) // num_layers] for i in range(num_layers)]


def emulated_case(
    costs: Sequence[LayerCost],
    stages: int,
    mean_ms: float,
    steps: int,
    rounds: int,
    balancers: Sequence[str],
) -> dict[str, Any]:
    """Static splits and the exact partition (fixed, swept) against DynMo by time, ``stages`` ranks."""
    layers = stretch(costs, 4 * stages)
    scale = mean_ms / (1e3 * statistics.mean(c.fwd_time_s + c.bwd_time_s for c in layers))
    fwd = tuple(round(1e3 * c.fwd_time_s * scale, 3) for c in layers)
    bwd = tuple(round(1e3 * c.bwd_time_s * scale, 3) for c in layers)
    fixed = {k: str(p) for k, p in static_placements([c.num_params for c in layers], stages).items()}
    fixed["ideal"] = str(partition(BalanceProblem(layers, by="time"), stages))
    base = EmulatedJob(fwd, bwd, stages, steps)
    jobs = {
        **{p: replace(base, candidates=(p,), warmup=steps // 2) for p in dict.fromkeys(fixed.values())},
        **{
            f"DynMo {b}/time": replace(base, callback={"balancer": b, "cost": "time", "every_step": True})
            for b in balancers
        },
    }
    runs = harness.run_rounds(
        jobs, run_emulated, rounds, f"emulated {stages} stages", nproc=stages, start_method=START
    )
    dynmo = [name for name in jobs if name.startswith("DynMo")]
    per_round = {name: [median_ms(run["sweep_s"][p]) for run in runs[p]] for name, p in fixed.items()}
    per_round |= {name: [median_ms(run["step_s"][steps // 2 :]) for run in runs[name]] for name in dynmo}
    rows = {
        name: {"ms": statistics.median(per_round[name]), "placement": p, "per_round": per_round[name]}
        for name, p in fixed.items()
    }
    for name in dynmo:
        rows[name] = {
            "ms": statistics.median(per_round[name]),
            "per_round": per_round[name],
            "placement": ", ".join(run["placement"] for run in runs[name]),
            "rebalances": [run["rebalances"] for run in runs[name]],
        }
    # The ideal here is computed from the emulated costs, not picked by measurement: nothing to hold out.
    comparison = paired.compare(
        statics={k: per_round[k] for k in ("static uniform", "static params")},
        dynmo={name: per_round[name] for name in dynmo},
        candidates={fixed["ideal"]: per_round["ideal"]},
        gap=IMBALANCE_GAP,
        held_out=False,
    )
    return {"rows": rows, "comparison": comparison, "stages": stages, "layers": len(layers)}


# -- mode 3: projection at the paper's scales ------------------------------------------------------


def settled_diffusion(
    costs: Sequence[LayerCost], start: Placement, by: str, rebalances: int = 10
) -> Placement:
    """Where repeated diffusion rebalances on the same costs settle (each call: one of DynMo's rebalances)."""
    placement = start
    for _ in range(rebalances):
        moved = diffuse(BalanceProblem(costs, by=by), placement).placement
        if moved == placement:
            break
        placement = moved
    return placement


def project_case(costs: Sequence[LayerCost], num_layers: int, num_stages: int) -> dict[str, Any]:
    """Simulated 1F1B step time of every strategy with the measured costs over ``num_layers`` layers."""
    layers = stretch(costs, num_layers)
    statics = static_placements([c.num_params for c in layers], num_stages)
    start = statics["static uniform"]
    placements: dict[str, Placement] = dict(statics)
    for b, c in VARIANTS:
        placements[f"DynMo {b}/{c}"] = (
            partition(BalanceProblem(layers, by=c), num_stages)
            if b == "partition"
            else settled_diffusion(layers, start, c)
        )
    placements["ideal"] = partition(BalanceProblem(layers, by="time"), num_stages)
    none = (LayerCost(), LayerCost())
    microbatches = 4 * num_stages
    rows = {
        name: {"ms": 1e3 * step_time_s(layers, p, none, microbatches), "placement": str(p)}
        for name, p in placements.items()
    }
    return {"rows": rows, "layers": num_layers, "stages": num_stages}


# -- report -----------------------------------------------------------------------------------------


def case_section(case: Case, results: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    lines = [f"### {case.name}", ""]
    summary: dict[str, Any] = {"case": case.name}
    if "real" in results:
        real = results["real"]
        verdict_lines, _ = harness.verdict(real["comparison"])
        summary["real"] = real["comparison"]
        lines += [
            "**Real compute**, 2 stages (the `ideal` row and the ratio columns: each round's ideal is the "
            "candidate fastest in the other rounds):",
            "",
            *harness.table(real["rows"], real["comparison"]),
            "",
            *verdict_lines,
        ]
        if real["rounds"] > 1:
            lines.append(
                f"Noise: a fixed split's step time moved by {real['spread']:.0%} from round to round (median "
                f"over the fixed splits of (max - min) / median of their {real['rounds']} rounds)."
            )
        lines.append("")
    for emulated in results.get("emulated", []):
        verdict_lines, _ = harness.verdict(emulated["comparison"])
        summary.setdefault("emulated", []).append(emulated["comparison"])
        lines += [
            f"**Emulated cost**, {emulated['layers']} blocks on {emulated['stages']} stages "
            "(ideal: the exact partition of the emulated costs, run as a fixed placement):",
            "",
            *harness.table(emulated["rows"], emulated["comparison"]),
            "",
            *verdict_lines,
            "",
        ]
    if "projection" in results:
        lines += [
            "**Projected** (simulator, measured per-layer costs, 1F1B, 4 micro-batches per stage; "
            "ideal: the exact partition by time). Paper's reported speedup over static Megatron-LM: "
            f"{case.paper:.2f}x.",
            "",
            "| layers x stages | static uniform (ms) | static params / uniform | "
            + " | ".join(f"DynMo {b}/{c}" for b, c in VARIANTS)  # the columns' order below
            + " | best DynMo / ideal |",
            "|---|---:|---:|" + "---:|" * len(VARIANTS) + "---:|",
        ]
        for proj in results["projection"]:
            rows = proj["rows"]
            static = min(rows["static uniform"]["ms"], rows["static params"]["ms"])
            speed = [f"{static / rows[f'DynMo {b}/{c}']['ms']:.2f}x" for b, c in VARIANTS]
            best = min(v["ms"] for k, v in rows.items() if k.startswith("DynMo"))
            lines.append(
                f"| {proj['layers']} x {proj['stages']} | {rows['static uniform']['ms']:.1f} | "
                f"{rows['static uniform']['ms'] / rows['static params']['ms']:.2f}x | {' | '.join(speed)} | "
                f"{rows['ideal']['ms'] / best:.0%} |"
            )
        summary["projection"] = results["projection"]
        lines.append("")
    return lines, summary


def summary_table(summaries: list[dict[str, Any]]) -> list[str]:
    out = [
        "| case | real 2 stages: best DynMo / better static | of ideal "
        "| emulated: best DynMo / better static | of ideal "
        "| projected 48 x 16: partition/time / better static | paper |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def cells(c: paired.PairedComparison | None) -> str:
        if c is None:
            return "- | -"
        mark = "" if c.imbalanced else " (not imbalanced)"
        if c.slower_beyond_noise():
            mark += " (slower beyond noise)"
        return f"{c.median_speedup():.2f}x{mark} | {c.median_of_ideal():.0%}"

    for s in summaries:
        real = s.get("real")
        emulated = s.get("emulated", [None])[0]
        proj = next((p for p in s.get("projection", []) if (p["layers"], p["stages"]) == (48, 16)), None)
        projected = "-"
        if proj is not None:
            rows = proj["rows"]
            static = min(rows["static uniform"]["ms"], rows["static params"]["ms"])
            projected = f"{static / rows['DynMo partition/time']['ms']:.2f}x"
        out.append(
            f"| {s['case']} | {cells(real)} | {cells(emulated)} | {projected} "
            f"| {CASES[s['case']].paper:.2f}x |"
        )
    return out


def measure_case(
    case: Case,
    sizes: Sizes,
    modes: Sequence[str],
    results: dict[str, Any],
    variants: Sequence[tuple[str, str]],
    stages: Sequence[int],
    emulated_ms: float,
    quick: bool,
    rounds: int,
) -> None:
    """Run ``case`` in every mode of ``modes``, filling ``results`` as each mode finishes."""
    balancers = list(dict.fromkeys(b for b, c in variants if c == "time"))
    if "real" in modes:
        results["real"] = real_case(case, sizes, variants)
    if {"emulated", "projection"} & set(modes):
        costs = (
            results["real"]["costs"] if "real" in results else timed_costs(case, sizes, 3 if quick else 10)
        )
        if "emulated" in modes:
            steps = 8 if quick else 20
            results["emulated"] = [
                emulated_case(costs, s, emulated_ms, steps, rounds, balancers) for s in stages
            ]
        if "projection" in modes:
            results["projection"] = [project_case(costs, n, s) for n, s in PROJECTIONS]


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(__doc__, "tiny sizes, early exit, one round", "rounds")
    parser.add_argument("--case", nargs="+", choices=list(CASES), default=None, help="cases (default: all)")
    parser.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--emulated-rounds", type=int, default=1, help="interleaved rounds of the emulated jobs"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=[f"{b}/{c}" for b, c in VARIANTS],
        default=None,
        help="DynMo variants of the measured modes (default: all four; --quick: partition/time)",
    )
    parser.add_argument("--stages", type=int, nargs="+", default=None, help="emulated pipeline sizes (4-8)")
    parser.add_argument(
        "--emulated-ms", type=float, default=None, help="mean emulated block cost per micro-batch"
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.rounds is not None:
        sizes = replace(sizes, rounds=args.rounds)
    cases = args.case or (["early_exit"] if args.quick else list(CASES))
    stages = args.stages or ([2] if args.quick else [4])
    if any(s < 2 for s in stages):
        parser.error(f"--stages {stages}: every emulated pipeline needs at least 2 stages")
    chosen = args.variants or (["partition/time"] if args.quick else [f"{b}/{c}" for b, c in VARIANTS])
    variants = [(v.split("/")[0], v.split("/")[1]) for v in chosen]
    if not any(c == "time" for _, c in variants):
        parser.error(
            f"--variants {chosen}: include a time variant (its profiler measures the emulated costs)"
        )
    emulated_ms = args.emulated_ms or (1.0 if args.quick else 6.0)
    try:
        path = results_path("e2e", args.out, args.force)
    except FileExistsError as error:  # a committed results file stays as it is
        raise SystemExit(str(error)) from error
    torch.set_num_threads(1)
    labels = [label for mode, label in zip(MODES, harness.LABELS, strict=True) if mode in args.mode]
    opening = harness.header("End to end: six dynamic-model cases, static vs DynMo", "e2e", argv, labels)
    started = time.perf_counter()
    sections: list[str] = []
    summaries = []
    for name in cases:
        case, results = CASES[name], {}
        try:
            measure_case(
                case,
                sizes,
                args.mode,
                results,
                variants,
                stages,
                emulated_ms,
                args.quick,
                args.emulated_rounds,
            )
        except Exception as error:  # one case's failure is reported, the other cases still run
            sections.append(f"### {name}\n\nFAILED: {type(error).__name__}: {error}")
            print(f"[{name}] FAILED: {error!r}", file=sys.stderr, flush=True)
            continue
        lines, summary = case_section(case, results)
        sections.append("\n".join(lines))
        summaries.append(summary)
    header = [
        opening + "  ",
        f"Real-compute setup: GPT with {sizes.num_layers} blocks, d_model {sizes.d_model}, "
        f"{sizes.num_heads} heads, seq_len {sizes.seq_len}, batches of {sizes.batch_size} rows in "
        f"{sizes.microbatches} micro-batches, "
        f"float32, 1 torch thread per rank, 2 gloo ranks, 1F1B; every job (a fixed 2-stage split within "
        f"{SPREAD} blocks of half, or a DynMo variant) runs {sizes.steps} steps after the case's dynamism "
        f"settled, the first {sizes.settle} not measured; {sizes.rounds} round(s), job order rotated every "
        "round, medians. Every job learns the standard-library corpus at learning rate 1e-3 (routers, exit "
        "heads and predictors train while measured).",
        "",
        "Which figures are what: **real compute** = the case's GPT blocks on 2 CPU ranks; **emulated** = "
        "blocks that sleep their measured cost, on more ranks than cores; **projected** = the pipeline "
        "simulator fed the measured per-layer costs.",
        "",
        *summary_table(summaries),
        "",
    ]
    report = "\n".join(
        [*header, *sections, f"Wall time of the whole benchmark: {time.perf_counter() - started:.0f} s."]
    )
    write_report(report, "e2e", path)


if __name__ == "__main__":
    main()
