"""AutoFreeze on the pretrained model under continued training; per layer and step, whether it trains.

:class:`LayerFreezer` (the project's controller, criterion ``"autofreeze"``: the gradient-norm change
ratio of each trainable block over an interval, frozen front to back up to the first block at or above
the percentile) drives the Llama blocks directly. The statistic that sets a block's cost is whether it
still needs a backward: 1 trainable, 0 frozen. The interval is shorter than AutoFreeze's (the CPU
allows tens of steps, not thousands); the gradient-norm ratios of every decision are stored in the rows.
"""

from __future__ import annotations

from benchmarks._lib.trained.common import CaseRun
from benchmarks._lib.trained.text import token_batches
from benchmarks._lib.trained.traces import Trace, TraceRow
from benchmarks._lib.trained.training import PRETRAINED_LR, adamw, decoder_layers, lm_step
from lightning_dynmo.dynamism.freezing import FreezingConfig, FreezingScope, LayerFreezer, is_frozen

__all__ = ["record"]


def record(run: CaseRun) -> Trace:
    """Train with AutoFreeze deciding every ``check_every`` steps; per step, each block's trainable flag."""
    steps, check_every, batch, seq = (3, 1, 2, 32) if run.quick else (40, 5, 2, 128)
    model = run.pretrained.model
    layers = decoder_layers(model)
    optimizer = adamw(model)
    freezer = LayerFreezer(FreezingConfig(criterion="autofreeze", check_every=check_every, percentile=50.0))
    scope = FreezingScope(layers=dict(enumerate(layers)), num_layers=len(layers), optimizers=[optimizer])
    freezer.prepare(scope.layers)
    trace = run.trace(
        "freezing",
        "block needs a backward (AutoFreeze, front-to-back)",
        "1 trainable / 0 frozen",
        f"continued training, AdamW lr {PRETRAINED_LR}, batch {batch} x seq {seq}, {steps} steps; AutoFreeze "
        f"gradient-norm change ratio, interval {check_every} steps, percentile 50; the tied embedding never "
        "freezes",
    )
    batches = token_batches(run.encode, batch_size=batch, seq_len=seq, num_batches=steps)
    for step, tokens in enumerate(batches, start=1):
        loss = lm_step(model, tokens, optimizer, before_step=lambda: freezer.record_gradients(scope))
        report = freezer.step(step, scope)
        extra: dict[str, object] = {"loss": round(loss, 4)}
        if report is not None:
            extra["ratios"] = [None if r is None else round(r, 4) for r in report.ratios]
            extra["threshold"] = report.threshold
        trace.add(TraceRow(step, [0.0 if is_frozen(block) else 1.0 for block in layers], extra))
    return trace
