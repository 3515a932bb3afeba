"""A tiny GPT-like model cut into named units, plus the pieces the migration/state tests share.

The block deliberately carries everything a migration can lose: LayerNorm and biases, a registered bool
mask buffer (pruning), a frozen parameter (``requires_grad=False``), a plain ``frozen`` flag, a plain
int call counter and a plain tensor of router statistics. It declares its non-tensor state to
``state_dict`` through ``get_extra_state``/``set_extra_state`` (our save/resume protocol).

The pipeline helpers run the units on torch's own ``PipelineStage`` + ``ScheduleGPipe``; stage ``s`` is
rank ``s`` of the group and runs its units in global order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from lightning_dynmo.pipeline.migration.transport import UnitMove
from lightning_dynmo.pipeline.model.units import unit_sort_key

VOCAB, SEQ, DIM, BATCH, MICROBATCHES = 11, 6, 8, 4, 2


class Block(nn.Module):
    """Pre-LN MLP block with a pruning mask, a frozen gain and plain-attribute dynamism state."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(dim), requires_grad=False)
        self.register_buffer("mask", torch.rand(2 * dim, dim) > 0.3)
        self.frozen = False
        self.calls = 0
        self.router_stats = torch.zeros(2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(self.ln(x), self.fc1.weight * self.mask, self.fc1.bias)
        self.calls += 1
        self.router_stats += h.detach().abs().mean(dim=(0, 1))
        return x + self.gain * self.fc2(F.gelu(h))

    def get_extra_state(self) -> dict[str, Any]:
        return {"frozen": self.frozen, "calls": self.calls, "router_stats": self.router_stats.clone()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.frozen = state["frozen"]
        self.calls = state["calls"]
        self.router_stats = state["router_stats"].clone()


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class ToyModel(nn.Module):
    """The single-process reference: its state_dict keys are the global FQNs the units use."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.embed = Embed()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(num_layers)})
        self.head = Head()

    def units(self) -> dict[str, nn.Module]:
        return {"embed": self.embed, **{f"layers.{i}": b for i, b in self.layers.items()}, "head": self.head}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return run_units(self.units(), ids)


class StageModule(nn.Module):
    """Runs a rank's units in global order (the order a placement guarantees)."""

    def __init__(self, units: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.names = sorted(units, key=unit_order)
        self.parts = nn.ModuleList([units[n] for n in self.names])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


def unit_order(name: str) -> tuple[Any, ...]:
    """embed first, then layers by index, head last."""
    rank = {"embed": 0, "head": 2}.get(name, 1)
    return (rank, unit_sort_key(name))


def run_units(units: Mapping[str, nn.Module], x: torch.Tensor) -> torch.Tensor:
    for name in sorted(units, key=unit_order):
        x = units[name](x)
    return x


def build_model(num_layers: int, seed: int = 0) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel(num_layers)


def make_optimizer(units: Mapping[str, nn.Module]) -> torch.optim.AdamW:
    """AdamW with a decay group and a no-decay group that also differ in lr (catches group mix-ups)."""
    decay, no_decay = [], []
    for name in sorted(units, key=unit_sort_key):
        for p in units[name].parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2}],
        lr=1e-2,
        foreach=False,
    )


