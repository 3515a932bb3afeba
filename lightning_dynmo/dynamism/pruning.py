"""Gradual global magnitude pruning with sparse execution: the controller, its settings, a ready model.

Read in this order: :class:`PruningConfig` (every knob), :class:`PruningScope` (what the driver hands
over at each step: this rank's layers and the process groups), :class:`GlobalMagnitudePruner` (what a
pruning step does), :class:`PruningReport`, then :func:`pruning_gpt_config` (the ready configuration).

A pruning step (at each step of the :class:`~lightning_dynmo.dynamism.pruning_schedule.PruningSchedule`):

1. **Select** one global magnitude threshold over every prunable weight of the model, on all pipeline
   stages at once, without gathering weights
   (:func:`~lightning_dynmo.dynamism.magnitude_select.select_global_pruning`: exact, ties broken in
   global order). What is ranked depends on ``PruningConfig.pattern``
   (:mod:`~lightning_dynmo.dynamism.pruning_patterns`: entries, entries that keep a 2:4 layout, or
   square blocks); the selection and its threshold are the same exact, distributed computation in
   every pattern, and no kernel choice changes them. Prunable weights are the matrices of every
   ``nn.Linear`` inside the blocks
   (``layers.<i>``: attention ``qkv`` / ``proj`` and MLP ``fc_in`` / ``fc_out`` of a dense GPT block);
   embeddings, the head, norms and biases are not pruned.
2. **Apply** the masks: each such Linear is a :class:`~lightning_dynmo.dynamism.sparse_linear.MaskedLinear`
   (converted in place by :meth:`GlobalMagnitudePruner.prepare`), whose mask buffer is applied in forward
   and whose pruned weights are set to exactly zero. The optimizer state of the pruned entries is zeroed
   too: with AdamW, a pruned weight then has a zero gradient (the mask is in forward), zero moments (so
   the update ``m / (sqrt(v) + eps)`` is 0) and decays from 0 to 0; without zeroing the moments, the
   first moment left from before pruning would keep moving the "pruned" weight for many steps
   (tested both ways). Pruning is monotone: a pruned weight is never revived.
3. **Choose kernels**: every layer whose mask changed measures its forward + backward on the dense and
   on the pattern's sparse kernel (CSR for unstructured masks, BSR for blocks, 2:4 semi-structured on
   CUDA for 2:4) at its own shape and sparsity on this device
   (:func:`~lightning_dynmo.dynamism.sparse_linear.time_kernels`), data-parallel replicas add up their
   timings so they choose alike, and the sparse kernel is kept where it is ``csr_min_speedup`` times
   faster.
   The choice lives in the module (it migrates and is checkpointed) and is logged per layer.
4. **Tell** the balancer: ``notify_dynamism("pruned", layers=<this rank's changed layers>)``, so that
   :class:`~lightning_dynmo.DynMoCallback` profiles at the next step and rebalances (the paper's
   Algorithm 1).

Torch-only: a Lightning callback (:class:`lightning_dynmo.dynamism_callbacks.PruningCallback`) calls
:meth:`GlobalMagnitudePruner.step` at the start of every optimizer step with a :class:`PruningScope`
built from the Trainer's strategy; anything else holding the model and its groups can do the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.balancing.fields import check_fields, int_field
from lightning_dynmo.dynamism.magnitude_select import PrunableWeight, select_global_pruning
from lightning_dynmo.dynamism.pruning_patterns import (
    PATTERNS,
    check_pattern_shape,
    expand_unit_mask,
    pattern_scores,
)
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_linear import KERNELS, MaskedLinear, time_kernels
from lightning_dynmo.events import EventBus, notify_dynamism
from lightning_dynmo.models.config import GPTConfig

log = logging.getLogger(__name__)

__all__ = [
    "KERNEL_POLICIES",
    "GlobalMagnitudePruner",
    "LayerKernel",
    "PruningConfig",
    "PruningReport",
    "PruningScope",
    "prunable_linears",
    "pruning_gpt_config",
]

#: ``PruningConfig.kernel`` values: measure and choose, or force one kernel on every pruned layer.
KERNEL_POLICIES = ("auto", *KERNELS)
#: The sparse kernel each pattern's masks can run (``"auto"`` measures it against dense).
PATTERN_KERNELS = {"unstructured": "csr", "2:4": "semi_structured", "block": "bsr"}
#: Input rows the kernels are timed at when a layer has not run a forward yet.
DEFAULT_TIMING_ROWS = 512


@dataclass(frozen=True, kw_only=True)
class PruningConfig:
    """Settings of :class:`GlobalMagnitudePruner`.

    Attributes:
        schedule: When to prune and to which global sparsity (Zhu & Gupta's cubic schedule).
        kernel: ``"auto"`` (measure dense vs the pattern's sparse kernel per pruned layer, keep the
            faster), ``"dense"`` (masked dense everywhere), or one sparse kernel on every pruned layer:
            ``"csr"`` (any pattern), ``"bsr"`` (``pattern="block"``) or ``"semi_structured"``
            (``pattern="2:4"``; CUDA float16/bfloat16 weights).
        csr_min_sparsity: With ``"auto"``, layers less sparse than this stay dense without being
            measured (sparse kernels only pay at high sparsity).
        csr_min_speedup: With ``"auto"``, the sparse kernel is chosen when ``dense time / sparse time``
            is at least this (above 1: a margin against noise, so a layer does not flip on a tie).
        timing_repeats: Timed forward + backward passes per kernel and layer (the fastest counts).
        timing_rows: Input rows (tokens) to time the kernels at; ``None``: the rows of the layer's last
            forward (one micro-batch), or ``DEFAULT_TIMING_ROWS`` before its first.
        pattern: What is pruned together (:mod:`~lightning_dynmo.dynamism.pruning_patterns`):
            ``"unstructured"`` (single entries; mask-only on a GPU, where no kernel pays at these
            sizes), ``"2:4"`` (at most 2 of every 4 consecutive inputs, the layout of the 2:4
            semi-structured GPU kernels; ``final_sparsity`` at most 0.5) or ``"block"`` (square
            blocks of ``block_size``, the layout of the BSR kernels).
        block_size: The block side for ``pattern="block"``; it must divide every prunable weight's
            sizes.
    """

    schedule: PruningSchedule = field(default_factory=PruningSchedule)
    kernel: str = "auto"
    csr_min_sparsity: float = 0.5
    csr_min_speedup: float = 1.1
    timing_repeats: int = int_field(5, minimum=1)
    timing_rows: int | None = int_field(None, minimum=1, optional=True)
    pattern: str = "unstructured"
    block_size: int = int_field(32, minimum=1, hint="the side of the pruned blocks, e.g. 32 or 64")

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, PruningSchedule):
            raise TypeError(
                f"PruningConfig.schedule={self.schedule!r} must be a PruningSchedule, e.g. "
                "PruningSchedule(final_sparsity=0.9, start_step=30, frequency=10, num_steps=4)."
            )
        if self.kernel not in KERNEL_POLICIES:
            raise ValueError(f"PruningConfig.kernel={self.kernel!r} must be one of {KERNEL_POLICIES}.")
        if self.pattern not in PATTERNS:
            raise ValueError(f"PruningConfig.pattern={self.pattern!r} must be one of {PATTERNS}.")
        needs = {"bsr": "block", "semi_structured": "2:4"}.get(self.kernel)
        if needs is not None and self.pattern != needs:
            raise ValueError(
                f"PruningConfig.kernel={self.kernel!r} multiplies {needs!r} masks only, but pattern="
                f"{self.pattern!r}. Set pattern={needs!r}, or kernel='auto' (the pattern's own kernel)."
            )
        if self.pattern == "2:4" and self.schedule.final_sparsity > 0.5:
            raise ValueError(
                f"PruningConfig.pattern='2:4' prunes at most 2 of every 4 weights, but the schedule's "
                f"final_sparsity={self.schedule.final_sparsity}. Use final_sparsity <= 0.5 (0.5 is the "
                "full 2:4 pattern), or pattern='block' / 'unstructured' for higher sparsity."
            )
        if not 0.0 <= self.csr_min_sparsity <= 1.0:
            raise ValueError(f"PruningConfig.csr_min_sparsity={self.csr_min_sparsity} must be in [0, 1].")
        if not self.csr_min_speedup > 0:
            raise ValueError(
                f"PruningConfig.csr_min_speedup={self.csr_min_speedup} must be > 0 (1.1: CSR must be 10% "
                "faster than dense to be chosen)."
            )
        check_fields(self)


@dataclass(frozen=True)
class PruningScope:
    """What one rank prunes and with whom it agrees, at one step.

    Attributes:
        layers: This rank's blocks by global index (a pipeline rank's local layers; all of them in a
            single process).
        num_layers: The model's number of blocks.
        pipeline_group: The ranks that together hold every block once (the strategy's pipeline group):
            the threshold is global over it. ``None``: this process holds every block.
        data_parallel_group: The replicas of this rank's blocks (they agree on kernel choices), or ``None``.
        optimizers: This rank's optimizers (the pruned entries' state is zeroed).
        device: Where collectives' tensors live (``cuda`` under NCCL).
    """

    layers: Mapping[int, nn.Module]
    num_layers: int
    pipeline_group: dist.ProcessGroup | None = None
    data_parallel_group: dist.ProcessGroup | None = None
    optimizers: Sequence[torch.optim.Optimizer] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True)
class LayerKernel:
    """The kernel chosen for one pruned Linear of this rank.

    Attributes:
        name: Its global name, e.g. ``"layers.3.mlp.fc_in"``.
        layer: Its layer's global index.
        sparsity: Its own sparsity after the step.
        kernel: One of :data:`~lightning_dynmo.dynamism.sparse_linear.KERNELS`.
        dense_s: Measured seconds of forward + backward on the dense kernel (``None``: not measured).
        csr_s: The same on the pattern's sparse kernel (CSR, BSR or semi-structured; the name is kept
            for saved reports).
    """

    name: str
    layer: int
    sparsity: float
    kernel: str
    dense_s: float | None = None
    csr_s: float | None = None


@dataclass(frozen=True)
class PruningReport:
    """One pruning step, as seen by one rank (global figures are the same on every rank).

    Attributes:
        step: The optimizer step it ran at (``None`` when called outside a schedule).
        target_sparsity: The schedule's sparsity for the step.
        sparsity: The global sparsity reached (``num_pruned / num_prunable``).
        num_pruned: Pruned entries of the whole model.
        num_prunable: Prunable entries of the whole model.
        threshold: The largest magnitude pruned at this step (``None``: nothing new was pruned).
        layer_sparsity: Every block's sparsity, by global index.
        changed_layers: This rank's blocks whose mask changed.
        kernels: The kernel chosen for each Linear of ``changed_layers``.
        seconds: Wall time of the step on this rank (selection, masks, kernel timing).
    """

    step: int | None
    target_sparsity: float
    sparsity: float
    num_pruned: int
    num_prunable: int
    threshold: float | None
    layer_sparsity: tuple[float, ...]
    changed_layers: tuple[int, ...]
    kernels: tuple[LayerKernel, ...]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for callback checkpoints and logs)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PruningReport:
        """Rebuild a report saved with :meth:`to_dict`."""
        fields = dict(data)
        fields["layer_sparsity"] = tuple(fields["layer_sparsity"])
        fields["changed_layers"] = tuple(fields["changed_layers"])
        fields["kernels"] = tuple(LayerKernel(**k) for k in fields["kernels"])
        return cls(**fields)


def prunable_linears(layers: Mapping[int, nn.Module]) -> list[tuple[int, str, MaskedLinear]]:
    """``(layer index, global name, module)`` of every MaskedLinear in ``layers``, in global order."""
    found = []
    for index in sorted(layers):
        for name, module in layers[index].named_modules():
            if isinstance(module, MaskedLinear):
                found.append((index, f"layers.{index}.{name}", module))
    return found


class GlobalMagnitudePruner:
    """Prunes a (possibly pipelined) model by one global magnitude threshold on a cubic schedule.

    Call :meth:`prepare` once on the model's blocks before training (before the optimizer exists is
    not required), then :meth:`step` at the start of every optimizer step on every rank.

    Args:
        config: The settings; ``None`` is ``PruningConfig()``.
        event_bus: Where ``pruned`` events go (default: the process-wide bus DynMoCallback listens to).
        clock: Seconds from an arbitrary origin (for kernel timing and the report's ``seconds``).
    """

    def __init__(
        self,
        config: PruningConfig | None = None,
        *,
        event_bus: EventBus | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config if config is not None else PruningConfig()
        self.history: list[PruningReport] = []
        self._bus = event_bus
        self._clock = clock

    @staticmethod
    def prepare(layers: Mapping[int, nn.Module]) -> int:
        """Turn every plain ``nn.Linear`` inside ``layers`` into a :class:`MaskedLinear`, in place.

        Idempotent; draws no random numbers and keeps every parameter object, so it may run before or
        after the optimizer is built, on any subset of the blocks.

        Returns:
            How many Linear layers were converted now.
        """
        converted = 0
        for block in layers.values():
            for module in block.modules():
                if type(module) is nn.Linear:
                    MaskedLinear.convert_(module)
                    converted += 1
        return converted

    def step(self, step: int, scope: PruningScope) -> PruningReport | None:
        """Prune if ``step`` is a step of the schedule; collective over the scope's groups.

        Returns:
            The report of the pruning step, or ``None`` when ``step`` is not a pruning step.
        """
        target = self.config.schedule.target_at(step)
        if target is None:
            return None
        return self.prune_to(target, scope, step=step)

    def prune_to(self, sparsity: float, scope: PruningScope, *, step: int | None = None) -> PruningReport:
        """Prune the model to the global ``sparsity`` now (every rank of the scope's groups calls it).

        Raises:
            ValueError: ``sparsity`` outside ``[0, 1)`` or non-finite weights (from the selection).
        """
        start = self._clock()
        self.prepare(scope.layers)
        linears = prunable_linears(scope.layers)
        pattern, block = self.config.pattern, self.config.block_size
        weights = []
        for index, name, module in linears:
            check_pattern_shape(f"{name}.weight", tuple(module.weight.shape), pattern, block)
            scores, kept = pattern_scores(module.weight, module.weight_mask, pattern, block)
            weights.append(PrunableWeight(index, f"{name}.weight", scores, kept))
        selection = select_global_pruning(
            weights,
            sparsity,
            num_layers=scope.num_layers,
            group=scope.pipeline_group,
            device=scope.device,
        )
        masks = [expand_unit_mask(m, pattern, block) for m in selection.masks]
        changed = self._apply_masks(linears, masks, scope.optimizers)
        kernels = self._choose_kernels(changed, scope)
        changed_layers = tuple(sorted({index for index, _, _ in changed}))
        report = PruningReport(
            step=step,
            target_sparsity=float(sparsity),
            sparsity=selection.sparsity,
            num_pruned=selection.num_pruned,
            num_prunable=selection.num_prunable,
            threshold=selection.threshold,
            layer_sparsity=tuple(selection.layer_sparsity(i) for i in range(scope.num_layers)),
            changed_layers=changed_layers,
            kernels=tuple(kernels),
            seconds=self._clock() - start,
        )
        self.history.append(report)
        self._log(report)
        if changed_layers:
            detail = f"global sparsity {report.sparsity:.4f} (target {sparsity:.4f})"
            notify_dynamism("pruned", layers=changed_layers, step=step, detail=detail, bus=self._bus)
        return report

    def state_dict(self) -> dict[str, Any]:
        """The history of pruning steps (masks and kernels live in the model's own state)."""
        return {"history": [r.to_dict() for r in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.history = [PruningReport.from_dict(r) for r in state["history"]]

    # -- the parts of a step ---------------------------------------------------------------------

    def _apply_masks(
        self,
        linears: list[tuple[int, str, MaskedLinear]],
        masks: Sequence[torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> list[tuple[int, str, MaskedLinear]]:
        """Install the new masks (zeroing weights and their optimizer state); the Linears that changed."""
        changed = []
        for entry, mask in zip(linears, masks, strict=True):
            module = entry[2]
            if bool((mask != module.weight_mask).any()):
                module.set_mask(mask)
                self._zero_optimizer_state(module, optimizers)
                changed.append(entry)
        return changed

    def _zero_optimizer_state(
        self, module: MaskedLinear, optimizers: Sequence[torch.optim.Optimizer]
    ) -> None:
        """Zero the pruned entries of every per-entry state tensor of the weight (Adam moments, momentum)."""
        for optimizer in optimizers:
            state = optimizer.state.get(module.weight)
            for value in (state or {}).values():
                if isinstance(value, torch.Tensor) and value.shape == module.weight.shape:
                    value.mul_(module.weight_mask)

    def _choose_kernels(
        self, linears: list[tuple[int, str, MaskedLinear]], scope: PruningScope
    ) -> list[LayerKernel]:
        policy = self.config.kernel
        sparse = PATTERN_KERNELS[self.config.pattern]
        for module in (m for _, _, m in linears):
            module.bsr_block = self.config.block_size if self.config.pattern == "block" else 0
        if policy != "auto":
            for _, name, module in linears:
                if not module.supports(policy):
                    raise ValueError(
                        f"PruningConfig.kernel={policy!r} cannot run {name} ({module.weight.dtype} on "
                        f"{module.weight.device.type}); see MaskedLinear.supports. Use kernel='auto', which "
                        "measures the kernels that run here."
                    )
        timed = [
            (i, n, m)
            for i, n, m in linears
            if policy == "auto"
            and m.supports(sparse)
            and m.sparsity >= self.config.csr_min_sparsity
            and m.sparsity > 0
        ]
        times = self._time(timed, scope, sparse)
        chosen = []
        for index, name, module in linears:
            dense_s = csr_s = None
            if policy != "auto":
                kernel = policy
            elif name in times:
                dense_s, csr_s = times[name]
                kernel = sparse if dense_s >= self.config.csr_min_speedup * csr_s else "dense"
            else:
                kernel = "dense"
            module.set_kernel(kernel)
            chosen.append(LayerKernel(name, index, module.sparsity, kernel, dense_s, csr_s))
        return chosen

    def _time(
        self, linears: list[tuple[int, str, MaskedLinear]], scope: PruningScope, sparse: str
    ) -> dict[str, tuple[float, float]]:
        """Measured (dense, sparse kernel) seconds per Linear, summed over the data-parallel replicas."""
        if not linears:
            return {}
        rows = []
        for _, _, module in linears:
            rows_in = self._timing_rows(module)
            measured = time_kernels(
                module, rows_in, repeats=self.config.timing_repeats, clock=self._clock, sparse_kernel=sparse
            )
            rows.append([measured["dense"], measured[sparse]])
        table = torch.tensor(rows, dtype=torch.float64, device=scope.device)
        if scope.data_parallel_group is not None:
            dist.all_reduce(table, group=scope.data_parallel_group)
        return {n: (float(d), float(c)) for (_, n, _), (d, c) in zip(linears, table.tolist(), strict=True)}

    def _timing_rows(self, module: MaskedLinear) -> int:
        if self.config.timing_rows is not None:
            return self.config.timing_rows
        return module.rows_seen or DEFAULT_TIMING_ROWS

    def _log(self, report: PruningReport) -> None:
        log.info(
            "pruning at step %s: global sparsity %.4f (target %.4f, %d of %d weights), threshold %s",
            report.step,
            report.sparsity,
            report.target_sparsity,
            report.num_pruned,
            report.num_prunable,
            "-" if report.threshold is None else f"{report.threshold:.4g}",
        )
        for layer in report.changed_layers:
            parts = [_describe(k) for k in report.kernels if k.layer == layer]
            log.info("  layer %d: sparsity %.4f; %s", layer, report.layer_sparsity[layer], ", ".join(parts))


def _describe(kernel: LayerKernel) -> str:
    short = kernel.name.split(".", 2)[-1]
    timing = ""
    if kernel.dense_s is not None and kernel.csr_s is not None:
        timing = f" (dense {1e3 * kernel.dense_s:.3g} ms, sparse {1e3 * kernel.csr_s:.3g} ms)"
    return f"{short} {kernel.sparsity:.3f} -> {kernel.kernel}{timing}"


def pruning_gpt_config(*, num_layers: int = 8, d_model: int = 256, **gpt: Any) -> GPTConfig:
    """The ready GPT for gradual pruning: dense GPT-2 blocks over the byte vocabulary.

    Train it with ``PruningCallback(PruningConfig())`` (90% global sparsity from step 30 to 70, every 10
    steps, the paper's schedule) and ``DynMoCallback(balancer="partition", cost="time")``, which
    rebalances on the ``pruned`` events. ``d_model=256`` makes the MLP matrices ``256 x 1024``, where a
    CSR kernel has a chance against dense at high sparsity; smaller widths stay dense on most CPUs.

    Args:
        num_layers: Blocks in all.
        d_model: Hidden width.
        **gpt: Any other :class:`~lightning_dynmo.models.GPTConfig` field (``seq_len``, ``num_heads``, ...).

    Raises:
        ValueError: a bad value (from :class:`~lightning_dynmo.models.GPTConfig`).
    """
    return GPTConfig(num_layers=num_layers, d_model=d_model, blocks="dense", **gpt)
