"""One fit per case: pipelined on forked gloo ranks, or as its single-process float64 reference.

A case (a frozen dataclass in its test module) states only what is specific to it: per rank, the model,
data, callbacks and strategy it trains, as a :class:`Fit`. This module runs it and compares::

    results = fit_case(case, tmp_path)  # case.rank_fit(rank, ...) on 2 forked ranks: one dict per rank
    ref = fit_reference(Fit(model, data, recorder, trainer_kwargs()))  # no strategy, in this process
    assert_equivalent(results, ref)  # tests.distributed.equivalence

Each rank returns its logged losses, its local state (global keys, so the ranks' union is the whole
model), its placement, whether it was released, and what ``ForcePlacement`` and ``DynMoCallback`` did.
The reference trains single-threaded, as every rank does. :mod:`tests.distributed.equivalence` compares them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import ForcePlacement, local_state
from tests.distributed.harness import run_distributed


def trainer_kwargs(epochs: int = 1, **overrides: Any) -> dict[str, Any]:
    """``pl.Trainer`` keywords of every equivalence fit: CPU, float64, no logging or checkpoints."""
    quiet: dict[str, Any] = {
        "accelerator": "cpu",
        "precision": "64-true",
        "max_epochs": epochs,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return {**quiet, **overrides}


def set_rank_env(rank: int) -> None:
    """LightningEnvironment's view of a forked rank: the processes are created externally."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"


class MetricsRecorder(pl.Callback):
    """The logged ``names`` after every training step (a tuple), and ``validation`` after every epoch.

    A missing name fails the step unless ``optional`` (then the tuple holds the names that were logged).
    """

    def __init__(self, *names: str, validation: str | None = None, optional: bool = False) -> None:
        self.names, self.validation, self.optional = names, validation, optional
        self.losses: list[tuple[float, ...]] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        names = [k for k in self.names if k in trainer.callback_metrics] if self.optional else self.names
        self.losses.append(tuple(float(trainer.callback_metrics[k]) for k in names))

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.validation is not None and not trainer.sanity_checking:
            self.losses.append((float(trainer.callback_metrics[self.validation]),))


@dataclass
class Fit:
    """What one process trains: ``trainer.fit(model, *data)`` with ``recorder`` first among the callbacks.

    Attributes:
        model: the LightningModule, freshly built (identically seeded on every rank and in the reference).
        data: what ``trainer.fit`` takes after the model (loaders or a datamodule).
        recorder: the callback whose ``losses`` are compared.
        trainer: ``pl.Trainer`` keywords (see :func:`trainer_kwargs`).
        callbacks: the other callbacks, in order.
        strategy: the pipelined run's strategy; None for the reference.
        use_sampler: whether Lightning injects its DistributedSampler.
        outcome: what else the case reports after the fit, from the trainer (merged into the result).
    """

    model: pl.LightningModule
    data: tuple[Any, ...]
    recorder: Any
    trainer: dict[str, Any]
    callbacks: list[pl.Callback] = field(default_factory=list)
    strategy: DynMoStrategy | None = None
    use_sampler: bool = False
    outcome: Callable[[pl.Trainer], dict[str, Any]] | None = None

    def first(self, kind: type[Any]) -> Any:
        return next((cb for cb in self.callbacks if isinstance(cb, kind)), None)


class Case(Protocol):
    def rank_fit(self, rank: int, world_size: int, resume: bool) -> Fit: ...


