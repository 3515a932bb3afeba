"""Trainer setups DynMoStrategy cannot honour, refused when it sets up, each with the alternative.

Read :func:`check_trainer_setup` (what the strategy calls in ``setup``, on every rank, before any
collective, so every rank fails with the same message), then :func:`check_same_batch_in_pipeline`
(the one check that needs data: every stage of a pipeline must read the same batch).

What the strategy honours, and why (Lightning 2.6, read against its source and tested):

- Automatic optimization: one schedule step replaces ``training_step`` and its gradients reach
  Lightning's ``backward`` (:mod:`lightning_dynmo.pipeline.step.grads`), so ``accumulate_grad_batches``,
  LR schedulers, an overridden ``optimizer_step`` (e.g. LR warm-up; its closure runs the schedule step),
  ``on_before_optimizer_step`` / ``on_after_backward`` (they see this rank's parameters) and
  ``Trainer(detect_anomaly=True)`` / ``overfit_batches`` work as on one device.
- Clipping: ``gradient_clip_algorithm="norm"`` clips by the norm over all stages; ``"value"`` is
  element-wise, so each rank clipping its own gradients is exact. An overridden
  ``configure_gradient_clipping`` is exact when it clips through ``self.clip_gradients(...)`` (Lightning's
  documented way, routed through the same all-stage norm); ``torch.nn.utils.clip_grad_norm_`` called
  directly sees only this rank's stage.
- Precision: ``32-true``, ``64-true``, ``16-true``, ``bf16-true``, ``bf16-mixed`` and ``16-mixed``
  (the loss scale is applied inside the pipeline, :mod:`lightning_dynmo.pipeline.step.loss_scaling`).
- ``use_distributed_sampler=False``: fine as long as the ranks of one pipeline read the same batches
  (checked at the first batch of every epoch).

What it refuses (:func:`check_trainer_setup`): manual optimization, synchronised batch norm, the
precision plugins of other strategies or of quantised/FP8 layers, and the callbacks that copy or
prune the whole model on each rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.plugins.precision import (
    BitsandbytesPrecision,
    DeepSpeedPrecision,
    FSDPPrecision,
    TransformerEnginePrecision,
    XLAPrecision,
)
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

__all__ = ["check_same_batch_in_pipeline", "check_trainer_setup"]

# Precision plugins that belong to other strategies, or convert layers into quantised/FP8 modules whose
# tensor subclasses cannot migrate and whose kernels need one device's whole model.
_REFUSED_PRECISION = {
    BitsandbytesPrecision: "it replaces linear layers with quantised ones whose weights cannot migrate",
    TransformerEnginePrecision: "it replaces layers with Transformer Engine modules that cannot migrate",
    DeepSpeedPrecision: "it belongs to DeepSpeedStrategy",
    FSDPPrecision: "it belongs to FSDPStrategy",
    XLAPrecision: "it belongs to the XLA strategies",
}
_REFUSED_CALLBACKS = {
    StochasticWeightAveraging: (
        "it keeps a copy of the module taken before the strategy cut it into stages, and averages it "
        "against the stage's parameters"
    ),
    WeightAveraging: (
        "it keeps a copy of each rank's stage, which a migration makes stale (moved layers are not in it)"
    ),
    ModelPruning: (
        "it prunes by a magnitude threshold over this rank's stage only (not the whole model), and keeps "
        "its masks in forward pre-hooks, which do not migrate"
    ),
}


def check_trainer_setup(
    module: Any, precision_plugin: Any, layer_sync: Any, callbacks: Sequence[Any], fitting: bool
) -> None:
    """Refuse what DynMoStrategy cannot honour (see the module docstring); call on every rank in ``setup``.

    Args:
        module: The LightningModule.
        precision_plugin: The Trainer's precision plugin.
        layer_sync: The strategy's ``_layer_sync`` (set by ``Trainer(sync_batchnorm=True)``), or None.
        callbacks: The Trainer's callbacks.
        fitting: Whether this is ``Trainer.fit`` (only the precision plugin matters otherwise).

    Raises:
        ValueError: naming the flag, hook or callback, why it cannot work, and what to use instead.
    """
    if fitting and not module.automatic_optimization:
        raise ValueError(
            f"{type(module).__name__}.automatic_optimization is False (manual optimization), but "
            "DynMoStrategy runs one pipeline schedule step in place of the module's training_step (which a "
            "stage holding part of the model cannot run) and hands its gradients to Lightning's automatic "
            "optimization; under manual optimization nothing would step. Use automatic optimization: keep "
            "automatic_optimization=True and configure one optimizer (several models or learning rates: "
            "parameter groups of that optimizer; LR warm-up: an LR scheduler or an optimizer_step override)."
        )
    if fitting and layer_sync is not None:
        raise ValueError(
            f"Trainer(sync_batchnorm=True) (layer sync {type(layer_sync).__name__}) is not supported by "
            "DynMoStrategy: it would synchronise batch-norm statistics over all ranks, which hold different "
            "stages, not copies of one layer. Use Trainer(sync_batchnorm=False), or LayerNorm/GroupNorm, "
            "whose statistics do not depend on the batch split."
        )
    for cls, why in _REFUSED_PRECISION.items():
        if isinstance(precision_plugin, cls):
            raise ValueError(
                f"the precision plugin {type(precision_plugin).__name__} cannot be used with DynMoStrategy: "
                f"{why}. Use Trainer(precision=...) with one of '32-true', '64-true', '16-true', "
                "'bf16-true', 'bf16-mixed' or '16-mixed'."
            )
    for callback in callbacks if fitting else ():
        for cls, why in _REFUSED_CALLBACKS.items():
            if isinstance(callback, cls):
                raise ValueError(
                    f"the callback {type(callback).__name__} cannot be used with DynMoStrategy: {why}. "
                    "Remove it from Trainer(callbacks=...); average or prune a single-device copy of the "
                    "model loaded from a DynMo checkpoint (it holds the whole model under single-process "
                    "names), or keep pruning masks in the module (a buffer or a torch.nn.utils.parametrize "
                    "parametrization)."
                )


def batch_fingerprint(batch: Any) -> Tensor:
    """A float64 number that differs, with overwhelming probability, between two different batches."""
    parts: list[Tensor] = []

    def add(t: Tensor) -> None:
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(997).add_(1)
        parts.append((flat * weights).sum().cpu() + flat.numel())

    apply_to_collection(batch, Tensor, add)
    return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)


def check_same_batch_in_pipeline(
    batch: Any,
    group: dist.ProcessGroup | None,
    ranks: Sequence[int],
    pipeline_of_rank: Sequence[int],
    device: torch.device,
) -> None:
    """Raise on every rank if the ranks of one pipeline read different batches (collective over ``group``).

    Call it at the first batch of every epoch (each epoch may shuffle anew).

    Args:
        batch: This rank's batch.
        group: The active ranks' group.
        ranks: The active global ranks, in ``group`` order.
        pipeline_of_rank: The data-parallel replica (pipeline) of each of ``ranks``.
        device: Where the collective's tensors live (the rank's device, for NCCL).

    Raises:
        ValueError: naming the pipeline and its ranks, and how to give every stage the same batch.
    """
    mine = batch_fingerprint(batch).to(device)
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=group)
    prints = [float(t) for t in gathered]
    for pipeline in sorted(set(pipeline_of_rank)):
        members = [(r, p) for r, p, q in zip(ranks, prints, pipeline_of_rank, strict=True) if q == pipeline]
        if len({p for _, p in members}) > 1:
            raise ValueError(
                f"the ranks {[r for r, _ in members]} of pipeline {pipeline} read different batches at "
                "the first batch of the epoch, but every stage of a pipeline must see the same batch (stage "
                "0 feeds its inputs, the last stage scores its targets). Use Trainer(use_distributed_sampler="
                "True): DynMoStrategy then shards the data by pipeline replica. With your own sampler, shard "
                "by strategy.data_parallel_rank / strategy.data_parallel_size (not by global rank) and "
                "shuffle with the same seed on every rank."
            )
