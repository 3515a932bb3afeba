"""RunReport: what a training run did, as a short table at the end and as ``summary.json``.

Read in this order: :class:`RunReport` (the callback: per-step wall time and placement on global rank 0,
DynMo's rebalances, released ranks, where logs and checkpoints are), :func:`build_summary` (the facts,
pure), :func:`format_summary` (the table).

Throughput is tokens (next-token targets) per second of the whole job: a step's tokens (batch rows x
sequence length x data-parallel replicas) over its wall time, start of one step to start of the next, as
rank 0 sees it (the ranks of a pipeline move in lockstep). A *segment* is a run of steps at one
placement; its throughput uses the median step, so the slower first step on a rebuilt pipeline and the
profiling steps weigh little.

"Static vs DynMo" compares the static split with DynMo's placement in the same run, on the steps
adjacent to DynMo's first rebalance (the static phase is the training before it): up to
``window_steps`` steps right before it against as many right after it, the first one on the new
placement left out. Adjacent steps see (nearly) the same model; comparing the first placement's
segment with the last one would also credit DynMo with what the dynamic model itself saved meanwhile
(early exit and freezing shrink the work as they train), so that pair is reported apart, as what it is.
The comparison is marked *within noise* when it cannot tell the two apart: fewer than
:data:`MIN_COMPARED_STEPS` steps on a side, or per-step throughputs of the two windows that overlap (the
slowest step after the rebalance is no faster than the fastest before it, or the other way round).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor
from typing_extensions import override

from lightning_dynmo.callback.dynmo_callback import DynMoCallback

__all__ = ["MIN_COMPARED_STEPS", "RunReport", "Segment", "build_summary", "format_summary", "within_noise"]

#: Fewer steps than this on either side of the first rebalance: the comparison is within noise.
MIN_COMPARED_STEPS = 3

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """Steps ``first_step .. last_step`` that ran at one placement.

    Attributes:
        placement: The placement's canonical text.
        first_step: First optimizer step (0-based) at it.
        last_step: Last one.
        median_step_s: Median wall time of its steps (its first step left out when it has several).
        tokens_per_s: Tokens of a step over ``median_step_s``.
    """

    placement: str
    first_step: int
    last_step: int
    median_step_s: float
    tokens_per_s: float


class RunReport(Callback):
    """Records a run on global rank 0 and ends it with a summary table and ``summary.json``.

    Args:
        summary_path: Where to write the JSON summary (``None``: nowhere).
        window_steps: Steps on each side of DynMo's first rebalance compared as "static" and "DynMo".
        print_summary: Print the table at the end of ``fit`` (the application turns it off when its
            launching process prints it instead).
        run_info: Extra facts copied into the summary (the application passes the config choices).
    """

    def __init__(
        self,
        *,
        summary_path: str | None = "summary.json",
        window_steps: int = 5,
        print_summary: bool = True,
        run_info: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(window_steps, bool) or not isinstance(window_steps, int) or window_steps < 1:
            raise ValueError(f"RunReport(window_steps={window_steps!r}) must be an integer >= 1.")
        self.summary_path = summary_path
        self.window_steps = window_steps
        self.print_summary = print_summary
        self.run_info = dict(run_info or {})
        self.summary: dict[str, Any] | None = None
        self._steps: list[tuple[int, str, int]] = []  # (global step, placement, tokens)
        self._starts: list[float] = []
        self._released: list[dict[str, Any]] = []
        self._fit_start = 0.0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        self._starts.append(time.perf_counter())
        placement = getattr(trainer.strategy, "placement", None)
        replicas = int(getattr(trainer.strategy, "data_parallel_size", trainer.world_size))
        self._steps.append((trainer.global_step, str(placement), _tokens(batch) * replicas))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._starts.append(time.perf_counter())  # the end of the last step

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After on_train_end, so the checkpoints of the run's end are written and named.
        if not trainer.is_global_zero or not self._steps:
            return
        self.summary = build_summary(
            self._step_records(),
            _rebalances(trainer),
            released=self._released,
            window_steps=self.window_steps,
            final_placement=str(getattr(trainer.strategy, "placement", None)),
            fit_s=self._starts[-1] - self._fit_start,
            paths=_paths(trainer, self.summary_path),
            info=self.run_info,
        )
        if self.summary_path is not None:
            path = Path(self.summary_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.summary, indent=2) + "\n")
        if self.print_summary:
            print(format_summary(self.summary), flush=True)

    def on_dynmo_ranks_released(self, trainer: pl.Trainer, pl_module: pl.LightningModule, event: Any) -> None:
        """Called by :class:`~lightning_dynmo.DynMoStrategy` when a re-pack releases ranks."""
        self._released.append(
            {
                "step": event.global_step,
                "released_ranks": list(event.released_ranks),
                "old": event.old_placement,
                "new": event.new_placement,
            }
        )

    def _step_records(self) -> list[dict[str, Any]]:
        durations = [b - a for a, b in zip(self._starts, self._starts[1:], strict=False)]
        return [
            {"step": step, "placement": placement, "tokens": tokens, "step_s": seconds}
            for (step, placement, tokens), seconds in zip(self._steps, durations, strict=False)
        ]


def build_summary(
    steps: list[dict[str, Any]],
    rebalances: list[dict[str, Any]],
    *,
    released: list[dict[str, Any]],
    window_steps: int,
    final_placement: str,
    fit_s: float,
    paths: dict[str, Any],
    info: dict[str, Any],
) -> dict[str, Any]:
    """The run's facts (see the module docstring for how throughput is measured)."""
    segments = _segments(steps)
    applied = [r for r in rebalances if r.get("applied")]
    tokens = sum(s["tokens"] for s in steps)
    train_s = sum(s["step_s"] for s in steps)
    return {
        **info,
        "steps": len(steps),
        "fit_s": fit_s,
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "initial_placement": segments[0].placement if segments else final_placement,
        "final_placement": final_placement,
        "placements": [vars(s) for s in segments],
        "rebalances": [
            {
                key: r.get(key)
                for key in ("step", "reason", "old", "new", "predicted_gain", "measured_gain", "migration_s")
            }
            for r in applied
        ],
        "decisions_kept": len(rebalances) - len(applied),
        "static_vs_dynmo": _static_vs_dynmo(steps, applied, window_steps),
        "released_ranks": released,
        **paths,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a short plain-text table."""
    lines = ["", "DynMo run summary" + _describe(summary)]
    lines.append(f"  {'steps':<11} {'placement':<24} {'median step':>11} {'tokens/s':>10}")
    for s in summary["placements"]:
        steps = f"{s['first_step']}-{s['last_step']}"
        lines.append(
            f"  {steps:<11} {s['placement']:<24} {s['median_step_s']:>9.3f} s {s['tokens_per_s']:>10,.0f}"
        )
    rebalances = summary["rebalances"]
    if rebalances:
        lines.append(f"  {'rebalance':<11} {'old -> new':<36} {'predicted':>9} {'measured':>9}")
        for r in rebalances:
            change = f"{r['old']} -> {r['new']}"
            predicted, measured = _pct(r["predicted_gain"]), _pct(r["measured_gain"])
            lines.append(f"  step {r['step']:<6} {change:<36} {predicted:>9} {measured:>9}")
    else:
        lines.append(
            f"  no rebalance: DynMo kept {summary['final_placement']} ({summary['decisions_kept']} decisions)"
        )
    versus = summary["static_vs_dynmo"]
    if versus is not None:
        lines.append(
            f"  static split {versus['static_tokens_per_s']:,.0f} tokens/s -> DynMo "
            f"{versus['dynmo_tokens_per_s']:,.0f} tokens/s: {versus['speedup']:.2f}x "
            f"(the {versus['static_steps']} steps before step {versus['step']} vs the "
            f"{versus['dynmo_steps']} after" + ("; within noise)" if versus.get("within_noise") else ")")
        )
    if summary["released_ranks"]:
        for event in summary["released_ranks"]:
            lines.append(f"  released ranks {event['released_ranks']} at step {event['step']}")
    lines.append(f"  whole run: {summary['steps']} steps, {_num(summary['tokens_per_s'])} tokens/s")
    for key in ("logs", "checkpoints", "summary"):
        value = summary.get(key)
        if value:
            shown = ", ".join(value) if isinstance(value, list) else value
            lines.append(f"  {key + ':':<13}{shown}")
    return "\n".join(lines)


# -- pieces ---------------------------------------------------------------------------------------------


def _tokens(batch: Any) -> int:
    """Next-token targets in a batch of ``[rows, seq_len + 1]`` token rows (else its first dimension)."""
    if isinstance(batch, Tensor) and batch.dim() == 2:
        return int(batch.shape[0]) * max(int(batch.shape[1]) - 1, 1)
    if isinstance(batch, Tensor):
        return int(batch.shape[0])
    return 0


def _segments(steps: list[dict[str, Any]]) -> list[Segment]:
    runs: list[list[dict[str, Any]]] = []
    for step in steps:
        if runs and runs[-1][-1]["placement"] == step["placement"]:
            runs[-1].append(step)
        else:
            runs.append([step])
    out = []
    for run in runs:
        timed = run[1:] if len(run) > 1 else run
        median = statistics.median(s["step_s"] for s in timed)
        tokens = statistics.median(s["tokens"] for s in timed)
        out.append(
            Segment(
                placement=run[0]["placement"],
                first_step=run[0]["step"],
                last_step=run[-1]["step"],
                median_step_s=median,
                tokens_per_s=tokens / median if median > 0 else 0.0,
            )
        )
    return out


def _static_vs_dynmo(
    steps: list[dict[str, Any]], applied: list[dict[str, Any]], window: int
) -> dict[str, Any] | None:
    if not applied:
        return None
    at = applied[0]["step"]
    later = [r["step"] for r in applied[1:]]
    end = min(later) if later else None
    before = [s for s in steps if s["step"] < at][-window:]
    after = [s for s in steps if s["step"] > at and (end is None or s["step"] < end)][:window]
    if not before or not after:
        return None
    static_rates = [s["tokens"] / s["step_s"] for s in before if s["step_s"] > 0]
    dynmo_rates = [s["tokens"] / s["step_s"] for s in after if s["step_s"] > 0]
    if not static_rates or not dynmo_rates:
        return None
    static, dynmo = statistics.median(static_rates), statistics.median(dynmo_rates)
    return {
        "step": at,
        "static_tokens_per_s": static,
        "dynmo_tokens_per_s": dynmo,
        "speedup": dynmo / static if static > 0 else None,
        "static_steps": len(before),
        "dynmo_steps": len(after),
        "within_noise": within_noise(static_rates, dynmo_rates),
    }


def within_noise(static: list[float], dynmo: list[float]) -> bool:
    """Whether two windows of per-step throughputs cannot be told apart: fewer than
    :data:`MIN_COMPARED_STEPS` steps in either, or ranges that overlap (the slowest step of one is no
    faster than the fastest of the other)."""
    if min(len(static), len(dynmo)) < MIN_COMPARED_STEPS:
        return True
    return min(dynmo) <= max(static) and min(static) <= max(dynmo)


def _rebalances(trainer: pl.Trainer) -> list[dict[str, Any]]:
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, DynMoCallback):
            return [r.to_dict() for r in callback.rebalances]
    return []


def _paths(trainer: pl.Trainer, summary_path: str | None) -> dict[str, Any]:
    logs = [str(logger.log_dir) for logger in trainer.loggers if getattr(logger, "log_dir", None)]
    checkpoints = None
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            checkpoints = callback.last_model_path or callback.best_model_path or str(callback.dirpath)
    return {"logs": logs, "checkpoints": checkpoints, "summary": summary_path}


def _describe(summary: dict[str, Any]) -> str:
    parts = [f"{k}={summary[k]}" for k in ("dynamism", "balancer", "schedule") if summary.get(k)]
    return f" ({', '.join(parts)})" if parts else ""


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
