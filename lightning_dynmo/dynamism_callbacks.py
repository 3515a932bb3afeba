"""Lightning glue for the dynamism controllers of :mod:`lightning_dynmo.dynamism` (torch-only themselves).

Read :func:`pruning_scope` (how a Trainer's strategy becomes the layers and groups a controller works
on), then :class:`PruningCallback`; :func:`freezing_scope` and :class:`FreezingCallback` follow the same
pattern.

A controller needs, on every rank and at the right step: the blocks this rank holds, the group of ranks
that together hold the whole model (the pipeline group: a global decision such as a pruning threshold is
taken over it), the data-parallel group (replicas agree), the optimizers and the device. Under
:class:`~lightning_dynmo.DynMoStrategy` these are the strategy's current ones (they change with
migrations and re-packs, so they are read at each step); under any other strategy the process holds the
whole model, and the data-parallel group is the world when there is more than one process (as for the
MoE expert-bias update).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Protocol

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lightning_dynmo.dynamism.freezing import FreezingConfig, FreezingReport, FreezingScope, LayerFreezer
from lightning_dynmo.dynamism.pruning import GlobalMagnitudePruner, PruningConfig, PruningReport, PruningScope
from lightning_dynmo.events import EventBus
from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

__all__ = ["FreezingCallback", "PruningCallback", "freezing_scope", "pruning_scope"]


def pruning_scope(trainer: pl.Trainer, pl_module: pl.LightningModule) -> PruningScope | None:
    """This rank's blocks and groups now; ``None`` on a rank a re-pack released."""
    strategy = trainer.strategy
    if isinstance(strategy, DynMoStrategy):
        view = strategy.pipeline_view()
        if view.stage_index is None:
            return None
        return PruningScope(
            layers=view.local_layers,
            num_layers=view.placement.num_layers,
            pipeline_group=view.pipeline_group,
            data_parallel_group=view.data_parallel_group,
            optimizers=trainer.optimizers,
            device=view.root_device,
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


class _Controller(Protocol):
    """What the callbacks need of a dynamism controller (the pruner, the freezer)."""

    def prepare(self, layers: Mapping[int, nn.Module], /) -> object: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], /) -> None: ...


