"""Two-process jobs that time one GPT configuration on a real-compute 2-stage CPU pipeline.

Read in this order: :class:`JobSpec` (what a job runs), :func:`run_job` (the body of each rank, started
by ``benchmarks._lib.common.launch``), then :func:`sweep_schedule`.

Three kinds of job, each one 2-rank launch (1F1B, the GPT's real blocks, no emulated cost):

- ``dynmo``: starts at ``placement`` (uniform by default); ``DynMoCallback`` with the case's trigger
  moves layers as it measures;
- ``fixed``: stays at ``placement`` for ``steps`` steps (a static split, or one candidate of the ideal);
- ``sweep``: every candidate placement in turn, ``repeats`` times over, each visit a few untimed steps
  (the migration, warm caches) then timed ones. Visits are interleaved, so a slow drift of a shared
  machine hits every candidate alike. The static uniform split is one candidate; the ideal is the
  candidate with the lowest median.

Each rank trains on the same seeded random tokens (the pipeline feeds one batch stream), or on the
standard-library corpus where ``corpus_cache`` is set, from ``weights`` where set. The learning
rate is tiny by default: the jobs measure what a given routing pattern costs, so the weights, and with
them which tokens exit or are routed, should not drift during the measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_dynmo.dynamism  # noqa: F401  # registers the block kinds in the spawned ranks
from benchmarks._lib.common import StepTimer, benchmark_trainer, corpus_data
from lightning_dynmo.callback import DynMoCallback
from lightning_dynmo.data import TextDataModule
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.strategy import DynMoStrategy

__all__ = [
    "JobSpec",
    "PlacementSweep",
    "random_tokens",
    "run_job",
    "sweep_schedule",
    "training_data",
    "visit_schedule",
]

JOB_KINDS = ("dynmo", "fixed", "sweep")


@dataclass(frozen=True)
class JobSpec:
    """One 2-rank training job.

    Attributes:
        kind: ``"dynmo"``, ``"fixed"`` or ``"sweep"``.
        config: The GPT to train.
        steps: Training steps of a ``dynmo`` or ``fixed`` job (a sweep's schedule decides its own).
        batch_size: Rows per batch (``config.seq_len + 1`` tokens each).
        num_microbatches: Micro-batches per step.
        placement: Where a ``dynmo`` job starts and a ``fixed`` job stays.
        callback: ``DynMoCallback`` keyword arguments (``dynmo``).
        callbacks: Factories of the case's own callbacks (a dynamism such as pruning), called in each rank;
            they must pickle (module-level callables or ``functools.partial`` of them).
        candidates: The placements a ``sweep`` visits.
        lead_steps: Untimed steps of a sweep before its first visit (a dynamism that settles first).
        warm_steps: Untimed steps at the start of each sweep visit.
        measure_steps: Timed steps of each sweep visit.
        repeats: Visits to each candidate.
        lr: AdamW learning rate (default one that learns; a job that must hold its routing still while
            it is timed sets its own).
        weight_decay: AdamW decoupled weight decay.
        seed: Seed of the token stream.
        corpus_cache: Train on the standard-library corpus (its first ``corpus_bytes``) cached in this
            folder instead of random tokens (prepare it before the launch: the ranks then share it).
        corpus_bytes: How much of the corpus.
        weights: A saved ``state_dict`` of the GPT to start from (a trained model), else fresh weights.
    """

    kind: str
    config: GPTConfig
    steps: int
    batch_size: int
    num_microbatches: int
    placement: str = "uniform"
    callback: dict[str, Any] = field(default_factory=dict)
    callbacks: tuple[Callable[[], pl.Callback], ...] = ()
    candidates: tuple[str, ...] = ()
    lead_steps: int = 1
    warm_steps: int = 1
    measure_steps: int = 2
    repeats: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    corpus_cache: str | None = None
    corpus_bytes: int = 2**20
    weights: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in JOB_KINDS:
            raise ValueError(f"JobSpec.kind={self.kind!r} is not one of {JOB_KINDS}.")
        if self.kind == "sweep" and not self.candidates:
            raise ValueError("a sweep JobSpec needs candidates (the placements to visit).")


def sweep_schedule(spec: JobSpec) -> list[tuple[str, bool]]:
    """Per step of a sweep: ``(placement, timed)``; step 0 (shape inference) is never timed."""
    return visit_schedule(spec.candidates, spec.warm_steps, spec.measure_steps, spec.repeats, spec.lead_steps)


def visit_schedule(
    candidates: Sequence[str], warm_steps: int, measure_steps: int, repeats: int, lead_steps: int = 1
) -> list[tuple[str, bool]]:
    """Per step: ``(placement, timed)``: ``lead_steps`` untimed, then ``repeats`` rounds of visits.

    Each visit of a candidate is ``warm_steps`` untimed steps (the migration, warm caches) then
    ``measure_steps`` timed ones; candidates are visited in turn, so a drift of a shared machine hits all.
    """
    visit = [(False, warm_steps), (True, measure_steps)]
    steps = [(candidates[0], False)] * max(1, lead_steps)
    for _ in range(repeats):
        for placement in candidates:
            steps += [(placement, timed) for timed, n in visit for _ in range(n)]
    return steps


class PlacementSweep(pl.Callback):
    """Applies the placement the sweep schedule names at each batch start (after the step timer)."""

    def __init__(self, schedule: Sequence[tuple[str, bool]]) -> None:
        self.schedule = list(schedule)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, DynMoStrategy)
        wanted = self.schedule[batch_idx][0]
        if str(strategy.placement) != wanted:
            strategy.apply_placement(wanted)


def random_tokens(spec: JobSpec, steps: int) -> DataLoader[torch.Tensor]:
    """``steps`` batches of seeded random tokens, ``config.seq_len + 1`` per row."""
    gen = torch.Generator().manual_seed(spec.seed)
    shape = (steps * spec.batch_size, spec.config.seq_len + 1)
    rows = torch.randint(0, spec.config.vocab_size, shape, generator=gen)
    return DataLoader(list(rows), batch_size=spec.batch_size, shuffle=False)


def training_data(spec: JobSpec, steps: int) -> DataLoader[torch.Tensor] | TextDataModule:
    """The job's batches: the cached corpus where ``spec.corpus_cache`` is set, else seeded random tokens."""
    if spec.corpus_cache is None:
        return random_tokens(spec, steps)
    return corpus_data(spec.config.seq_len, spec.batch_size, spec.corpus_cache, spec.corpus_bytes)


def run_job(spec: JobSpec) -> dict[str, Any]:
    """Body of one rank: fit ``spec`` and report step times (rank 0's report is what ``launch`` returns)."""
    torch.set_num_threads(1)
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer, *(make() for make in spec.callbacks)]
    dynmo: DynMoCallback | None = None
    schedule = sweep_schedule(spec) if spec.kind == "sweep" else []
    if spec.kind == "dynmo":
        dynmo = DynMoCallback(**spec.callback)
        callbacks.append(dynmo)
    if spec.kind == "sweep":
        callbacks.append(PlacementSweep(schedule))
    placement = schedule[0][0] if schedule else spec.placement
    strategy = DynMoStrategy(num_microbatches=spec.num_microbatches, schedule="1F1B", placement=placement)
    steps = len(schedule) if schedule else spec.steps
    trainer = benchmark_trainer(strategy, callbacks, steps)
    model = GPT(spec.config, OptimizerConfig(lr=spec.lr, weight_decay=spec.weight_decay))
    if spec.weights is not None:
        model.load_state_dict(torch.load(spec.weights, weights_only=True))
    trainer.fit(model, training_data(spec, steps))
    report: dict[str, Any] = {"step_s": timer.step_s, "placement": str(strategy.placement), "rebalances": 0}
    if dynmo is not None:
        report["decisions"] = len(dynmo.rebalances)
        report["why"] = [f"step {r.step}: {r.old} -> {r.new}: {r.why}" for r in dynmo.rebalances]
        report["moved_to"] = [r.new for r in dynmo.rebalances if r.applied]
        report["rebalances"] = len(report["moved_to"])
        report["overhead_s"] = dynmo.overhead_s
        costs = dynmo.last_costs or []
        report["layer_ms"] = [1e3 * (c.fwd_time_s + c.bwd_time_s) for c in costs]
        report["layer_fwd_ms"] = [1e3 * c.fwd_time_s for c in costs]
        report["layer_bwd_ms"] = [1e3 * c.bwd_time_s for c in costs]
    if schedule:
        timed: dict[str, list[float]] = {}
        for (placement_text, is_timed), step_s in zip(schedule, timer.step_s, strict=True):
            if is_timed:
                timed.setdefault(placement_text, []).append(step_s)
        report["sweep_s"] = timed
    return report
