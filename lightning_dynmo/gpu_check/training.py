"""Training parts of the GPU check: ``DynMoStrategy`` with mixed precision, and per-layer costs per case.

Both run ``Trainer.fit`` with :class:`~lightning_dynmo.DynMoCallback`, so what they exercise is what a user
runs: CUDA-event profiling (every mark the profiler takes is counted by clock kind), memory caps taken from
the device's memory, fp16 loss scaling, and (with two processes) a migration by ``apply_placement``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override

from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.callback import DynMoCallback
from lightning_dynmo.callback.config import ProfilingConfig
from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.dynamism.early_exit import early_exit_config
from lightning_dynmo.dynamism.freezing import FreezingConfig
from lightning_dynmo.dynamism.mod import mod_config
from lightning_dynmo.dynamism.moe import moe_gpt_config
from lightning_dynmo.dynamism.pruning import PruningConfig, pruning_gpt_config
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_attention import sparse_attention_gpt_config
from lightning_dynmo.dynamism_callbacks import FreezingCallback, PruningCallback
from lightning_dynmo.gpu_check.plan import Sizes, cost_steps
from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.strategy import DynMoStrategy

VOCAB = 256  # byte tokens, as the repo's GPT configs
TIMEOUT = timedelta(seconds=90)  # a lost peer fails the part well inside its own timeout


def train(options: dict[str, Any], sizes: Sizes, device: str) -> dict[str, Any] | None:
    """Fit a dense GPT on ``options["devices"]`` processes at ``options["precision"]``.

    With ``options["migrate"]`` a callback moves one layer from the last stage to the first at step 1
    (``apply_placement``), so device tensors migrate with their optimizer state mid-run.
    """
    config = _dense(sizes)
    callbacks: list[pl.Callback] = []
    if options.get("migrate"):
        callbacks.append(_ForcedMove(_shifted(sizes.num_layers)))
    with _counting_marks() as marks:
        trainer, dynmo, steps = _fit(
            config, sizes, device, options["devices"], options["precision"], callbacks
        )
    if trainer.global_rank != 0:
        return None
    return {
        **_summary(trainer, dynmo, steps, marks),
        "migration": next((c.report for c in callbacks if isinstance(c, _ForcedMove)), None),
        "loss_scale": _loss_scale(trainer),
    }


def layer_costs(options: dict[str, Any], sizes: Sizes, device: str) -> dict[str, Any] | None:
    """Fit one case's GPT in one process; its per-layer costs as DynMo's profiler measured them."""
    case = options["case"]
    sizes = dataclasses.replace(sizes, steps=cost_steps(sizes))
    config, callbacks = CASES[case](sizes)
    precision = options.get("precision", "bf16-mixed")
    with _counting_marks() as marks:
        trainer, dynmo, steps = _fit(config, sizes, device, 1, precision, callbacks)
    if dynmo.last_costs is None:
        raise RuntimeError(f"{case}: DynMoCallback measured nothing in {sizes.steps} steps")
    return {
        **_summary(trainer, dynmo, steps, marks),
        "case": case,
        "precision": precision,
        "blocks": [type(b).__name__ for b in cast(nn.ModuleDict, trainer.lightning_module.layers).values()],
        "layer_costs": [dataclasses.asdict(c) for c in dynmo.last_costs],
        "hardware_model": dataclasses.asdict(dynmo.last_hardware) if dynmo.last_hardware else None,
    }


# -- the cases --------------------------------------------------------------------------------------------


def _shape(sizes: Sizes) -> dict[str, int]:
    return {"num_layers": sizes.num_layers, "d_model": sizes.d_model, "num_heads": sizes.num_heads}


def _dense(sizes: Sizes) -> GPTConfig:
    return GPTConfig(
        vocab_size=VOCAB,
        blocks="dense",
        num_layers=sizes.num_layers,
        d_model=sizes.d_model,
        num_heads=sizes.num_heads,
        seq_len=sizes.seq_len,
    )


def _moe(sizes: Sizes) -> tuple[GPTConfig, list[pl.Callback]]:
    return moe_gpt_config(**_shape(sizes), seq_len=sizes.seq_len), []


def _pruning(sizes: Sizes) -> tuple[GPTConfig, list[pl.Callback]]:
    # 90% global sparsity reached at step 5, before DynMo's window; each layer on its faster kernel.
    schedule = PruningSchedule(final_sparsity=0.9, start_step=1, frequency=2, num_steps=2)
    rows = sizes.batch_size // sizes.num_microbatches * sizes.seq_len
    pruning = PruningConfig(schedule=schedule, kernel="auto", timing_rows=rows)
    return pruning_gpt_config(**_shape(sizes), seq_len=sizes.seq_len), [PruningCallback(pruning)]


def _freezing(sizes: Sizes) -> tuple[GPTConfig, list[pl.Callback]]:
    # The first half of the blocks frozen at step 2.
    freezing = FreezingConfig(criterion="schedule", schedule=((2, sizes.num_layers // 2),))
    return _dense(sizes), [FreezingCallback(freezing)]


def _early_exit(sizes: Sizes) -> tuple[GPTConfig, list[pl.Callback]]:
    # threshold 0.01 as conf/dynamism/early_exit.yaml: an untrained byte model's tokens leave within steps.
    first = max(1, sizes.num_layers // 4)
    return early_exit_config(
        **_shape(sizes), seq_len=sizes.seq_len, first_exit_layer=first, threshold=0.01
    ), []


def _sparse_attention(sizes: Sizes) -> tuple[GPTConfig, list[pl.Callback]]:
    block = 64 if sizes.seq_len >= 512 else 8
    config = sparse_attention_gpt_config(
        **_shape(sizes), seq_len=sizes.seq_len, num_buckets=4, block_size=block
    )
    return config, []


def _mod(sizes: Sizes) -> tuple[GPTConfig, list[pl.Callback]]:
    return mod_config(**_shape(sizes), seq_len=sizes.seq_len, capacity=0.125, routing="predictor"), []


CASES: dict[str, Callable[[Sizes], tuple[GPTConfig, list[pl.Callback]]]] = {
    "moe": _moe,
    "pruning": _pruning,
    "freezing": _freezing,
    "early_exit": _early_exit,
    "sparse_attention": _sparse_attention,
    "mod": _mod,
}


# -- one fit ----------------------------------------------------------------------------------------------


def _fit(
    config: GPTConfig,
    sizes: Sizes,
    device: str,
    devices: int,
    precision: str,
    callbacks: list[pl.Callback],
) -> tuple[pl.Trainer, DynMoCallback, _StepTimes]:
    config = dataclasses.replace(config, seq_len=sizes.seq_len)
    # No smoothing: each window's costs are its own, so two windows tell a one-off from a steady cost.
    profiling = ProfilingConfig(warmup_steps=1, steps=2, cost_smoothing=0.0)
    dynmo = DynMoCallback(every_n_steps=sizes.rebalance_at, profiling=profiling)
    steps = _StepTimes(dynmo)
    strategy = DynMoStrategy(
        num_microbatches=sizes.num_microbatches,
        timeout=TIMEOUT,
        control_timeout=TIMEOUT,
        start_method="popen",
    )
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]  # checked by Lightning
        max_steps=sizes.steps,
        callbacks=[*callbacks, dynmo, steps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    data = RandomTokenDataModule(
        batch_size=sizes.batch_size,
        num_samples=sizes.batch_size * sizes.steps,
        seq_len=sizes.seq_len,
        vocab_size=VOCAB,
    )
    trainer.fit(GPT(config), data)
    return trainer, dynmo, steps


def _summary(
    trainer: pl.Trainer, dynmo: DynMoCallback, steps: _StepTimes, marks: Counter[str]
) -> dict[str, Any]:
    strategy = trainer.strategy
    assert isinstance(strategy, DynMoStrategy)
    root = strategy.root_device
    total = torch.cuda.get_device_properties(root).total_memory if root.type == "cuda" else None
    return {
        "devices": trainer.num_devices,
        "precision": str(trainer.precision),
        "process_group_backend": strategy.process_group_backend,
        "device": str(root),
        "steps": trainer.global_step,
        "step_s": steps.seconds,
        "median_step_s": statistics.median(steps.seconds) if steps.seconds else None,
        "losses": steps.losses,
        "losses_finite": all(math.isfinite(v) for v in steps.losses),
        "placement": str(strategy.placement),
        "rebalances": [dataclasses.asdict(r) for r in dynmo.rebalances],
        "cost_windows": steps.windows,
        "clock_marks": dict(marks),
        "memory_capacity_bytes": dynmo.balance.memory_capacity_bytes,
        "device_total_memory_bytes": total,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(root) if root.type == "cuda" else None,
    }


def _loss_scale(trainer: pl.Trainer) -> float | None:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return None if scaler is None else float(scaler.get_scale())


def _shifted(num_layers: int) -> str:
    """The uniform 2-stage split with one layer moved from the second stage to the first."""
    half = num_layers // 2
    return f"0-{half}|{half + 1}-{num_layers - 1}"


@contextmanager
def _counting_marks() -> Iterator[Counter[str]]:
    """Count the profiler's time marks by kind (CUDA event or perf_counter) while the block runs."""
    counts: Counter[str] = Counter()
    original = StepClock.mark

    def counting(self: StepClock) -> Any:
        counts["cuda_event" if self.uses_cuda_events else "perf_counter"] += 1
        return original(self)

    StepClock.mark = counting  # type: ignore[method-assign]  # instrumentation, undone below
    try:
        yield counts
    finally:
        StepClock.mark = original  # type: ignore[method-assign]


