"""The six cases as recorded traces: what each statistic costs, the parts, the paper's figures to set beside.

Read :data:`CASES` (per case: its cost curve from a dense block, the statistic of the model without the
dynamism, the paper's figures), then :func:`load_traces` (the trace files of
``benchmarks/results/traces/``), :func:`synthetic_trace` (quick modes) and :func:`cost_trace` (a statistic
trace -> per-step costs of layers, embedding and head + loss), shared by :mod:`benchmarks.replay` and
:mod:`benchmarks.projection`.

Costs are in units of a dense block's forward (one step): where no measured curve is given, each case's
curve is built from the dense block (:data:`DENSE_FWD`, backward twice the forward) and is labelled
``"proportional"`` (time = dense time x statistic share: early exit, MoD, MoE) or says how else it was
made (pruning and sparse attention: only the multiply-adds that the statistic thins scale; freezing: a
frozen block runs forward only). The parts come
from SmolLM2-135M's shape by counting multiply-adds per token (:func:`head_blocks`): its tied head over a
49,152-token vocabulary costs several blocks, the embedding a lookup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_dynmo.balancing import LayerCost
from lightning_dynmo.balancing.trace import CostCurve, CostTrace, StatisticTrace

RESULTS = Path(__file__).resolve().parents[1] / "results"
TRACES = RESULTS / "traces"
DENSE_FWD = 1.0  # a dense block's forward, the unit of every cost here (backward: twice)


@dataclass(frozen=True)
class ModelShape:
    """The widths that set a block's and the head's multiply-adds per token."""

    d_model: int = 576
    d_ff: int = 1536
    kv_width: int = 192  # 3 key/value heads of 64 (grouped-query attention)
    vocab_size: int = 49152
    seq_len: int = 1024


SMOLLM2 = ModelShape()


def head_blocks(shape: ModelShape = SMOLLM2) -> float:
    """The vocabulary head's multiply-adds per token over a dense block's (projections, MLP, scores)."""
    d = shape.d_model
    block = 2 * d * d + 2 * d * shape.kv_width + 3 * d * shape.d_ff + 2 * d * shape.seq_len // 2
    return d * shape.vocab_size / block


def _proportional(dense_statistic: float) -> Callable[[], CostCurve]:
    return lambda: CostCurve.proportional(DENSE_FWD, 2 * DENSE_FWD, dense_statistic)


def _scaling_share(share: float, what: str) -> Callable[[], CostCurve]:
    """Only ``share`` of a dense block's multiply-adds scales with the statistic, the rest is fixed."""
    fixed = 1.0 - share
    points = ((0.0, fixed * DENSE_FWD, 2 * fixed * DENSE_FWD), (1.0, DENSE_FWD, 2 * DENSE_FWD))
    return lambda: CostCurve(points, f"multiply-add share: {share:.0%} of a block ({what}) scales")


def _score_share(shape: ModelShape = SMOLLM2) -> float:
    """The causal attention scores' share of a dense block's multiply-adds per token."""
    d = shape.d_model
    scores = 2 * d * shape.seq_len // 2
    return scores / (2 * d * d + 2 * d * shape.kv_width + 3 * d * shape.d_ff + scores)


def _frozen() -> CostCurve:
    # A frozen prefix needs no backward at all (no weight gradient, no input gradient before it).
    return CostCurve(((0.0, DENSE_FWD, 0.0), (1.0, DENSE_FWD, 2 * DENSE_FWD)), "table: frozen = forward only")


@dataclass(frozen=True)
class TraceCase:
    """How one case's statistic becomes cost, and what the paper reports for it.

    Attributes:
        name: The case.
        curve: Its cost curve (statistic -> a block's seconds, in dense-forward units).
        dense_statistic: The statistic of the model without the dynamism (no pruning, no exit, dense
            attention, nothing frozen); ``None`` where the paper compares static splits of the same model.
        paper_speedup: The paper's speedup and what it is over.
        paper_bubble: The paper's Figure 1 bubble ratios, static -> DynMo, where it quotes them.
        phases: The trace's rows are phases announced by an event (a pruning stage, a freezing
            decision) that DynMo rebalances on, so it runs each phase balanced for it; otherwise rows are
            steps and DynMo decides from the rows before.
        odd_layers_only: The trace holds layers 1, 3, 5, ... only (MoD's routed blocks); the layers
            between are dense blocks (statistic 1.0), put back by :func:`load_traces`.
        every_step: DynMo runs this case with ``every_step=True`` (its recipe: MoE, MoD), deciding after
            every step on each layer's moving average; otherwise on a window's fresh measurement.
    """

    name: str
    curve: Callable[[], CostCurve]
    dense_statistic: float | None
    paper_speedup: str
    paper_bubble: str = "-"
    phases: bool = False
    odd_layers_only: bool = False
    every_step: bool = False


CASES: dict[str, TraceCase] = {
    c.name: c
    for c in (
        # An expert-parallel MoE layer waits for its busiest expert: cost ~ busiest / mean load.
        TraceCase("moe", _proportional(1.0), None, "1.23x over static splits", "~25% -> 8%", every_step=True),
        TraceCase(
            "mod",
            _proportional(1.0),
            None,
            "1.17x over static splits",
            "~18% -> 4%",
            odd_layers_only=True,
            every_step=True,
        ),
        # Stand-in: time proportional to the linear weights' non-zeros (the measured curve replaces it).
        # Phases: the pruner announces every pruning stage (``notify_dynamism("pruned")``).
        TraceCase(
            "pruning",
            _scaling_share(1 - _score_share(), "linear weights"),
            1.0,
            "3.18x over dense Megatron",
            phases=True,
        ),
        TraceCase("freezing", _frozen, 1.0, "2.23x over Egeria", "~40% (static)", phases=True),
        TraceCase(
            "sparse_attention",
            _scaling_share(_score_share(), "attention scores"),
            1.0,
            "4.02x over dense attention",
        ),
        TraceCase("early_exit", _proportional(1.0), 1.0, "4.52x over no exit"),
        TraceCase(
            "dense", _proportional(1.0), 1.0, "- (Megatron, torchtitan: hand-set first/last-stage counts)"
        ),
        TraceCase("synthetic", _proportional(1.0), None, "- (quick mode)"),
    )
}