def case_worker(rank: int, world_size: int, case: Case, ckpt: Path | None, resume: bool) -> dict[str, Any]:
    """Body of one forked rank: fit the case (resuming from, or saving to, ``ckpt``) and report."""
    set_rank_env(rank)
    fit = case.rank_fit(rank, world_size, resume)
    strategy = fit.strategy
    assert strategy is not None, "a pipelined Fit needs its strategy"
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        use_distributed_sampler=fit.use_sampler,
        callbacks=[fit.recorder, *fit.callbacks],
        **fit.trainer,
    )
    trainer.fit(fit.model, *fit.data, ckpt_path=ckpt if resume else None)
    if ckpt is not None and not resume:
        trainer.save_checkpoint(ckpt)  # a no-op on a released rank
    dynmo: DynMoCallback | None = fit.first(DynMoCallback)
    mover: ForcePlacement | None = fit.first(ForcePlacement)
    rebalances = [r.to_dict() for r in dynmo.rebalances] if dynmo is not None else []
    return {
        "losses": fit.recorder.losses,
        "state": local_state(fit.model),
        "placement": str(strategy.placement),
        "released": strategy.is_released,
        "applied": mover.applied if mover is not None else [],
        "rebalances": rebalances,
        "moved": [r for r in rebalances if r["applied"]],
        "events": [(e.kind, e.layers, e.step) for e in dynmo.events] if dynmo is not None else [],
        "skipped_windows": dynmo.skipped_windows if dynmo is not None else 0,
        **(fit.outcome(trainer) if fit.outcome is not None else {}),
    }


def fit_case(
    case: Case, tmp_path: Path, *, world_size: int = 2, ckpt: Path | None = None, resume: bool = False
) -> list[dict[str, Any]]:
    """Fit ``case`` on ``world_size`` forked gloo ranks; see :func:`case_worker` for each rank's result."""
    return run_distributed(case_worker, world_size, tmp_path, timeout_s=240, args=(case, ckpt, resume))


@contextmanager
def _one_thread() -> Iterator[None]:
    # As the ranks run: tiny matrices are also much slower on 2 threads on this machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fit_reference(fit: Fit) -> dict[str, Any]:
    """Train ``fit`` (no strategy) in this process on one device; its losses, state, model and outcome."""
    assert fit.strategy is None, "the reference trains without a pipeline"
    trainer = pl.Trainer(devices=1, callbacks=[fit.recorder, *fit.callbacks], **fit.trainer)
    with _one_thread():
        trainer.fit(fit.model, *fit.data)
    return {
        "losses": fit.recorder.losses,
        "state": local_state(fit.model),
        "model": fit.model,
        **(fit.outcome(trainer) if fit.outcome is not None else {}),
    }


def rebalance_on_events(skip_balanced: bool = False) -> DynMoCallback:
    """DynMoCallback as the freezing and pruning fits use it: a decision one step after each event (every
    event profiled; with ``skip_balanced`` an event after the first decision is judged on the step after
    it first)."""
    return DynMoCallback(
        balancer="partition",
        cost="time",
        skip_balanced=skip_balanced,
        profiling=ProfilingConfig(warmup_steps=0, steps=1),
    )


def resume_elsewhere(
    case: Any, tmp_path: Path, forgetful: type[DynMoStrategy]
) -> tuple[Any, list[Any], list[Any]]:
    """Fit ``case`` (one epoch, ``DynMoCallback`` on) and save; resume for a second epoch elsewhere.

    The second run has no callback: it starts, and stays, at a placement other than the saved one
    (asserted). ``case`` is a frozen dataclass with ``epochs``, ``placement``, ``dynmo`` and
    ``strategy_cls`` fields. Returns the second run, its results, and the results of the same resume
    under ``forgetful`` (a negative control's strategy).
    """
    ckpt = tmp_path / "epoch1.ckpt"
    first = fit_case(case, tmp_path, ckpt=ckpt)
    saved = first[0]["placement"]
    other = "0-2|3-3" if saved != "0-2|3-3" else "0-1|2-3"
    second = replace(case, epochs=2, placement=other, dynmo=None)
    resumed = fit_case(second, tmp_path, ckpt=ckpt, resume=True)
    assert all(res["placement"] == other != saved for res in resumed)
    forgot = fit_case(replace(second, strategy_cls=forgetful), tmp_path, ckpt=ckpt, resume=True)
    return second, resumed, forgot
