"""Mixture of Depths on the pretrained model: every other block routed, top-k for training, a trained
causal predictor deciding at run time, capped; per layer and step, the tokens the block processes.

Training rule (Raposo et al. 2024): a scalar router scores each token; each sequence sends its
``k = capacity * T`` best tokens through the block (expert choice, 12.5%); the block's contribution
``f(x)`` of a chosen token is multiplied by ``sigmoid(router)`` (the paper multiplies by the raw score;
the sigmoid keeps the pretrained block's scale bounded) and the rest skip it. Because top-k over the
sequence is not causal, a second, causal predictor (``Linear(d, 1)`` on the detached input, the paper's
auxiliary predictor) learns with a binary cross-entropy to say whether a token is in the top-k. At run
time the predictor decides (logit > 0) and its errors make the processed count vary; the count is capped
at :data:`CAP_MULTIPLE` times the capacity (the best-scored tokens are kept), so no layer runs away.
The trace records, per routed layer and step, the predictor's capped count over the sequence tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from benchmarks._lib.trained.common import CaseRun
from benchmarks._lib.trained.text import token_batches
from benchmarks._lib.trained.traces import Trace, TraceRow
from benchmarks._lib.trained.training import FRESH_LR, PRETRAINED_LR, adamw, lm_step

__all__ = ["CAPACITY", "CAP_MULTIPLE", "MoDLayer", "capped_decision", "record", "route_every_other"]

CAPACITY = 0.125
CAP_MULTIPLE = 2.0


def capped_decision(logits: Tensor, cap: int) -> Tensor:
    """``[B, T]`` bool: tokens with ``logit > 0``, at most ``cap`` per row (the highest logits kept)."""
    wanted = logits > 0
    if cap >= logits.shape[-1]:
        return wanted
    top = torch.topk(logits, cap, dim=-1).indices
    within = torch.zeros_like(wanted).scatter_(-1, top, True)
    return wanted & within


class MoDLayer(nn.Module):
    """A decoder layer run on its top-k tokens only, with a router and a causal run-time predictor.

    Attributes:
        last_predicted: ``[B, T]`` bool, what the predictor would process (capped) in the last forward.
        last_aux: The predictor's BCE loss of the last forward.
    """

    def __init__(self, layer: nn.Module, width: int) -> None:
        super().__init__()
        self.layer = layer
        self.router = nn.Linear(width, 1, bias=False)
        self.predictor = nn.Linear(width, 1)
        nn.init.normal_(self.router.weight, std=0.02)
        self.last_predicted = torch.zeros(0, dtype=torch.bool)
        self.last_aux = torch.zeros(())

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """``x + sigmoid(r) * f(x)`` on the top-k tokens of each row, ``x`` elsewhere."""
        b, t, d = hidden_states.shape
        k = max(1, math.ceil(CAPACITY * t))
        scores = self.router(hidden_states).squeeze(-1)
        chosen = torch.topk(scores, k, dim=-1).indices.sort(dim=-1).values  # causal order among them
        index = chosen.unsqueeze(-1).expand(-1, -1, d)
        subset = hidden_states.gather(1, index)
        cos, sin = kwargs["position_embeddings"]
        trig = chosen.unsqueeze(-1).expand(-1, -1, cos.shape[-1])
        embeddings = (cos.expand(b, -1, -1).gather(1, trig), sin.expand(b, -1, -1).gather(1, trig))
        out = self.layer(subset, position_embeddings=embeddings, attention_mask=None)
        gate = torch.sigmoid(scores.gather(1, chosen)).unsqueeze(-1)
        result = hidden_states.scatter_add(1, index, gate * (out - subset))
        target = torch.zeros(b, t, device=scores.device).scatter_(1, chosen, 1.0)
        predicted = self.predictor(hidden_states.detach()).squeeze(-1)
        self.last_aux = F.binary_cross_entropy_with_logits(predicted, target)
        self.last_predicted = capped_decision(predicted.detach(), math.floor(CAP_MULTIPLE * k))
        return result


def route_every_other(model: Any) -> dict[int, MoDLayer]:
    """Wrap blocks 1, 3, 5, ... in :class:`MoDLayer` (the paper routes every other block)."""
    layers = model.model.layers
    width = int(model.config.hidden_size)
    routed = {}
    for index in range(1, len(layers), 2):
        routed[index] = MoDLayer(layers[index], width)
        layers[index] = routed[index]
    return routed


def record(run: CaseRun) -> Trace:
    """Train MoD with the predictor's BCE; per step, each routed layer's predicted and capped count."""
    steps, batch, seq = (3, 2, 32) if run.quick else (30, 2, 128)
    model = run.pretrained.model
    routed = route_every_other(model)
    optimizer = adamw(
        model, [p for m in routed.values() for p in [*m.router.parameters(), *m.predictor.parameters()]]
    )
    trace = run.trace(
        "mod",
        "tokens the run-time predictor sends through the routed block (capped) / sequence tokens",
        f"fraction of tokens (capacity {CAPACITY}, cap {CAP_MULTIPLE}x capacity)",
        f"MoD on blocks 1, 3, 5, ... (top-{CAPACITY} expert choice in training, sigmoid router gate), causal "
        f"predictor Linear(d, 1) on the detached input trained with BCE; continued training of every "
        f"parameter, AdamW lr {PRETRAINED_LR} (router and predictor {FRESH_LR}), batch {batch} x seq {seq}, "
        f"{steps} steps; the predictor's "
        "capped decisions on each step's batch",
    )

    def aux() -> Tensor:
        return torch.stack([m.last_aux for m in routed.values()]).mean()

    batches = token_batches(run.encode, batch_size=batch, seq_len=seq, num_batches=steps)
    for step, tokens in enumerate(batches, start=1):
        loss = lm_step(model, tokens, optimizer, extra_loss=aux)
        shares = [float(m.last_predicted.float().mean()) for m in routed.values()]
        extra = {"loss": round(loss, 4), "predictor_bce": round(float(aux().detach()), 4)}
        trace.add(TraceRow(step, shares, extra))
    return trace
