"""CALM early exit on the pretrained model: anytime-loss training, state-saturation confidence, a threshold
set for a quality target; per layer and step, the share of tokens still active.

Training (Schuster et al. 2022): the loss is the weighted mean of every layer's exit loss, weights
``1, 2, ..., L`` (CALM's ``aggregation_weights=1``); an exit is the model's own final norm and tied head
on that layer's output (each exit's head and loss are recomputed in backward, so 30 vocabularies' logits
are never held at once). Confidence: state saturation, ``cos(h_{l-1}, h_l)`` per token (about ``3 d``
operations against a block's ``~24 d^2``: far cheaper than the softmax over 49k words). A token exits at
the first layer ``l >= MIN_EXIT`` whose saturation reaches the threshold ``lambda``; a layer's active
share is the fraction of tokens that have not exited before it. ``lambda`` is recalibrated every
:data:`CALIBRATE_EVERY` steps on a held-out batch: the smallest on a grid whose exits agree with the last
layer's prediction on at least :data:`AGREEMENT_TARGET` of the tokens.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from benchmarks._lib.trained.common import CaseRun
from benchmarks._lib.trained.text import token_batches
from benchmarks._lib.trained.traces import Trace, TraceRow
from benchmarks._lib.trained.training import PRETRAINED_LR, adamw, decoder_layers

__all__ = ["AGREEMENT_TARGET", "active_shares", "calibrate", "exit_layers", "record", "saturation"]

AGREEMENT_TARGET = 0.9
MIN_EXIT = 1
CALIBRATE_EVERY = 5
LOSS_POSITION_DIVISOR = 4
THRESHOLDS = (*(round(0.5 + 0.01 * i, 2) for i in range(50)), 0.995, 0.999, 1.01)


def saturation(states: list[Tensor]) -> Tensor:
    """``[L, B, T]``: ``cos(h_{l-1}, h_l)``, each block's output against its input (embeddings first)."""
    return torch.stack([F.cosine_similarity(a, b, dim=-1) for a, b in itertools.pairwise(states)])


def exit_layers(conf: Tensor, threshold: float) -> Tensor:
    """``[B, T]``: the layer each token exits after.

    That is the first ``l >= MIN_EXIT`` with ``conf[l] >= threshold``, else the last layer.
    """
    eligible = conf >= threshold
    eligible[:MIN_EXIT] = False
    eligible[-1] = True
    return eligible.float().argmax(dim=0)


def active_shares(exits: Tensor, num_layers: int) -> list[float]:
    """Per layer ``j``, the share of tokens that exit at ``j`` or later (still computed in layer ``j``)."""
    return [float((exits >= j).float().mean()) for j in range(num_layers)]


def _states(model: Any, tokens: Tensor) -> list[Tensor]:
    """Embeddings and every block's output (``L + 1`` tensors ``[B, T, d]``) of one forward."""
    outputs: list[Tensor] = []
    handles = [
        layer.register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o))
        for layer in decoder_layers(model)
    ]
    try:
        embeddings = model.model.embed_tokens(tokens)
        model(input_ids=tokens)
    finally:
        for handle in handles:
            handle.remove()
    return [embeddings, *outputs]


def _head(model: Any, hidden: Tensor) -> Tensor:
    logits: Tensor = model.lm_head(model.model.norm(hidden))
    return logits


def calibrate(model: nn.Module, tokens: Tensor) -> tuple[float, float]:
    """``(threshold, agreement)``: the smallest threshold on the grid meeting :data:`AGREEMENT_TARGET`."""
    model.eval()
    with torch.no_grad():
        states = _states(model, tokens)
        predictions = torch.stack([_head(model, h).argmax(-1) for h in states[1:]])  # [L, B, T]
        conf = saturation(states)
    final = predictions[-1]
    for threshold in THRESHOLDS:
        exits = exit_layers(conf, threshold)
        agreement = float((predictions.gather(0, exits.unsqueeze(0))[0] == final).float().mean())
        if agreement >= AGREEMENT_TARGET:
            return threshold, agreement
    raise AssertionError("the last threshold exits nobody early, so it always agrees")  # pragma: no cover


def _anytime_step(model: nn.Module, tokens: Tensor, optimizer: torch.optim.Optimizer) -> tuple[float, Tensor]:
    """One optimizer step on the anytime loss; returns the last layer's loss and the saturations."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    states = _states(model, tokens)
    # Every exit's loss on the same random quarter of the positions: 30 heads over a 49k vocabulary on
    # every token would cost several times the model itself on this CPU; the subset keeps the loss unbiased.
    picked = torch.randperm(tokens.shape[1] - 1)[: max(1, (tokens.shape[1] - 1) // LOSS_POSITION_DIVISOR)]
    targets = tokens[:, 1:][:, picked].reshape(-1)

    def exit_loss(hidden: Tensor) -> Tensor:
        logits = _head(model, hidden[:, picked])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)

    losses = [checkpoint(exit_loss, h, use_reentrant=False) for h in states[1:]]
    weights = torch.arange(1, len(losses) + 1, dtype=torch.float32)
    loss = (torch.stack(losses) * weights).sum() / weights.sum()
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(losses[-1].detach()), saturation([s.detach() for s in states])


def record(run: CaseRun) -> Trace:
    """Train on the anytime loss; per step, each layer's active share under the calibrated threshold."""
    steps, batch, seq = (3, 2, 32) if run.quick else (20, 2, 128)
    model = run.pretrained.model
    num_layers = len(decoder_layers(model))
    optimizer = adamw(model)
    blocks = list(token_batches(run.encode, batch_size=batch, seq_len=seq, num_batches=steps + 1))
    held_out, batches = blocks[0], blocks[1:]
    trace = run.trace(
        "early_exit",
        "tokens still active in the layer (not exited before it)",
        "fraction of tokens",
        f"CALM anytime loss (weights 1..L) on the model's own norm + tied head at every layer, on a random "
        f"1/{LOSS_POSITION_DIVISOR} of the positions per step, continued "
        f"training AdamW lr {PRETRAINED_LR}, batch {batch} x seq {seq}, {steps} steps; state-saturation "
        f"confidence cos(h_l-1, h_l), exits from layer {MIN_EXIT}; threshold = smallest on a grid with "
        "exit/last "
        f"agreement >= {AGREEMENT_TARGET} on a held-out batch, recalibrated every {CALIBRATE_EVERY} steps",
    )
    threshold, agreement = calibrate(model, held_out)
    for step, tokens in enumerate(batches, start=1):
        loss, conf = _anytime_step(model, tokens, optimizer)
        shares = active_shares(exit_layers(conf, threshold), num_layers)
        extra = {"loss": round(loss, 4), "threshold": threshold, "agreement": round(agreement, 4)}
        trace.add(TraceRow(step, shares, extra))
        if step % CALIBRATE_EVERY == 0:
            threshold, agreement = calibrate(model, held_out)
    return trace