class _StepTimes(pl.Callback):
    """Wall seconds per step (the device synchronised), the logged training loss, and each profiling window.

    A window is recorded when ``dynmo``'s costs change, as the step it ended at and every layer's forward
    + backward milliseconds (on the rank that holds the gathered costs).
    """

    def __init__(self, dynmo: DynMoCallback) -> None:
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.windows: list[dict[str, Any]] = []
        self._dynmo = dynmo
        self._costs: list[LayerCost] | None = None
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._sync(pl_module)
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._sync(pl_module)
        self.seconds.append(time.perf_counter() - self._start)
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.losses.append(float(loss))
        costs = self._dynmo.last_costs
        if costs is not None and costs is not self._costs:
            self._costs = costs
            layer_ms = [round(1e3 * (c.fwd_time_s + c.bwd_time_s), 3) for c in costs]
            self.windows.append({"step": trainer.global_step, "layer_ms": layer_ms})

    @staticmethod
    def _sync(pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)


class _ForcedMove(pl.Callback):
    """Calls ``apply_placement(placement)`` at the start of step 1 and keeps this rank's report."""

    def __init__(self, placement: str) -> None:
        self.placement = placement
        self.report: dict[str, Any] | None = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != 1:
            return
        strategy = trainer.strategy
        assert isinstance(strategy, DynMoStrategy)
        before = str(strategy.placement)
        report = strategy.apply_placement(self.placement)
        self.report = {
            "before": before,
            "after": str(strategy.placement),
            "moves": [dataclasses.asdict(m) for m in report.moves],
            "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received,
            "seconds": report.seconds,
        }
