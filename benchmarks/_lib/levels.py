"""A dynamism measured at a few levels (sparsities, frozen fractions): stage loads, imbalance, projection.

The freezing study (:mod:`benchmarks.freezing`) times every block at each level of its dynamism
(:func:`fwd_bwd_s`, the :func:`fastest` repeat); what follows is shared: each stage's load under a
placement (its blocks plus the pinned first/last-stage parts), the imbalance of static splits, and the
pipeline simulator's step time of static splits, of DynMo re-partitioning at each level and of the best
single placement for the whole run. Everything after the timing is **projected**
from measured per-layer costs (no job runs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dynmo.balancing import (
    BalanceProblem,
    Hardware,
    LayerCost,
    Placement,
    imbalance,
    partition,
    simulate_pipeline,
    uniform,
)
from lightning_dynmo.models import GPT

Seconds = tuple[float, float]  # (forward, backward) seconds of one micro-batch


@dataclass(frozen=True)
class LevelCosts:
    """Per-micro-batch costs at one level of a dynamism.

    Attributes:
        label: The level as a column heading ("90%", "25% frozen").
        costs: Per block, its forward and backward seconds and parameters.
        first: The first-stage parts (embeddings).
        last: The last-stage parts (final norm, head, loss).
    """

    label: str
    costs: list[LayerCost]
    first: Seconds
    last: Seconds


def fwd_bwd_s(fn: Callable[[], Tensor], inputs: Sequence[Tensor]) -> tuple[float, float]:
    """Seconds of one forward and of its backward (gradients w.r.t. ``inputs``, ``.grad`` untouched)."""
    start = time.perf_counter()
    out = fn()
    mid = time.perf_counter()
    torch.autograd.grad(out, list(inputs), torch.ones_like(out))
    return mid - start, time.perf_counter() - mid


def fastest(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """The least disturbed (forward, backward) pair: the repeat with the smallest total."""
    return min(samples, key=sum)


def fastest_of(fn: Callable[[], Tensor], inputs: Sequence[Tensor], repeats: int) -> tuple[float, float]:
    """The :func:`fastest` of ``repeats`` timings of ``fn`` by :func:`fwd_bwd_s`, after one warm-up call."""
    return fastest([fwd_bwd_s(fn, inputs) for _ in range(repeats + 1)][1:])


@dataclass(frozen=True)
class EndParts:
    """A GPT's first-stage parts (embeddings) and last-stage parts (final norm, head, loss) on one
    micro-batch, as calls to time with the tensors their backward differentiates."""

    first: Callable[[], Tensor]
    first_inputs: list[Tensor]
    last: Callable[[], Tensor]
    last_inputs: list[Tensor]


def end_parts(model: GPT, vocab_size: int, rows: int, seq_len: int, d_model: int) -> EndParts:
    """``model``'s first and last parts on ``rows`` random rows of ``seq_len`` tokens."""
    idx = torch.randint(0, vocab_size, (rows, seq_len))
    hidden = torch.randn(rows, seq_len, d_model, requires_grad=True)

    def first() -> Tensor:
        out: Tensor = model.pipeline_first(idx)
        return out

    def last() -> Tensor:
        out: Tensor = model.pipeline_loss(model.pipeline_last(hidden), idx)
        return out

    embeddings: list[Tensor] = [*model.tok_emb.parameters(), *model.pos_emb.parameters()]
    return EndParts(first, embeddings, last, [hidden, *model.ln_f.parameters(), *model.head.parameters()])


def stage_loads(level: LevelCosts, placement: Placement) -> tuple[list[float], list[float]]:
    """Per stage (forward, backward) seconds of one micro-batch: its blocks, plus the pinned parts."""
    stages = range(placement.num_stages)
    fwd = [sum(level.costs[i].fwd_time_s for i in placement.layers_of(s)) for s in stages]
    bwd = [sum(level.costs[i].bwd_time_s for i in placement.layers_of(s)) for s in stages]
    fwd[0] += level.first[0]
    bwd[0] += level.first[1]
    fwd[-1] += level.last[0]
    bwd[-1] += level.last[1]
    return fwd, bwd


