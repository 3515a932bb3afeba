"""Layer freezing front to back (AutoFreeze-style or on a schedule): the controller and its settings.

Read in this order: :class:`FreezingConfig` (every knob), :class:`FreezingScope` (what the driver hands
over at each step), :class:`LayerFreezer` (what a freezing decision does), :class:`FreezingReport`.

What freezing changes. The frozen set is always a *prefix* of the blocks (layers ``0 .. k-1``): only then
does backward disappear (a frozen layer behind a trainable one still has to pass the input gradient on).
A frozen block

* carries its flag as module state: a boolean buffer ``dynmo_frozen`` registered by
  :meth:`LayerFreezer.prepare`; it migrates with the block and is saved in checkpoints, and
  :meth:`LayerFreezer.apply_flags` turns it into ``requires_grad`` again (after a resume; migration
  carries ``requires_grad`` itself);
* computes no weight gradient (``requires_grad=False`` on its parameters), so an optimizer skips it (it
  does not change, not even by weight decay) and the data-parallel gradient average and the clipping
  norm skip it (:mod:`lightning_dynmo.pipeline.step.grads` only reduce parameters that require grad);
* has its optimizer state dropped (``FreezingConfig.keep_optimizer_state=False``, the default) or kept;
* runs no backward when all layers before it are frozen too: the activation it produces needs no
  gradient, so autograd stops there, and a pipeline stage whose inputs need none sends none back, so
  a wholly frozen first stage runs no backward at all. The first parts (embeddings) freeze with layer
  0 (``freeze_first_parts``). Which inputs need a gradient is fixed when torch's pipeline stages are
  built, so every change of the frozen set rebuilds the pipeline (``FreezingScope.rebuild``), and the
  zero-bubble schedules keep weight gradients behind a frozen prefix thanks to
  :mod:`lightning_dynmo.pipeline.step.gradless`.

When to freeze. ``criterion="autofreeze"`` (Liu et al., 2021): every ``check_every`` steps, the gradient
norm of every trainable block summed over the interval is compared with the previous interval's,
``ratio = |previous - current| / previous``; the threshold is the ``percentile`` of the trainable
blocks' ratios, and the prefix grows up to the first block whose ratio reaches it (the first block
still changing). The per-block sums live in the block too (buffers ``dynmo_grad_norm`` and
``dynmo_grad_norm_previous``: they migrate and resume), and one all-reduce of ``2 x num_layers`` numbers
over every active rank gives each rank all of them, so every pipeline stage and data-parallel replica
takes the same decision. ``criterion="schedule"``: ``schedule=((step, num_frozen), ...)``. Either way
the prefix only grows (at most to ``max_frozen``) unless the user calls :meth:`LayerFreezer.unfreeze_from`.

Each change publishes ``notify_dynamism("frozen", ...)`` (``"unfrozen"`` for an explicit unfreeze), so
that :class:`~lightning_dynmo.DynMoCallback` profiles at the next step and rebalances.

Torch-only: :class:`lightning_dynmo.dynamism_callbacks.FreezingCallback` is the Lightning glue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dynmo.events import EventBus, notify_dynamism

log = logging.getLogger(__name__)

__all__ = [
    "CRITERIA",
    "FROZEN_BUFFER",
    "FreezingConfig",
    "FreezingReport",
    "FreezingScope",
    "LayerFreezer",
    "is_frozen",
]

#: ``FreezingConfig.criterion`` values.
CRITERIA = ("autofreeze", "schedule")
#: The buffer that marks a block frozen (a 0-d bool tensor).
FROZEN_BUFFER = "dynmo_frozen"
#: The buffers holding a block's gradient-norm sums of the current and the previous interval.
NORM_BUFFER = "dynmo_grad_norm"
PREVIOUS_NORM_BUFFER = "dynmo_grad_norm_previous"


@dataclass(frozen=True, kw_only=True)
class FreezingConfig:
    """Settings of :class:`LayerFreezer`.

    Attributes:
        criterion: ``"autofreeze"`` (gradient-norm change, the default) or ``"schedule"``.
        check_every: With ``"autofreeze"``: steps per interval; a decision is taken at every multiple
            of it from the second on (the first interval only gives the "previous" norms).
        percentile: With ``"autofreeze"``: the percentile (in ``(0, 100]``) of the trainable blocks'
            norm-change ratios that counts as "still changing" (AutoFreeze uses 50).
        schedule: With ``"schedule"``: ``((step, num_frozen), ...)``, steps strictly increasing and
            frozen counts strictly increasing; at ``step`` the first ``num_frozen`` blocks are frozen.
        max_frozen: Never freeze more blocks than this; ``None``: all but the last block.
        keep_optimizer_state: Keep a frozen parameter's optimizer state (Adam moments) for a later
            unfreeze; ``False`` drops it (frees the memory).
        freeze_first_parts: Freeze the first parts (the embeddings) with layer 0, so a frozen prefix runs
            no backward at all. Parts whose parameters are tied to a later part (a tied output head) are
            never frozen.
    """

    criterion: str = "autofreeze"
    check_every: int = 50
    percentile: float = 50.0
    schedule: tuple[tuple[int, int], ...] = ()
    max_frozen: int | None = None
    keep_optimizer_state: bool = False
    freeze_first_parts: bool = True

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ValueError(f"FreezingConfig.criterion={self.criterion!r} must be one of {CRITERIA}.")
        if (
            isinstance(self.check_every, bool)
            or not isinstance(self.check_every, int)
            or self.check_every < 1
        ):
            raise ValueError(
                f"FreezingConfig.check_every={self.check_every!r} must be an integer >= 1 (steps per "
                "gradient-norm interval; the paper checks every 50)."
            )
        if not 0.0 < float(self.percentile) <= 100.0:
            raise ValueError(
                f"FreezingConfig.percentile={self.percentile!r} must be in (0, 100] (AutoFreeze: 50)."
            )
        object.__setattr__(self, "schedule", tuple(tuple(entry) for entry in self.schedule))
        self._check_schedule()
        if self.max_frozen is not None and (
            isinstance(self.max_frozen, bool) or not isinstance(self.max_frozen, int) or self.max_frozen < 0
        ):
            raise ValueError(
                f"FreezingConfig.max_frozen={self.max_frozen!r} must be an integer >= 0 or None."
            )

    def _check_schedule(self) -> None:
        if self.criterion == "schedule" and not self.schedule:
            raise ValueError(
                "FreezingConfig.schedule=() is empty but criterion='schedule'; give ((step, num_frozen), "
                "...), e.g. ((20, 2), (40, 4)), or use criterion='autofreeze'."
            )
        previous = (-1, 0)
        for entry in self.schedule:
            ok = len(entry) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
            if not ok or entry[0] <= previous[0] or entry[1] <= previous[1]:
                raise ValueError(
                    f"FreezingConfig.schedule={self.schedule!r}: entry {entry!r} must be a pair (step >= 0, "
                    "num_frozen >= 1) of integers with steps and frozen counts both strictly increasing, "
                    "e.g. ((20, 2), (40, 4))."
                )
            previous = (entry[0], entry[1])

    def target_at(self, step: int) -> int | None:
        """The scheduled frozen count at ``step`` (``None``: the schedule says nothing there)."""
        return dict(self.schedule).get(step)


@dataclass(frozen=True)
class FreezingScope:
    """What one rank freezes and with whom it agrees, at one step.

    Attributes:
        layers: This rank's blocks by global index (all of them in a single process).
        num_layers: The model's number of blocks.
        first_parts: The first parts this rank holds (the embeddings, on the first stage only) that may
            freeze with layer 0: none tied to a later part.
        group: Every rank whose gradient-norm statistics combine (all active ranks: pipeline stages and
            data-parallel replicas); ``None``: this process alone.
        replicas: How many data-parallel replicas ``group`` holds (their sums are averaged).
        optimizers: This rank's optimizers (frozen parameters' state is dropped from them).
        rebuild: Called after the frozen set changed (rebuilds the pipeline stages), or ``None``.
        device: Where collectives' tensors live (``cuda`` under NCCL).
    """

    layers: Mapping[int, nn.Module]
    num_layers: int
    first_parts: Sequence[nn.Module] = ()
    group: dist.ProcessGroup | None = None
    replicas: int = 1
    optimizers: Sequence[torch.optim.Optimizer] = ()
    rebuild: Callable[[], None] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True)
class FreezingReport:
    """One change of the frozen prefix (the same on every rank).

    Attributes:
        step: The optimizer step it took effect at (``None``: called outside training).
        num_frozen: Frozen blocks after the change (blocks ``0 .. num_frozen - 1``).
        previous: Frozen blocks before it.
        reason: ``"autofreeze"``, ``"schedule"``, ``"explicit"`` or ``"unfreeze"``.
        ratios: With ``"autofreeze"``: every block's gradient-norm change ratio (``None`` for frozen ones).
        threshold: With ``"autofreeze"``: the percentile threshold the ratios were compared with.
    """

    step: int | None
    num_frozen: int
    previous: int
    reason: str
    ratios: tuple[float | None, ...] = ()
    threshold: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for callback checkpoints and logs)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FreezingReport:
        """Rebuild a report saved with :meth:`to_dict`."""
        return cls(**{**data, "ratios": tuple(data["ratios"])})


def is_frozen(block: nn.Module) -> bool:
    """Whether ``block`` carries a true ``dynmo_frozen`` flag."""
    flag = getattr(block, FROZEN_BUFFER, None)
    return isinstance(flag, Tensor) and bool(flag)


class LayerFreezer:
    """Freezes a (possibly pipelined) model's blocks front to back.

    Call :meth:`prepare` once on the whole model's blocks before the strategy splits it, then on every
    rank :meth:`record_gradients` after each backward (before the optimizer step) and :meth:`step` at
    the start of each optimizer step.

    Args:
        config: The settings; ``None`` is ``FreezingConfig()``.
        event_bus: Where ``frozen`` events go (default: the process-wide bus DynMoCallback listens to).
    """

    def __init__(self, config: FreezingConfig | None = None, *, event_bus: EventBus | None = None) -> None:
        self.config = config if config is not None else FreezingConfig()
        self.num_frozen = 0
        self.history: list[FreezingReport] = []
        self._bus = event_bus

    # -- module state ----------------------------------------------------------------------------

    @staticmethod
    def prepare(layers: Mapping[int, nn.Module]) -> None:
        """Register the frozen flag and gradient-norm buffers on every block (idempotent, no randomness)."""
        for block in layers.values():
            if not hasattr(block, FROZEN_BUFFER):
                block.register_buffer(FROZEN_BUFFER, torch.zeros((), dtype=torch.bool))
            for name in (NORM_BUFFER, PREVIOUS_NORM_BUFFER):
                if not hasattr(block, name):
                    block.register_buffer(name, torch.zeros((), dtype=torch.float64))

    def apply_flags(self, scope: FreezingScope) -> None:
        """Set ``requires_grad`` of this rank's blocks (and first parts) from their frozen flags."""
        self.prepare(scope.layers)
        for block in scope.layers.values():
            _set_trainable(block, not is_frozen(block))
        if self.config.freeze_first_parts:
            for part in scope.first_parts:
                _set_trainable(part, self.num_frozen == 0)

    def record_gradients(self, scope: FreezingScope) -> None:
        """Add each trainable block's gradient norm of this step to its interval sum (no communication)."""
        if self.config.criterion != "autofreeze":
            return
        self.prepare(scope.layers)
        for block in scope.layers.values():
            if is_frozen(block):
                continue
            grads = [p.grad for p in block.parameters() if p.grad is not None]
            if grads:
                norm = torch.nn.utils.get_total_norm(grads).to(torch.float64)
                getattr(block, NORM_BUFFER).add_(norm.to(getattr(block, NORM_BUFFER).device))

    # -- decisions -------------------------------------------------------------------------------

    def step(self, step: int, scope: FreezingScope) -> FreezingReport | None:
        """Take this step's decision, if any (collective over ``scope.group`` at autofreeze checks)."""
        self._check_num_layers(scope)
        if self.config.criterion == "schedule":
            target = self.config.target_at(step)
            if target is None:
                return None
            if target > scope.num_layers:
                raise ValueError(
                    f"FreezingConfig.schedule freezes {target} blocks at step {step} but the model has "
                    f"{scope.num_layers}; the largest frozen count is {scope.num_layers}."
                )
            return self._freeze_to(target, scope, step=step, reason="schedule")
        if step == 0 or step % self.config.check_every != 0:
            return None
        return self._autofreeze(step, scope)

    def freeze_through(
        self, layer: int, scope: FreezingScope, *, step: int | None = None
    ) -> FreezingReport | None:
        """Freeze blocks ``0 .. layer`` now (every rank calls it at the same step boundary)."""
        self._check_layer(layer, scope, "freeze_through")
        return self._freeze_to(layer + 1, scope, step=step, reason="explicit", cap=False)

    def unfreeze_from(
        self, layer: int, scope: FreezingScope, *, step: int | None = None
    ) -> FreezingReport | None:
        """Unfreeze blocks ``layer ..`` now, the only way the prefix shrinks (every rank, same boundary)."""
        self._check_layer(layer, scope, "unfreeze_from")
        if layer >= self.num_frozen:
            return None
        return self._change(layer, scope, step=step, reason="unfreeze")

    def state_dict(self) -> dict[str, Any]:
        """The frozen count and the history (flags and norm sums live in the blocks)."""
        return {"num_frozen": self.num_frozen, "history": [r.to_dict() for r in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.num_frozen = int(state["num_frozen"])
        self.history = [FreezingReport.from_dict(r) for r in state["history"]]

    # -- the parts of a decision -----------------------------------------------------------------

    def _autofreeze(self, step: int, scope: FreezingScope) -> FreezingReport | None:
        current, previous = self._gather_norms(scope)
        for block in scope.layers.values():  # this interval becomes the previous one
            getattr(block, PREVIOUS_NORM_BUFFER).copy_(getattr(block, NORM_BUFFER))
            getattr(block, NORM_BUFFER).zero_()
        trainable = range(self.num_frozen, scope.num_layers)
        if step < 2 * self.config.check_every or len(trainable) < 2:
            return None  # the first interval only gives the previous norms
        ratios = [_change_ratio(float(previous[i]), float(current[i])) for i in trainable]
        threshold = float(
            torch.quantile(torch.tensor(ratios, dtype=torch.float64), self.config.percentile / 100)
        )
        changing = next(i for i, r in zip(trainable, ratios, strict=True) if r >= threshold)
        all_ratios: tuple[float | None, ...] = (None,) * self.num_frozen + tuple(ratios)
        return self._freeze_to(
            changing, scope, step=step, reason="autofreeze", ratios=all_ratios, threshold=threshold
        )

    def _gather_norms(self, scope: FreezingScope) -> tuple[Tensor, Tensor]:
        """Every block's (current, previous) interval sums, the same on every rank: one all-reduce."""
        table = torch.zeros(2, scope.num_layers, dtype=torch.float64, device=scope.device)
        for index, block in scope.layers.items():
            table[0, index] = getattr(block, NORM_BUFFER)
            table[1, index] = getattr(block, PREVIOUS_NORM_BUFFER)
        if scope.group is not None:
            dist.all_reduce(table, group=scope.group)
            table /= scope.replicas
        return table[0].cpu(), table[1].cpu()

    def _freeze_to(
        self,
        count: int,
        scope: FreezingScope,
        *,
        step: int | None,
        reason: str,
        cap: bool = True,
        ratios: tuple[float | None, ...] = (),
        threshold: float | None = None,
    ) -> FreezingReport | None:
        limit = scope.num_layers - 1 if self.config.max_frozen is None else self.config.max_frozen
        target = min(count, limit) if cap else count
        if target <= self.num_frozen:
            return None  # the prefix never shrinks on its own
        return self._change(target, scope, step=step, reason=reason, ratios=ratios, threshold=threshold)

    def _change(
        self,
        target: int,
        scope: FreezingScope,
        *,
        step: int | None,
        reason: str,
        ratios: tuple[float | None, ...] = (),
        threshold: float | None = None,
    ) -> FreezingReport:
        previous = self.num_frozen
        self.prepare(scope.layers)
        for index, block in scope.layers.items():
            getattr(block, FROZEN_BUFFER).fill_(index < target)
            if index < target:
                getattr(block, NORM_BUFFER).zero_()
                getattr(block, PREVIOUS_NORM_BUFFER).zero_()
        self.num_frozen = target
        self.apply_flags(scope)
        if not self.config.keep_optimizer_state:
            self._drop_optimizer_state(scope)
        if scope.rebuild is not None:
            scope.rebuild()
        report = FreezingReport(step, target, previous, reason, ratios, threshold)
        self.history.append(report)
        changed = range(min(previous, target), max(previous, target))
        local = tuple(i for i in changed if i in scope.layers)
        kind = "unfrozen" if target < previous else "frozen"
        log.info("freezing at step %s (%s): %d -> %d frozen blocks", step, reason, previous, target)
        if local:
            notify_dynamism(
                kind, layers=local, step=step, detail=f"{target} frozen ({reason})", bus=self._bus
            )
        return report

    def _drop_optimizer_state(self, scope: FreezingScope) -> None:
        frozen = [p for block in scope.layers.values() if is_frozen(block) for p in block.parameters()]
        frozen += [p for part in scope.first_parts for p in part.parameters() if not p.requires_grad]
        for optimizer in scope.optimizers:
            for param in frozen:
                optimizer.state.pop(param, None)

    def _check_num_layers(self, scope: FreezingScope) -> None:
        limit = self.config.max_frozen
        if limit is not None and limit > scope.num_layers:
            raise ValueError(
                f"FreezingConfig.max_frozen={limit} exceeds the model's {scope.num_layers} blocks; use at "
                f"most {scope.num_layers} (or None: all but the last block)."
            )

    @staticmethod
    def _check_layer(layer: int, scope: FreezingScope, call: str) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < scope.num_layers:
            raise ValueError(
                f"{call}(layer={layer!r}): the model has blocks 0 .. {scope.num_layers - 1}; give the global "
                "index of one of them."
            )


def _change_ratio(previous: float, current: float) -> float:
    """AutoFreeze's ``|previous - current| / previous`` (0 for a block without gradients in both)."""
    if previous == 0.0:
        return 0.0 if current == 0.0 else float("inf")
    return abs(previous - current) / previous


def _set_trainable(module: nn.Module, trainable: bool) -> None:
    for param in module.parameters():
        param.requires_grad_(trainable)
