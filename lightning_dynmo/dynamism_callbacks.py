"""Lightning glue for the dynamism controllers of :mod:`lightning_dynmo.dynamism` (torch-only themselves).

Read :func:`pruning_scope` (how a Trainer's strategy becomes the layers and groups a controller works
on), then :class:`PruningCallback`.

A controller needs, on every rank and at the right step: the blocks this rank holds, the group of ranks
that together hold the whole model (the pipeline group: a global decision such as a pruning threshold is
taken over it), the data-parallel group (replicas agree), the optimizers and the device. Under
:class:`~lightning_dynmo.DynMoStrategy` these are the strategy's current ones (they change with
migrations and re-packs, so they are read at each step); under any other strategy the process holds the
whole model, and the data-parallel group is the world when there is more than one process (as for the
MoE expert-bias update).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dynmo.dynamism.pruning import GlobalMagnitudePruner, PruningConfig, PruningReport, PruningScope
from lightning_dynmo.events import EventBus

__all__ = ["PruningCallback", "pruning_scope"]


def pruning_scope(trainer: pl.Trainer, pl_module: pl.LightningModule) -> PruningScope | None:
    """This rank's blocks and groups now; ``None`` on a rank a re-pack released."""
    from lightning_dynmo.strategy import DynMoStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DynMoStrategy):
        if strategy.stage_index is None:
            return None
        return PruningScope(
            layers=strategy.local_layers,
            num_layers=strategy.placement.num_layers,
            pipeline_group=strategy.pipeline_group,
            data_parallel_group=strategy.data_parallel_group,
            optimizers=trainer.optimizers,
            device=strategy.root_device,
        )
    layers = {int(k): m for k, m in _blocks(pl_module).items()}
    replicated = dist.is_available() and dist.is_initialized() and trainer.world_size > 1
    return PruningScope(
        layers=layers,
        num_layers=len(layers),
        pipeline_group=None,
        data_parallel_group=dist.group.WORLD if replicated else None,
        optimizers=trainer.optimizers,
        device=strategy.root_device,
    )


class PruningCallback(Callback):
    """Gradual global magnitude pruning of the blocks in ``fit`` (:mod:`lightning_dynmo.dynamism.pruning`).

    At ``setup`` every ``nn.Linear`` of the blocks (``pl_module.layers``) becomes a masked Linear, on the
    whole model before the strategy keeps each rank's part (blocks a model creates later, in
    ``configure_model``, are converted at the first pruning step). At the first batch of every optimizer step
    (``trainer.global_step``; once per step under gradient accumulation) it runs the pruner, which prunes
    at the schedule's steps and publishes a ``pruned`` event that :class:`~lightning_dynmo.DynMoCallback`
    answers by profiling and rebalancing. The history of pruning steps is saved in checkpoints; masks and
    kernel choices are in the model's state.

    Args:
        config: The pruning settings; ``None`` is ``PruningConfig()`` (the paper's schedule).
        event_bus: Where the ``pruned`` events go (default: the process-wide bus).
    """

    def __init__(self, config: PruningConfig | None = None, *, event_bus: EventBus | None = None) -> None:
        self.pruner = GlobalMagnitudePruner(config, event_bus=event_bus)
        self._last_step: int | None = None

    @property
    def history(self) -> list[PruningReport]:
        """Every pruning step run so far on this rank (restored from checkpoints)."""
        return self.pruner.history

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        layers = getattr(pl_module, "layers", None)
        if stage == "fit" and layers is not None:  # blocks made later (configure_model) convert when pruned
            self.pruner.prepare({int(k): m for k, m in layers.items()})

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # a later micro-batch of an accumulated step
        self._last_step = step
        scope = pruning_scope(trainer, pl_module)
        if scope is not None:
            self.pruner.step(step, scope)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.pruner.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruner.load_state_dict(state_dict)


def _blocks(pl_module: pl.LightningModule) -> Any:
    layers = getattr(pl_module, "layers", None)
    if layers is None:
        raise TypeError(
            f"PruningCallback prunes the blocks of a model following DynMo's contract, but "
            f"{type(pl_module).__name__} has no `layers` (an nn.ModuleDict of blocks keyed by global index); "
            "add one (see lightning_dynmo.pipeline.contract)."
        )
    return layers