def stage_imbalance(level: LevelCosts, placement: Placement) -> float:
    """``(max - min) / mean`` of the stages' forward + backward loads."""
    fwd, bwd = stage_loads(level, placement)
    return imbalance([f + b for f, b in zip(fwd, bwd, strict=True)])


def static_splits(
    costs: Sequence[LayerCost], num_stages: int, embed_params: int, head_params: int
) -> dict[str, Placement]:
    """Megatron's uniform split and DeepSpeed's parameter split (with the pinned parts) of ``costs``."""
    by_params = partition(
        BalanceProblem(
            list(costs),
            by="params",
            hardware=Hardware(
                first_stage_extra=LayerCost(num_params=embed_params),
                last_stage_extra=LayerCost(num_params=head_params),
            ),
        ),
        num_stages,
    )
    return {"uniform": uniform(len(costs), num_stages), "params": by_params}


def simulated_ms(level: LevelCosts, placement: Placement, microbatches: int) -> float:
    """The simulator's 1F1B step time (ms) of ``placement`` at ``level``."""
    fwd, bwd = stage_loads(level, placement)
    return 1e3 * simulate_pipeline(fwd, bwd, microbatches, "1f1b").step_time_s


def dynmo_placement(level: LevelCosts, num_stages: int) -> Placement:
    """The exact min-max partition of the level's costs, first/last parts pinned (DynMo's ``partition``)."""
    hardware = Hardware(
        first_stage_extra=LayerCost(fwd_time_s=level.first[0], bwd_time_s=level.first[1]),
        last_stage_extra=LayerCost(fwd_time_s=level.last[0], bwd_time_s=level.last[1]),
    )
    return partition(BalanceProblem(level.costs, hardware=hardware), num_stages)


def project(
    levels: Sequence[LevelCosts], num_stages: int, microbatches: int, statics: dict[str, Placement]
) -> list[dict[str, Any]]:
    """Simulated step time per level of the static splits, DynMo and the best fixed placement for the run.

    The best fixed placement is the fastest, averaged over the levels, among every level's partition and
    the static splits (computed from the costs, not picked by measurement).
    """
    dynmo = [dynmo_placement(lv, num_stages) for lv in levels]
    pool = {**{str(p): p for p in dynmo}, **{str(p): p for p in statics.values()}}

    def per_level(placements: Sequence[Placement]) -> list[float]:
        return [simulated_ms(lv, p, microbatches) for lv, p in zip(levels, placements, strict=True)]

    best = min(pool.values(), key=lambda p: statistics.mean(per_level([p] * len(levels))))
    rows: list[dict[str, Any]] = [
        {"label": f"static {name}", "per_level": per_level([p] * len(levels)), "placement": str(p)}
        for name, p in statics.items()
    ]
    rows.append(
        {
            "label": "DynMo (re-partition per level)",
            "per_level": per_level(dynmo),
            "placement": " → ".join(dict.fromkeys(str(p) for p in dynmo)),
        }
    )
    rows.append(
        {
            "label": "best fixed for the run",
            "per_level": per_level([best] * len(levels)),
            "placement": str(best),
        }
    )
    dynmo_mean = statistics.mean(rows[-2]["per_level"])
    for row in rows:
        row["mean"] = statistics.mean(row["per_level"])
        row["vs_dynmo"] = row["mean"] / dynmo_mean
    return rows


def projection_table(levels: Sequence[LevelCosts], rows: list[dict[str, Any]]) -> list[str]:
    """:func:`project`'s rows as a table, one column per level."""
    head = " | ".join(f"{lv.label} (ms)" for lv in levels)
    lines = [
        f"| placement | {head} | mean (ms) | this / DynMo | placements |",
        "|---|" + "---:|" * (len(levels) + 2) + "---|",
    ]
    for r in rows:
        cells = " | ".join(f"{v:.2f}" for v in r["per_level"])
        lines.append(
            f"| {r['label']} | {cells} | {r['mean']:.2f} | {r['vs_dynmo']:.2f} | `{r['placement']}` |"
        )
    return lines
