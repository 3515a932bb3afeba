"""Gradual global magnitude pruning of trained weights (Zhu & Gupta schedule); per layer, density per stage.

Every linear weight of every block is prunable (q, k, v, o, gate, up, down; the tied embedding and the
norms are not). Between pruning steps the model keeps training with the masks reapplied after every
optimizer step (pruned weights stay zero), as in Zhu & Gupta and the DynMo paper's pruning runs. The
threshold is one global magnitude over all blocks (:func:`select_global_pruning`), the schedule is
:class:`PruningSchedule` with its defaults' shape (4 intervals to 90%: 0, 52, 79, 89, 90%).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from benchmarks._lib.trained.common import CaseRun
from benchmarks._lib.trained.text import token_batches
from benchmarks._lib.trained.traces import Trace, TraceRow
from benchmarks._lib.trained.training import PRETRAINED_LR, adamw, decoder_layers, lm_step
from lightning_dynmo.dynamism.magnitude_select import PrunableWeight, select_global_pruning
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule

__all__ = ["prunable_linears", "record", "wholly_zero"]


def prunable_linears(model: nn.Module) -> list[tuple[int, str, nn.Linear]]:
    """``(layer, name, linear)`` for every linear of every block, in layer then module order."""
    found = []
    for index, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                found.append((index, f"layers.{index}.{name}", module))
    return found


def wholly_zero(masks: dict[str, Tensor]) -> list[str]:
    """Names of the weights whose mask keeps nothing (a dead matrix)."""
    return [name for name, mask in masks.items() if not bool(mask.any())]


def _prune(model: nn.Module, masks: dict[str, Tensor], sparsity: float) -> list[float]:
    linears = prunable_linears(model)
    weights = [PrunableWeight(i, n, m.weight, masks[n]) for i, n, m in linears]
    num_layers = len(decoder_layers(model))
    selection = select_global_pruning(weights, sparsity, num_layers=num_layers, group=None)
    for (_, name, module), mask in zip(linears, selection.masks, strict=True):
        masks[name] = mask
        with torch.no_grad():
            module.weight.mul_(mask)
    return [1.0 - selection.layer_sparsity(i) for i in range(num_layers)]


def _reapply(model: nn.Module, masks: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for _, name, module in prunable_linears(model):
            module.weight.mul_(masks[name])


def record(run: CaseRun) -> Trace:
    """Train, prune on the schedule, and record each layer's density after every pruning step."""
    schedule = (
        PruningSchedule(final_sparsity=0.9, start_step=0, frequency=1, num_steps=2)
        if run.quick
        else PruningSchedule(final_sparsity=0.9, start_step=4, frequency=6, num_steps=4)
    )
    batch, seq = (2, 32) if run.quick else (2, 128)
    model = run.pretrained.model
    masks = {name: torch.ones_like(m.weight, dtype=torch.bool) for _, name, m in prunable_linears(model)}
    optimizer = adamw(model)
    trace = run.trace(
        "pruning",
        "density of the block's linear weights after the pruning step",
        "fraction of prunable weights kept",
        f"continued training, AdamW lr {PRETRAINED_LR}, batch {batch} x seq {seq}; global magnitude pruning "
        f"on the Zhu & Gupta schedule (final {schedule.final_sparsity}, steps {list(schedule.steps)}, levels "
        f"{[round(schedule.level(j), 4) for j in range(schedule.num_steps + 1)]}), masks reapplied after "
        "every optimizer step",
    )
    batches = token_batches(run.encode, batch_size=batch, seq_len=seq, num_batches=schedule.end_step + 1)
    for step, tokens in enumerate(batches):
        target = schedule.target_at(step)
        if target is not None:
            density = _prune(model, masks, target)
            dead = wholly_zero(masks)
            loss = float(model(input_ids=tokens, labels=tokens).loss.detach())
            extra = {
                "sparsity": round(target, 4),
                "loss_after_pruning": round(loss, 4),
                "dead_matrices": dead,
            }
            trace.add(TraceRow(step, density, extra))
        if step < schedule.end_step:
            lm_step(model, tokens, optimizer, before_step=None)
            _reapply(model, masks)
    return trace