def batches(num: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def owners_from_stages(stages: Sequence[Sequence[str]]) -> dict[str, int]:
    """``[["embed", "layers.0"], ["layers.1", "head"]]`` -> unit -> rank."""
    return {name: rank for rank, names in enumerate(stages) for name in names}


def local_units(
    stages: Sequence[Sequence[str]], rank: int, num_layers: int, seed: int = 0
) -> dict[str, nn.Module]:
    """What ``rank`` owns under ``stages`` of a toy model of ``num_layers`` blocks built from ``seed``."""
    owners = owners_from_stages(stages)
    return {n: m for n, m in build_model(num_layers, seed=seed).units().items() if owners[n] == rank}


def moves_between(old: Mapping[str, int], new: Mapping[str, int]) -> list[UnitMove]:
    return [UnitMove(n, old[n], new[n]) for n in sorted(old, key=unit_order) if old[n] != new[n]]


def make_schedule(
    units: Mapping[str, nn.Module],
    *,
    stage_index: int,
    num_stages: int,
    group: dist.ProcessGroup | None = None,
) -> ScheduleGPipe:
    """A fresh stage + GPipe schedule over this rank's units (rebuilt after every migration).

    Static shapes: shape inference would run the blocks on uninitialised inputs and pollute their
    plain-attribute statistics, which these tests compare bitwise.
    """
    mb = BATCH // MICROBATCHES
    hidden = torch.zeros(mb, SEQ, DIM, requires_grad=True)
    inputs = torch.zeros(mb, SEQ, dtype=torch.long) if "embed" in units else hidden
    outputs = torch.zeros(mb, SEQ, VOCAB, requires_grad=True) if "head" in units else hidden
    stage = PipelineStage(
        StageModule(units),
        stage_index,
        num_stages,
        torch.device("cpu"),
        input_args=(inputs,),
        output_args=(outputs,),
        group=group,
    )
    return ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)


def pipeline_step(
    schedule: ScheduleGPipe, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> float | None:
    """One GPipe training step; returns the mean micro-batch loss on the last stage, else None."""
    stage_index, num_stages = schedule._stage.stage_index, schedule._stage.num_stages
    optimizer.zero_grad(set_to_none=True)
    ids, target = batch
    losses: list[torch.Tensor] = []
    if stage_index == 0 and num_stages == 1:
        schedule.step(ids, target=target, losses=losses)
    elif stage_index == 0:
        schedule.step(ids)
    elif stage_index == num_stages - 1:
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    optimizer.step()
    return float(torch.stack(losses).detach().mean()) if losses else None


def reference_step(
    model: ToyModel, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> float:
    """Single-process step with the same micro-batch split and averaging as the pipeline."""
    optimizer.zero_grad(set_to_none=True)
    ids, target = batch
    total = 0.0
    for mids, mtarget in zip(ids.chunk(MICROBATCHES), target.chunk(MICROBATCHES), strict=True):
        loss = loss_fn(model(mids), mtarget) / MICROBATCHES
        loss.backward()
        total += float(loss.detach()) * MICROBATCHES
    optimizer.step()
    return total / MICROBATCHES


def snapshot(units: Mapping[str, nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """Every parameter, buffer, grad, flag, plain attribute and optimizer-state value, keyed by global FQN."""
    out: dict[str, Any] = {}
    for unit_name, unit in units.items():
        for name, p in unit.named_parameters():
            fqn = f"{unit_name}.{name}"
            out[f"param:{fqn}"] = p.detach().clone()
            out[f"requires_grad:{fqn}"] = p.requires_grad
            out[f"grad:{fqn}"] = None if p.grad is None else p.grad.clone()
            for k, opt in enumerate(optimizers):
                for g, group in enumerate(opt.param_groups):
                    if any(q is p for q in group["params"]):
                        out[f"group:{k}:{fqn}"] = g
                for key, value in opt.state.get(p, {}).items():
                    out[f"opt{k}:{fqn}:{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
        for name, b in unit.named_buffers():
            out[f"buffer:{unit_name}.{name}"] = b.clone()
        for sub_name, sub in unit.named_modules():
            for attr in ("frozen", "calls", "router_stats"):
                if hasattr(sub, attr):
                    value = getattr(sub, attr)
                    out[f"attr:{unit_name}.{sub_name}.{attr}"] = (
                        value.clone() if isinstance(value, torch.Tensor) else value
                    )
    return out


def assert_same(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Bitwise equality of two snapshots (tensor dtype, shape and bits; other values by ==)."""
    assert sorted(a) == sorted(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), key
        else:
            assert x == y, f"{key}: {x!r} != {y!r}"