class _ControllerCallback(Callback, ABC):
    """The frame both callbacks share: a controller that prepares the blocks, is saved in checkpoints.

    The controller prepares the whole model's blocks at ``setup`` (before the strategy keeps each rank's
    part), and runs it (:meth:`_step`) at the first batch of every optimizer step on this rank's scope
    (:meth:`_scope`).
    """

    def __init__(self, controller: _Controller) -> None:
        self._controller = controller
        self._last_step: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        layers = getattr(pl_module, "layers", None)
        if stage == "fit" and layers is not None:  # blocks made later (configure_model) are handled later
            self._controller.prepare({int(k): m for k, m in layers.items()})

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._controller.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._controller.load_state_dict(state_dict)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # a later micro-batch of an accumulated step
        self._last_step = step
        scope = self._scope(trainer, pl_module)
        if scope is not None:
            self._step(step, scope)

    @abstractmethod
    def _scope(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        """What the controller works on now; ``None`` on a rank a re-pack released."""

    @abstractmethod
    def _step(self, step: int, scope: Any) -> None:
        """Run the controller at the first batch of optimizer step ``step``."""


class PruningCallback(_ControllerCallback):
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
        super().__init__(self.pruner)

    @property
    def history(self) -> list[PruningReport]:
        """Every pruning step run so far on this rank (restored from checkpoints)."""
        return self.pruner.history

    @override
    def _scope(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> PruningScope | None:
        return pruning_scope(trainer, pl_module)

    @override
    def _step(self, step: int, scope: PruningScope) -> None:
        self.pruner.step(step, scope)


def freezing_scope(
    trainer: pl.Trainer, pl_module: pl.LightningModule, freeze_first_parts: bool = True
) -> FreezingScope | None:
    """This rank's blocks, first parts and groups now; ``None`` on a rank a re-pack released."""
    strategy = trainer.strategy
    parts = getattr(pl_module, "pipeline_first_parts", ()) if freeze_first_parts else ()
    if isinstance(strategy, DynMoStrategy):
        view = strategy.pipeline_view()
        if view.stage_index is None:
            return None
        tied = view.has_tied_parameters  # a tied embedding keeps training through the head
        return FreezingScope(
            layers=view.local_layers,
            num_layers=view.placement.num_layers,
            first_parts=[getattr(pl_module, n) for n in parts] if view.is_first_stage and not tied else [],
            group=view.active_group,
            replicas=view.data_parallel_size,
            optimizers=trainer.optimizers,
            rebuild=strategy.rebuild_pipeline,
            device=view.root_device,
        )
    layers = {int(k): m for k, m in _blocks(pl_module, "FreezingCallback freezes").items()}
    later = {id(p) for n, m in pl_module.named_children() if n not in parts for p in m.parameters()}
    first = [getattr(pl_module, n) for n in parts]
    replicated = dist.is_available() and dist.is_initialized() and trainer.world_size > 1
    return FreezingScope(
        layers=layers,
        num_layers=len(layers),
        first_parts=[m for m in first if not any(id(p) in later for p in m.parameters())],
        group=dist.group.WORLD if replicated else None,
        replicas=trainer.world_size if replicated else 1,
        optimizers=trainer.optimizers,
        device=strategy.root_device,
    )


class FreezingCallback(_ControllerCallback):
    """Layer freezing front to back in ``fit`` (:mod:`lightning_dynmo.dynamism.freezing`).

    At ``setup`` every block (``pl_module.layers``) gets its frozen flag and gradient-norm buffers, on the
    whole model before the strategy keeps each rank's part. After each backward
    (``on_before_optimizer_step``: data-parallel gradients are averaged, not yet clipped) it adds the
    blocks' gradient norms to their interval sums; at the first batch of every optimizer step it takes
    the step's decision, which freezes a longer prefix, rebuilds the pipeline stages and publishes a
    ``frozen`` event that :class:`~lightning_dynmo.DynMoCallback` answers by profiling and rebalancing.
    At ``on_train_start`` (after a resume) the blocks' flags are applied to ``requires_grad`` again.

    Args:
        config: The freezing settings; ``None`` is ``FreezingConfig()`` (AutoFreeze every 50 steps).
        event_bus: Where the ``frozen`` events go (default: the process-wide bus).
    """

    def __init__(self, config: FreezingConfig | None = None, *, event_bus: EventBus | None = None) -> None:
        self.freezer = LayerFreezer(config, event_bus=event_bus)
        super().__init__(self.freezer)
        self._unfreeze_from: int | None = None

    @property
    def history(self) -> list[FreezingReport]:
        """Every change of the frozen prefix so far (restored from checkpoints)."""
        return self.freezer.history

    @property
    def num_frozen(self) -> int:
        """How many leading blocks are frozen."""
        return self.freezer.num_frozen

    def unfreeze_from(self, layer: int) -> None:
        """Unfreeze blocks ``layer ..`` at the start of the next step (call it on every rank)."""
        self._unfreeze_from = layer

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scope = self._scope(trainer, pl_module)
        if scope is not None and self.freezer.num_frozen > 0:  # resumed frozen: flags -> requires_grad
            self.freezer.apply_flags(scope)
            if scope.rebuild is not None:
                scope.rebuild()

    @override
    def _step(self, step: int, scope: FreezingScope) -> None:
        if self._unfreeze_from is not None:
            layer, self._unfreeze_from = self._unfreeze_from, None
            self.freezer.unfreeze_from(layer, scope, step=step)
        self.freezer.step(step, scope)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        scope = self._scope(trainer, pl_module)
        if scope is not None:
            self.freezer.record_gradients(scope)

    @override
    def _scope(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> FreezingScope | None:
        return freezing_scope(trainer, pl_module, self.freezer.config.freeze_first_parts)


def _blocks(pl_module: pl.LightningModule, what: str = "PruningCallback prunes") -> Any:
    layers = getattr(pl_module, "layers", None)
    if layers is None:
        raise TypeError(
            f"{what} the blocks of a model following DynMo's contract, but "
            f"{type(pl_module).__name__} has no `layers` (an nn.ModuleDict of blocks keyed by global index); "
            "add one (see lightning_dynmo.pipeline.model.contract)."
        )
    return layers
