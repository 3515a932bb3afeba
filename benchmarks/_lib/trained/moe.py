"""LLaMA-MoE upcycling: each MLP split into experts by its intermediate neurons, a top-k router, continued
training with the load-balancing loss; per layer and step, the busiest expert's load over the mean load.

The split (LLaMA-MoE, Zhu et al. 2024, "neuron-independent" random partition): the ``I`` intermediate
neurons of a SwiGLU MLP are shuffled and cut into ``E`` groups of ``I / E``; expert ``e`` keeps the rows
of ``gate_proj``/``up_proj`` and the columns of ``down_proj`` of its group, so the sum of all experts'
outputs is the MLP's output exactly. A token goes to its ``k`` best experts (:func:`route`, softmax
scores, dropless), each output weighted by its gate and scaled by ``E / k`` (LLaMA-MoE's rescaling, so
the expected output keeps the dense MLP's size); the router is a fresh ``Linear(d, E)`` (no bias, small
random init). The loss adds ``coef`` times the mean over layers of :func:`load_balance_loss`.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._lib.trained.common import CaseRun
from benchmarks._lib.trained.text import token_batches
from benchmarks._lib.trained.traces import Trace, TraceRow
from benchmarks._lib.trained.training import FRESH_LR, PRETRAINED_LR, adamw, decoder_layers, lm_step
from lightning_dynmo.dynamism.moe import MoEOptions, load_balance_loss, route

__all__ = ["UpcycledMoE", "record", "upcycle"]

LOAD_BALANCE_COEF = 0.01


class UpcycledMoE(nn.Module):
    """A SwiGLU MLP split into ``num_experts`` neuron groups with a top-k router.

    Attributes:
        gate: ``[E, I/E, d]`` gate projections; ``up`` the same; ``down``: ``[E, d, I/E]``.
        router: ``Linear(d, E)`` without bias.
        last_load: ``[E]`` assignments per expert in the last forward; ``last_aux``: its balancing loss.
    """

    def __init__(self, mlp: Any, options: MoEOptions, *, generator: torch.Generator) -> None:
        super().__init__()
        intermediate = mlp.gate_proj.weight.shape[0]
        num_experts = options.num_experts
        if intermediate % num_experts:
            raise ValueError(
                f"UpcycledMoE: the MLP's {intermediate} intermediate neurons do not split into "
                f"num_experts={num_experts} equal groups; pick a divisor of {intermediate}."
            )
        groups = torch.randperm(intermediate, generator=generator).view(num_experts, -1)
        self.options = options
        self.act = mlp.act_fn
        self.gate = nn.Parameter(mlp.gate_proj.weight.detach()[groups].clone())
        self.up = nn.Parameter(mlp.up_proj.weight.detach()[groups].clone())
        self.down = nn.Parameter(mlp.down_proj.weight.detach().t()[groups].transpose(1, 2).clone())
        width = self.gate.shape[-1]
        self.router = nn.Linear(width, num_experts, bias=False).to(self.gate.dtype)
        nn.init.normal_(self.router.weight, std=0.02, generator=generator)
        self.last_load = torch.zeros(num_experts, dtype=torch.long)
        self.last_aux = torch.zeros(())

    def expert(self, e: int, rows: Tensor) -> Tensor:
        """Expert ``e``'s SwiGLU on ``rows`` (``[n, d]``)."""
        hidden = self.act(rows @ self.gate[e].t()) * (rows @ self.up[e].t())
        out: Tensor = hidden @ self.down[e].t()
        return out

    def forward(self, hidden: Tensor) -> Tensor:
        """Route each token to its top-k experts; records the load and the balancing loss."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        scores = torch.softmax(self.router(rows).float(), dim=-1)
        routing = route(scores, self.options)
        scale = self.options.num_experts / self.options.top_k
        out = torch.zeros_like(rows)
        for e in range(self.options.num_experts):
            token, slot = torch.nonzero(routing.experts == e, as_tuple=True)
            if token.numel():
                weight = routing.gates[token, slot].to(rows.dtype).unsqueeze(-1) * scale
                out.index_add_(0, token, self.expert(e, rows[token]) * weight)
        self.last_load = routing.load.detach()
        self.last_aux = load_balance_loss(scores, routing.load, self.options.top_k, self.options.score_func)
        return out.view_as(hidden)


def upcycle(model: nn.Module, options: MoEOptions, *, seed: int = 0) -> list[UpcycledMoE]:
    """Replace every block's ``mlp`` by an :class:`UpcycledMoE` built from it; returns them in order."""
    generator = torch.Generator().manual_seed(seed)
    moes = []
    for layer in decoder_layers(model):
        moe = UpcycledMoE(layer.mlp, options, generator=generator)
        layer.mlp = moe
        moes.append(moe)
    return moes


def record(run: CaseRun) -> Trace:
    """Upcycle, train with the balancing loss, and record each layer's max/mean expert load per step."""
    steps, batch, seq = (3, 2, 32) if run.quick else (30, 2, 128)
    options = MoEOptions(num_experts=8, top_k=2, capacity_factor=None, load_balance_coef=LOAD_BALANCE_COEF)
    model = run.pretrained.model
    moes = upcycle(model, options)
    optimizer = adamw(model, [m.router.weight for m in moes])
    trace = run.trace(
        "moe",
        "busiest expert's assignments / mean assignments per expert (top-2 of 8, dropless)",
        "ratio (1 = balanced, 4 = every token in 2 experts)",
        f"LLaMA-MoE upcycling (random neuron split into 8 experts, top-2, E/k output scale, fresh router), "
        f"continued training of every parameter, AdamW lr {PRETRAINED_LR} (router {FRESH_LR}), "
        f"load-balancing coef {LOAD_BALANCE_COEF}, batch {batch} x seq {seq}, {steps} steps; loads of each "
        "step's training forward",
    )

    def aux() -> Tensor:
        return LOAD_BALANCE_COEF * torch.stack([m.last_aux for m in moes]).mean()

    batches = token_batches(run.encode, batch_size=batch, seq_len=seq, num_batches=steps)
    for step, tokens in enumerate(batches, start=1):
        loss = lm_step(model, tokens, optimizer, extra_loss=aux)
        ratios = [float(m.last_load.max()) / float(m.last_load.float().mean()) for m in moes]
        balance = statistics.fmean(float(m.last_aux.detach()) for m in moes)
        trace.add(TraceRow(step, ratios, {"loss": round(loss, 4), "load_balance_loss": round(balance, 4)}))
    return trace