def newest_cost_curves(folder: Path = RESULTS) -> dict[str, Any] | None:
    """The newest ``cost_curves-<date>.json`` in ``folder`` (from :mod:`benchmarks.trained.cost_curves`)."""
    paths = sorted(folder.glob("cost_curves-*.json"))  # dates sort as text: the last one is the newest
    if not paths:
        return None
    data: dict[str, Any] = json.loads(paths[-1].read_text())
    data["file"] = paths[-1].name
    return data


def case_curve(case: str, measured: dict[str, Any] | None) -> CostCurve:
    """``case``'s measured curve where ``measured`` has it (in units of its dense block's forward, the label
    naming the file), its stand-in from :data:`CASES` otherwise (the label saying so)."""
    found = (measured or {}).get("cases", {}).get(case)
    if found is None:
        standin = CASES[case].curve()
        return dataclasses.replace(standin, label=f"{standin.label} (stand-in: no measured curve)")
    unit = found["dense_block_s"][0]
    points = tuple((x, f / unit, b / unit) for x, f, b in found["points"])
    error = found["fit"].get("max_relative_error", 0.0)
    return CostCurve(
        points, f"measured ({measured and measured['file']}): {found['label']}; linear fit error {error:.0%}"
    )


def load_traces(folder: Path = TRACES) -> list[StatisticTrace]:
    """The newest trace file of each known case in ``folder`` (``<case>-<date>.json``), by case name."""
    newest: dict[str, Path] = {}
    for path in sorted(folder.glob("*.json")):  # dates sort as text: the last one wins
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("case") in CASES and "rows" in data:
            newest[data["case"]] = path
    traces = [StatisticTrace.from_record(json.loads(newest[c].read_text())) for c in CASES if c in newest]
    return [_with_dense_layers(t) if CASES[t.case].odd_layers_only else t for t in traces]


def _with_dense_layers(trace: StatisticTrace) -> StatisticTrace:
    """``trace``'s rows with a dense layer (1.0) before each recorded one: the model's whole depth."""
    rows = tuple(tuple(v for value in row for v in (1.0, value)) for row in trace.values)
    return dataclasses.replace(trace, values=rows)


def synthetic_trace(num_layers: int, rows: int, seed: int = 0) -> StatisticTrace:
    """MoD-like: odd layers routed (a drifting share of tokens), even layers dense; a quick-mode stand-in."""
    draw = random.Random(seed)
    values = tuple(
        tuple(1.0 if i % 2 == 0 else round(draw.uniform(0.1, 0.6), 3) for i in range(num_layers))
        for _ in range(rows)
    )
    return StatisticTrace(
        "synthetic", "share of tokens processed", "fraction", tuple(range(rows)), values, "synthetic"
    )


def dense_trace(num_layers: int) -> StatisticTrace:
    """A model without dynamism, one row: what the head alone does to a static split."""
    return StatisticTrace("dense", "no dynamism", "-", (0,), ((1.0,) * num_layers,), "SmolLM2 shape")


def cost_trace(
    stats: StatisticTrace, head: bool = True, dense: bool = False, curves: Path | None = RESULTS
) -> CostTrace:
    """Per-step costs of ``stats``'s case: layers through its curve, the embedding and head + loss.

    Args:
        stats: The recorded statistics.
        head: Cost the parts (``False``: free embedding and head, the old projection's assumption).
        dense: The model without the dynamism (every value its case's ``dense_statistic``).
        curves: The folder of measured cost-curve files (:func:`newest_cost_curves`): the case's curve
            and the parts from the newest one where it has them; ``None``: stand-ins only.
    """
    name, case = stats.case, CASES[stats.case]
    if dense:
        if case.dense_statistic is None:
            raise ValueError(f"case {stats.case!r} has no model without its dynamism to compare with.")
        stats = stats.uniform(case.dense_statistic)
    measured = newest_cost_curves(curves) if curves is not None else None
    first = LayerCost(fwd_time_s=0.01 * DENSE_FWD, bwd_time_s=0.02 * DENSE_FWD)  # a lookup, a scatter
    blocks = head_blocks()
    last = LayerCost(fwd_time_s=blocks * DENSE_FWD, bwd_time_s=2 * blocks * DENSE_FWD)
    if measured is not None and "parts" in measured:
        unit = measured["parts"]["dense_block"][0]
        (ef, eb), (hf, hb) = measured["parts"]["embedding"], measured["parts"]["head_and_loss"]
        first = LayerCost(fwd_time_s=ef / unit, bwd_time_s=eb / unit)
        last = LayerCost(fwd_time_s=hf / unit, bwd_time_s=hb / unit)
    curve = case_curve(name, measured)  # the case's curve: ``stats.uniform`` renames the trace
    return CostTrace.build(stats, curve, first if head else None, last if head else None)


def trace_parser(prog: str, description: str, quick: str) -> argparse.ArgumentParser:
    """The options of every trace benchmark: --traces, --quick (``quick``: what it runs), --out, --force."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder of trace files")
    parser.add_argument("--quick", action="store_true", help=f"{quick}: a smoke run, not figures")
    parser.add_argument("--out", type=Path, default=None, help="the report's path (default: dated)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing dated report")
    return parser
